"""Batch shapes counted as the runner does the work: by hand, the causal kernel's tiles, and against
what `PagedAttention` really plans for a step (gathered and in place)."""

from types import SimpleNamespace

import pytest
import torch

from kvstrata.kvcache.prefix_groups import group_cost_tokens, group_decodes
from kvstrata.model import kernels
from kvstrata.model.network.attention import PagedAttention
from kvstrata.sim.batch_shape import KERNEL_TILE, BatchShape, causal_pairs
from kvstrata.worker.runner import ModelRunner

BS = 16


def chunk(start: int, n: int, blocks: list[int]) -> SimpleNamespace:
    """A `ScheduledChunk` as the runner and BatchShape read it."""
    return SimpleNamespace(start=start, token_ids=[1] * n, block_ids=blocks, group_block_ids=(), num_tokens=n,
                           sample=True, draft_token_ids=(),
                           request=SimpleNamespace(wants_prompt_logprobs=False, adapter=None))


# ---- batch shapes -------------------------------------------------------------------------------
def test_batch_shape_by_hand():
    fresh = chunk(0, 100, list(range(7)))
    later = chunk(40, 20, list(range(10, 14)))                   # keys 0..59: 4 blocks, padded to 64
    shape = BatchShape.of([fresh, later], BS)
    assert shape == BatchShape(prefill_tokens=120, decode_seqs=0, kv_tokens_read=64, attention_pairs=100 * 100,
                               masked_pairs=20 * 64, prefill_chunks=2, decode_groups=0, decode_pairs=0,
                               decode_segments=0, lone_decode_pairs=0, prefix_pairs=0)
    shared = list(range(100, 140))                                # 40 blocks every decode holds
    grouped = [chunk(40 * BS + 3, 1, shared + [200 + i]) for i in range(3)]
    loose = [chunk(9, 1, [300]), chunk(29, 1, [301, 302])]         # 1 and 2 blocks: padded to 2 each
    shape = BatchShape.of(grouped + loose, BS)
    assert shape.decode_groups == 1 and shape.decode_seqs == 5 and shape.decode_segments == 2
    assert shape.kv_tokens_read == (40 + 3 * 1 + 2 * 2) * BS       # the prefix once, own blocks, padding
    assert shape.prefix_pairs == 3 * 40 * BS                       # but attended by each of the 3
    assert shape.decode_pairs == (3 * 1 + 2 * 2) * BS
    assert shape.lone_decode_pairs == 0                            # 3 grouped, 2 batched
    one = BatchShape.of([chunk(100, 1, list(range(7)))], BS)
    assert (one.kv_tokens_read, one.decode_pairs, one.decode_segments, one.lone_decode_pairs) == (7 * BS, 7 * BS, 1,
                                                                                                   7 * BS)
    left = BatchShape.of(grouped + loose[:1], BS)                  # one decode outside the group: alone
    assert left.decode_segments == 2 and left.lone_decode_pairs == 1 * BS
    assert BatchShape.alone(100, 1, BS) == one and BatchShape.alone(40, 20, BS) == BatchShape.of([later], BS)



def test_causal_pairs_are_whole_key_tiles_up_to_the_diagonal():
    """A chunk of up to 512 tokens is one key tile: every pair is computed, masked or not. Longer,
    its query tiles of 256 (from 768 rows) compute the key tiles of 512 they reach."""
    assert [causal_pairs(n) for n in (1, 16, 100, 512)] == [1, 16 * 16, 100 * 100, 512 * 512]
    assert causal_pairs(1024) == 256 * 512 + 256 * 512 + 256 * 1024 + 256 * 1024
    assert causal_pairs(1000) == 256 * 512 + 256 * 512 + 256 * 1000 + 232 * 1000
    assert causal_pairs(600) == 512 * 512 + 64 * 600 + 24 * 600          # query tiles of 64
    assert BatchShape.alone(0, 1000, BS).attention_pairs == causal_pairs(1000)



