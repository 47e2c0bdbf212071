"""A GGUF's Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K / BF16 matrices served at their own bits (`--quantization gguf`): the kernel
multiplies by exactly what gguf-py dequantizes (activations quantized to int8 blocks, as llama.cpp does; float32
for BF16), its AVX-512 VNNI, AVX2 and plain paths give the same bits, a row's result does not depend on its
batch, other types are widened with a warning, and the engine's greedy outputs are the same with every cache
feature on as off."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvstrata.core.config import EngineConfig, ModelConfig
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.model import kernels
from kvstrata.model.formats.dense import PackedLinear
from kvstrata.model.formats.gguf import GGUFLinear, as_q4_1
from kvstrata.model.kernels.gguf import GGUF_TYPES
from kvstrata.model.loader import load_model
from tests.model.model_helpers import ALL_BF16, GGUF_MATRICES, Seq, new_cache, run_step, save_tiny_hf_model, tiny_gguf
from tests.model.model_helpers import TINY_LLAMA as TINY


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))


def quantized(kind: str, shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random matrix as a GGUF type's raw rows, and what gguf-py dequantizes them to (float64). gguf-py
    cannot quantize to the K-quants: their blocks are random bytes with small float16 scales (every quant, scale
    and bit of the layout reached)."""
    rng = np.random.default_rng(seed)
    if kind in K_SCALES:
        size, scales = GGUF_TYPES[kind].block_bytes, K_SCALES[kind]
        blocks = rng.integers(0, 256, (shape[0], shape[1] // 256, size), dtype=np.uint8)
        for at in scales:
            blocks[..., at:at + 2] = rng.uniform(1e-3, 4e-3, blocks.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
            blocks[3, :, at:at + 2] = 0                         # d = 0 (and dmin = 0)
        raw = blocks.reshape(shape[0], -1)
    else:
        w = rng.normal(0, 0.3, shape).astype(np.float32)
        w[3] = 0.0                                              # an all-zero row: d = 0
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])).double()


