"""The paged decode kernel (kvstrata/model/kernels/csrc/paged_attention.cpp) against float64 attention.

It reads K/V from the cache through block tables and returns each query row's output and
log-sum-exp; model-level equality with the torch path is in test_cascade.py (both paths) and
test_engine.py. The kernel must build here: a missing compiler fails these tests rather than
skipping them (set KVSTRATA_KERNELS=0 to run without it, and the kernel tests are then skipped)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvstrata.model import kernels
from kvstrata.sim.batch_shape import KERNEL_TILE
from tests.model.model_helpers import kernels_on

pytestmark = kernels_on
# This CPU's own build, and (in the slow suite: a build each) the lower ISA levels it can also run.
LEVELS = [pytest.param(level, marks=[] if level == kernels.level() else [pytest.mark.slow], id=level.label)
          for level in kernels.isa.levels_here()]


@pytest.fixture(scope="module", params=LEVELS)
def kernel(request) -> kernels.PagedDecode:
    built = kernels.face(kernels.PagedDecode, request.param)
    assert built is not None, "the paged kernel did not build: is g++ installed?"
    return built


def test_every_level_with_fma_gives_this_cpus_bits(kernel):
    """The ISA levels differ in instructions, not in roundings, but for the baseline build, which has no FMA."""
    q, kv, tables, first, lens = random_case(torch.bfloat16, 16, 3, 64, seed=7)
    outs = []
    for built in (kernel, kernels.face(kernels.PagedDecode)):
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
        built(q, kv, tables, first, lens, 0.125, out, lse)
        outs.append((out, lse))
    same = torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert same == (kernel.lib.level >= kernels.Level.AVX2)


def reference(q, kv, tables, first, lens):
    """float64 softmax attention of q (n, KVH, G, D) over keys [first, lens) of each table."""
    n, kvh, g, d = q.shape
    outs, lses = [], []
    for i in range(n):
        keys = kv[:, :, tables[i]].reshape(2, kvh, -1, d)[:, :, first[i]:lens[i]].double()
        s = (q[i].double() * d ** -0.5) @ keys[0].transpose(-1, -2)
        outs.append(torch.softmax(s, -1) @ keys[1])
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs), torch.stack(lses)


def random_case(dtype, bs, g, d, seed):
    """Five sequences whose key ranges start and end on and off 16-key tiles and blocks."""
    gen = torch.Generator().manual_seed(seed)
    kvh, num_blocks = 2, 400
    kv = torch.randn(2, kvh, num_blocks, bs, d, generator=gen).to(dtype)
    lens = torch.tensor([1, 16, 17, 33, 70])
    first = torch.tensor([0, 0, 16, 3, 48])
    width = -(-70 // bs)
    tables = torch.randperm(num_blocks, generator=gen)[:5 * width].view(5, width)
    return torch.randn(5, kvh, g, d, generator=gen), kv, tables, first, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_float64_attention(kernel, dtype):
    """Every block size the engine allows around the 16-key tile, and head shapes from 1 x 16 to 16 x 16:
    query rows go through the tile four at a time, so 7 leaves a remainder of three and 16 is the most."""
    cases = 0
    for bs, (g, d) in itertools.product((1, 4, 8, 16, 32), ((1, 16), (2, 16), (3, 64), (7, 32), (8, 128), (16, 16))):
        q, kv, tables, first, lens = random_case(dtype, bs, g, d, seed=cases)
        assert kernel.supports(dtype, g, d, bs, torch.device("cpu"))
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
        kernel(q, kv, tables, first, lens, d ** -0.5, out, lse)
        ref_out, ref_lse = reference(q, kv, tables, first, lens)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=0)
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=0)
        cases += 1
    assert cases == 30


def test_a_row_gets_the_same_bits_in_any_batch(kernel):
    """The order of every sum depends on the row alone: a sequence alone, first of five, or last of
    five (maybe on another thread) gives bit-identical output."""
    q, kv, tables, first, lens = random_case(torch.bfloat16, 16, 3, 64, seed=99)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    kernel(q, kv, tables, first, lens, 0.125, out, lse)
    for i in (0, 3, 4):
        alone, alone_lse = torch.empty_like(q[i:i + 1]), torch.empty(1, *q.shape[1:3])
        kernel(q[i:i + 1].contiguous(), kv, tables[i:i + 1], first[i:i + 1], lens[i:i + 1], 0.125, alone, alone_lse)
        assert torch.equal(alone[0], out[i]) and torch.equal(alone_lse[0], lse[i])


def rows_case(dtype, bs, g, d, seed):
    """Three segments of positions in one call, each with its own shuffled blocks: a chunk that starts
    its sequence, one after 37 cached keys, one after 96 (on a tile boundary), and their lens."""
    gen = torch.Generator().manual_seed(seed)
    kvh, num_blocks, sizes, cached = 2, 600, [70, 5, 21], [0, 37, 96]
    kv = torch.randn(2, kvh, num_blocks, bs, d, generator=gen).to(dtype)
    lens = torch.tensor([c + n for c, n in zip(cached, sizes)])
    width = -(-int(lens.max()) // bs)
    tables = torch.randperm(num_blocks, generator=gen)[:3 * width].view(3, width)
    starts = torch.tensor([0, *itertools.accumulate(sizes)])
    return torch.randn(sum(sizes), kvh, g, d, generator=gen), kv, tables, starts, lens


def per_position(tables, starts, lens, window=0):
    """The decode kernel's view of a rows call: each position's table row, first key and key count."""
    table_rows, ends = [], []
    for s in range(len(lens)):
        n = int(starts[s + 1] - starts[s])
        table_rows += [s] * n
        ends += [int(lens[s]) - (n - 1 - i) for i in range(n)]
    ends = torch.tensor(ends)
    first = (ends - window).clamp(min=0) if window else torch.zeros(len(ends), dtype=torch.int64)
    return tables[table_rows], first, ends


def released(kv, tables, starts, lens, window):
    """A sliding layer's tables: each segment's blocks before its first position's window point at a block of
    NaNs (the runner points them at block 0), so a key read outside a window shows in the output."""
    spare = min(set(range(kv.shape[2])) - set(tables.flatten().tolist()))
    kv[:, :, spare] = float("nan")
    tables = tables.clone()
    for s in range(len(lens)):
        low = max(0, int(lens[s]) - int(starts[s + 1] - starts[s]) + 1 - window)
        tables[s, :low // kv.shape[3]] = spare
    assert (tables == spare).any()
    return tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7, 16, 29])
def test_rows_equal_float64_attention_and_the_decode_path_bit_for_bit(kernel, dtype, window):
    """Prefill chunks through the many-rows path: within float32 rounding of float64 attention, and each
    row bit-identical to what the decode kernel gives it, so a token's K/V do not depend on the path
    that computed them. Runs of 4, 3 and 1 rows (G = 3 and 7 at the diagonal, G = 1 and 16) and head
    dim 16 (one vector per row). The 5-position segment is read in place (a verification's size), the
    others through prepared tiles. With a window (a sliding layer: on and off the 16-key tile) each position
    sees its last `window` keys, its table holds nothing before the window (NaN blocks there), and the decode
    path it must match starts at the window too."""
    cases = 0
    for bs, (g, d) in itertools.product((1, 4, 16, 32), ((1, 16), (3, 64), (7, 32), (16, 16), (2, 128))):
        q, kv, tables, starts, lens = rows_case(dtype, bs, g, d, seed=cases)
        if window:
            tables = released(kv, tables, starts, lens, window)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
        kernel.rows(q, kv, tables, starts, lens, d ** -0.5, out, lse, window)
        position_tables, first, ends = per_position(tables, starts, lens, window)
        ref_out, ref_lse = reference(q, kv, position_tables, first, ends)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=0)
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=0)
        decoded, decoded_lse = torch.empty_like(q), torch.empty(q.shape[:3])
        kernel(q, kv, position_tables, first, ends, d ** -0.5, decoded, decoded_lse)
        assert torch.equal(out, decoded) and torch.equal(lse, decoded_lse), (bs, g, d)
        cases += 1
    assert cases == 20


def test_shapes_it_cannot_read_take_the_torch_path(kernel):
    cpu = torch.device("cpu")
    assert not kernel.supports(torch.float16, 3, 64, 16, cpu)          # no fp16 loads
    assert not kernel.supports(torch.float32, 3, 72, 16, cpu)          # head dim not a multiple of 16
    assert not kernel.supports(torch.float32, 3, 64, 16, torch.device("meta"))


def test_the_simulator_counts_the_kernel_tile(kernel):
    assert kernel.lanes == KERNEL_TILE


def test_exact_attention_in_the_kernel_enters_the_fingerprint(kernel, monkeypatch):
    """Exact sums give other last bits in the kernel than in float64, so engines with and without the
    kernel never share KV under them; plain bf16 (not exact either way) keeps one fingerprint."""
    from kvstrata.core.config import ModelConfig
    from kvstrata.model.loader import load_model

    def fingerprints():
        return [load_model(ModelConfig(dtype="bfloat16", device="cpu", quantization="none", batch_invariant=exact)).fingerprint
                for exact in (True, False)]

    with_kernel = fingerprints()
    face = kernels.face
    monkeypatch.setattr(kernels, "face", lambda kind, at=None: None if kind is kernels.PagedDecode else face(kind, at))
    without = fingerprints()
    assert with_kernel[0] != without[0] and with_kernel[1] == without[1]