def _planned(chunks: list[SimpleNamespace], in_place: bool,
             window: int | None = None) -> tuple[int, int, int, int, int, int | None]:
    """Tokens PagedAttention gathers for these chunks, planned exactly as the runner plans a step
    (in place: and the keys the kernel makes ready for prefill chunks); tokens its decode attention
    covers (each row's own segment or, in place, its 16-key tiles); its decode attention calls;
    tokens attended by calls for one decode; tokens of the groups' prefixes, per member; in place,
    the query-key pairs the kernel computes for prefill chunks (16-key tiles up to each position). `window`: as a
    sliding layer's plan has them."""
    decodes = [c for c in chunks if c.num_tokens == 1]
    order, groups = group_decodes([c.block_ids for c in decodes], [c.start + 1 for c in decodes], BS,
                                  group_cost_tokens(in_place))
    ordered = [decodes[i] for i in order] + [c for c in chunks if c.num_tokens != 1]
    batch = ModelRunner.build_batch(SimpleNamespace(block_size=BS, device=torch.device("cpu")), ordered, groups)
    attention = PagedAttention(num_heads=9, num_kv_heads=3, head_dim=64,
                               kernel=kernels.face(kernels.PagedDecode) if in_place else None)
    assert attention.reads_in_place(BS, torch.float32, torch.device("cpu")) == in_place
    plan = attention.plan(batch, BS, num_blocks=1024, dtype=torch.float32, window=window)
    planes = 2 * 3
    rows = 0 if plan.decode_rows is None else plan.decode_rows.shape[0]
    rows += sum(p.rows.shape[0] for p in plan.prefills if p.rows is not None)
    prefixes = sum((seg.end - seg.start) * seg.blocks * BS for seg in plan.prefixes)
    if not in_place:
        own = sum((seg.end - seg.start) * seg.blocks * BS for seg in plan.own)
        lone = sum(seg.blocks * BS for seg in plan.own if seg.end - seg.start == 1)
        return rows // planes * BS, own, len(plan.own), lone, prefixes, None
    tile, call, prefill = KERNEL_TILE, plan.in_place, plan.rows
    kernel = 0 if call is None else sum(-(-int(n) // tile) * tile - int(f) // tile * tile
                                        for f, n in zip(call.first, call.lens))
    ready = pairs = 0
    if prefill is not None:
        assert not plan.prefills
        low = (lambda keys: 0) if window is None else (lambda keys: max(0, keys - window) // tile * tile)  # noqa: E731
        for s, keys in enumerate(prefill.lens.tolist()):
            n = int(prefill.starts[s + 1] - prefill.starts[s])
            ready += -(-keys // tile) * tile - low(keys - n + 1)
            pairs += sum(-(-(keys - n + 1 + i) // tile) * tile - low(keys - n + 1 + i) for i in range(n))
    lone = kernel if len(decodes) == 1 else 0
    return rows // planes * BS + ready, kernel, int(call is not None), lone, prefixes, pairs



@pytest.mark.parametrize("window", [None, 24, 100], ids=["global", "window-24", "window-100"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gathered"])
@pytest.mark.parametrize("case", ["shared", "distinct", "mixed", "small-shared", "one"])
def test_batch_shape_counts_what_paged_attention_gathers_and_attends(case, in_place, window):
    """Every decode and chunk mix, planned as a global layer's and as sliding layers' (a window shorter than a fresh
    chunk, and one longer than most contexts here)."""
    shared = list(range(500, 540))
    if case == "shared":
        chunks = [chunk(40 * BS + i, 1, shared + [600 + i]) for i in range(6)]
    elif case == "distinct":
        chunks = [chunk(16 * i + 5, 1, list(range(100 * i, 100 * i + i + 1))) for i in range(1, 7)]
    elif case == "small-shared":                                 # shares too little to be worth a group
        chunks = [chunk(2 * BS + 1, 1, shared[:2] + [600 + i]) for i in range(4)]
    elif case == "one":
        chunks = [chunk(70, 1, [700, 701, 702, 703, 704]), chunk(0, 50, [800, 801, 802, 803])]
    else:
        chunks = ([chunk(40 * BS + i, 1, shared + [600 + i]) for i in range(4)]
                  + [chunk(70, 1, [700, 701, 702, 703, 704])]
                  + [chunk(0, 50, [800, 801, 802, 803]), chunk(33, 64, [900 + i for i in range(7)])])
    shape = BatchShape.of(chunks, BS, in_place, ((window, 1.0),))
    *counted, pairs = _planned(chunks, in_place, window)
    assert (shape.kv_tokens_read, shape.decode_pairs, shape.decode_segments, shape.lone_decode_pairs,
            shape.prefix_pairs) == tuple(counted)
    if in_place:                                   # prefill chunks: the kernel's tiles, nothing masked
        assert (shape.attention_pairs, shape.masked_pairs) == (pairs, 0)