# Where a K-quant block keeps its float16 scales: Q6_K's d; Q4_K's and Q5_K's d and dmin
K_SCALES = {"Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2)}
# The kernel's bytes a weight (csrc/gguf_blocks.h's table): the file's, but a byte a weight for 5- and 6-bit quants
# and float32 scales for the K-quants' blocks of 32
PACKED_BYTES = {"Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q8_0": 34 / 32, "Q5_0": 34 / 32, "Q5_1": 36 / 32,
                "Q4_K": 24 / 32, "Q5_K": 40 / 32, "Q6_K": 36 / 32, "BF16": 2}


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x (M, in) as the kernel quantizes it (blocks of 32, scale max|x| / 127, round half to even), float64."""
    xb = x.float().view(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(xb * inverse) * d).view_as(x).double()


def at_each_level(kind: str, raw: torch.Tensor, bias: torch.Tensor | None = None) -> list[GGUFLinear]:
    """The matrix packed by the kernel built for each ISA level this CPU can run (kvstrata.model.kernels.isa)."""
    return [GGUFLinear.from_rows(kind, raw, bias, kernels.face(kernels.GGUFMatmul, level)) for level in kernels.isa.levels_here()]


@pytest.mark.parametrize("kind", list(GGUF_TYPES))
def test_the_kernel_multiplies_by_what_gguf_py_dequantizes_and_every_path_gives_the_same_bits(kind):
    raw, weights = quantized(kind, (72, 256), seed=1)           # 72 rows: a last tile of 8
    bias = torch.randn(72)
    x = torch.randn(9, 256)
    x[4, :32] = 0.0                                             # an all-zero activation block
    assert weights.abs().max() > 0 and float(weights[3].abs().max()) == 0.0
    outs = [linear(x) for linear in at_each_level(kind, raw, bias)]
    assert len(outs) >= 4 or kernels.level() < kernels.Level.AVX512_VNNI    # on AVX-512 VNNI every path ran
    assert all(torch.equal(out, outs[0]) for out in outs), "the ISA paths differ"
    y = outs[-1]
    exact = (x.double() if kind == "BF16" else int8_blocks(x)) @ weights.t() + bias.double()
    assert y.dtype == torch.float32
    if kind == "BF16":          # a chain of 256 float32 FMAs: within 256 units of roundoff of the sum of |terms|
        assert ((y.double() - exact).abs() <= 257 * 2.0 ** -24 * (x.double().abs() @ weights.abs().t() + 1)).all()
    else:                       # integer block sums: exact but for a few float32 roundings
        assert (y.double() - exact).abs().max() <= 1e-6 * exact.abs().max()
    plain = x.double() @ weights.t() + bias.double()            # int8 activations: a few parts in a thousand
    assert (y.double() - plain).abs().max() <= 2e-2 * plain.abs().max()
    linear = GGUFLinear.from_rows(kind, raw, bias)
    assert torch.equal(linear(x[:1]), y[:1]) and torch.equal(linear(x[3:8]), y[3:8])
    assert linear.nbytes == 80 * 256 * PACKED_BYTES[kind]          # rows to 16
    unbiased, xb = GGUFLinear.from_rows(kind, raw), x.bfloat16()   # bf16 in, bf16 out: the float32 sums rounded once
    assert torch.equal(unbiased(xb), unbiased(xb.float()).bfloat16())


def test_bf16_rows_get_the_bits_of_vdpbf16ps_on_every_path():
    """VDPBF16PS (the AVX512-BF16 level) flushes denormals: the FMA paths do too, so products below float32's normal
    range sum to exactly 0 on every path, and ordinary rows give the same bits whatever path and dtype they take."""
    raw, _ = quantized("BF16", (40, 96), seed=6)
    x = torch.randn(5, 96).bfloat16()
    tiny = torch.full((16, 96), 2.0 ** -70).bfloat16().view(torch.uint8).reshape(16, -1)
    linears = at_each_level("BF16", raw)
    outs, floats = [linear(x) for linear in linears], [linear(x.float()) for linear in linears]
    assert all(torch.equal(out, outs[0]) for out in outs) and all(torch.equal(f, floats[0]) for f in floats)
    assert torch.equal(outs[0], floats[0].bfloat16()) and outs[0].abs().max() > 0
    for level, linear in zip(kernels.isa.levels_here(), at_each_level("BF16", tiny)):   # each product 2^-140:
        assert linear(x.abs() * 2.0 ** -70).abs().max() == 0, level                      # denormal, flushed


def test_packed_weights_start_on_a_huge_page():
    """Big packed matrices are 2 MiB aligned and marked for transparent huge pages (fewer TLB misses per step)."""
    from kvstrata.model.kernels.memory import HUGE_PAGE, huge_page_bytes
    big, small = huge_page_bytes(3 * HUGE_PAGE + 5), huge_page_bytes(1000)
    assert big.numel() == 3 * HUGE_PAGE + 5 and small.numel() == 1000
    assert big.data_ptr() % HUGE_PAGE == 0
    big.fill_(7)
    assert int(big.sum()) == 7 * big.numel()
    raw, _ = quantized("BF16", (2048, 1024), seed=7)                      # 4 MiB packed
    assert GGUFLinear.from_rows("BF16", raw).packed.data_ptr() % HUGE_PAGE == 0


def test_q4_0_rows_as_q4_1_are_the_same_weights():
    raw, weights = quantized("Q4_0", (32, 128), seed=4)
    as_q4_1_weights = gguf.quants.dequantize(as_q4_1(raw).numpy(), gguf.GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(as_q4_1_weights, weights.numpy())
    x = torch.randn(3, 128)           # the same sums, but Q4_1's minimum is its own term: other roundings
    exact = int8_blocks(x) @ weights.t()
    assert (GGUFLinear.from_rows("Q4_1", as_q4_1(raw))(x).double() - exact).abs().max() <= 1e-6 * exact.abs().max()


# In a child whose CPU is capped at AVX2 (kvstrata.core.machine.isa_cap_environ): every kernel takes its AVX2 build
# and the GGUF kernel gives the bits the uncapped process gives.
CAPPED_CHECK = """
import json, sys, torch
from kvstrata.core.machine import machine
from kvstrata.model import kernels
from kvstrata.model.formats.gguf import GGUFLinear
kind, raw, x = torch.load(sys.argv[1])
linear = GGUFLinear.from_rows(kind, raw)
print(json.dumps({"isa": machine().isa, "level": kernels.level().label, "built": linear.kernel.lib.level,
                  "y": linear(x).tolist()}))
"""


@pytest.mark.parametrize("kind", ["Q4_1", "BF16"])
def test_the_kernel_under_an_avx2_cap(tmp_path, kind):
    from kvstrata.core.machine import isa_cap_environ
    raw, _ = quantized(kind, (48, 128), seed=2)
    x = torch.randn(5, 128)
    torch.save((kind, raw, x), tmp_path / "case.pt")
    done = subprocess.run([sys.executable, "-c", CAPPED_CHECK, str(tmp_path / "case.pt")],
                          env={**os.environ, **isa_cap_environ("avx2")}, capture_output=True, text=True,
                          timeout=120, check=True, cwd=Path(__file__).resolve().parents[2])
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "avx512f" not in seen["isa"] and seen["level"] == "avx2" and seen["built"] == kernels.Level.AVX2, seen
    assert torch.equal(torch.tensor(seen["y"]), GGUFLinear.from_rows(kind, raw)(x))


MIXED = {**dict.fromkeys(GGUF_MATRICES, "Q4_0"), "attn_output": "Q4_1", "token_embd": "Q8_0", "ffn_down": "F16"}


@pytest.fixture
def quantized_gguf(tmp_path):
    """A tiny model written as a Q4_0 GGUF, but Q4_1 attention output, Q8_0 embeddings and F16 ffn_down."""
    return tiny_gguf(tmp_path, TINY, MIXED, seed=3)


def test_a_gguf_is_served_at_its_own_bits_and_other_types_widened_with_a_warning(quantized_gguf, caplog):
    with caplog.at_level(logging.WARNING):
        own = load_model(ModelConfig(model=str(quantized_gguf), quantization="gguf", dtype="float32"))
    widened = load_model(ModelConfig(model=str(quantized_gguf), quantization="none", dtype="float32"))
    layer = own.model.layers[0].projections
    assert all(isinstance(layer[name], GGUFLinear) for name in ("qkv", "o", "gate_up"))
    assert layer["o"].kind == "Q4_1" and layer["qkv"].kind == "Q4_0" and own.model.head.kind == "Q8_0"
    assert isinstance(layer["down"], PackedLinear) and isinstance(own.model.head, GGUFLinear)
    packed = [p.packed for l in own.model.layers for p in l.projections.values() if isinstance(p, GGUFLinear)]
    assert len({p.untyped_storage().data_ptr() for p in packed + [own.model.head.packed]}) == 1   # one arena
    assert "2 matrices widened to float32 (2 F16)" in caplog.text
    assert own.fingerprint != widened.fingerprint            # KV of one weight format never serves the other
    logits = {}
    for name, loaded in (("own", own), ("widened", widened)):
        seq = Seq(list(range(3, 60)), blocks=[3, 1, 0, 2])
        kv = new_cache(loaded, 4, 16)
        run_step(loaded.model, kv, [(seq, 50)])
        for _ in range(7):
            run_step(loaded.model, kv, [(seq, 1)])
        logits[name] = torch.stack(seq.logits)
    # the same weights: only the kernel's int8 activation blocks differ from the float32 model
    assert (logits["own"] - logits["widened"]).abs().max() <= 0.05 * logits["widened"].abs().max()


def test_only_a_gguf_on_cpu_has_own_bits(tmp_path):
    save_tiny_hf_model(tmp_path / "hf", TINY)
    with pytest.raises(ValueError, match="did not come from a GGUF file"):
        load_model(ModelConfig(model=str(tmp_path / "hf"), quantization="gguf"))
    with pytest.raises(ValueError, match="dummy weights have none"):
        load_model(ModelConfig(model="llama-3.2-1b", load_format="dummy", quantization="gguf"))


@pytest.mark.parametrize("types", [MIXED, ALL_BF16], ids=["mixed", "bf16"])
def test_greedy_outputs_at_own_bits_are_the_same_with_every_cache_feature_on_as_off(types, tmp_path):
    """Prefix caching, a host tier and the disk store, preemption and reloads, against none of them."""
    loaded = load_model(ModelConfig(model=str(tiny_gguf(tmp_path, TINY, types, seed=3)), quantization="gguf"))
    shared = list(range(5, 69))
    prompts = [shared + [i, i + 1, i + 2] for i in range(6)] + [shared[:40]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run(**options) -> tuple[list[list[int]], dict[str, int]]:
        engine = LLMEngine(EngineConfig.from_options(audit_every_step=True, block_size=16, **options), loaded=loaded)
        first = engine.generate(prompts[:3], params)
        rest = engine.generate(prompts[3:], params)               # revisits what the first round cached
        return [out.new_token_ids for out in first + rest], dict(engine.tiers.stats.hit_tokens)

    plain, plain_hits = run(num_device_blocks=64, enable_prefix_caching=False)
    cached, hits = run(num_device_blocks=12, num_host_blocks=8, store="disk", store_path=str(tmp_path / "store"))
    assert sum(plain_hits.values()) == 0 and sum(hits.values()) > 0, hits
    assert all(len(out) == 24 for out in plain) and cached == plain     # every request ran to its end
