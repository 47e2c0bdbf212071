"""A step's decoder layers in one C++ call (kvstrata.model.fused_layers) and RoPE with the K/V write in one
(`NormAct.rope_store`): the same bits as torch's ops and the Python loop, for every kind of step the engine
runs, taken only where they can be."""

from __future__ import annotations

import pytest
import torch

from kvstrata.core.config import ModelConfig
from kvstrata.kvcache.buffers import KVCacheSpec, PagedKVCache
from kvstrata.model.kernels import decoder_layers, gguf_matmul, norm_act, paged_decode
from kvstrata.model.loader import load_model
from kvstrata.model.rope import apply_rotary
from tests.model.model_helpers import (ALL_BF16, GGUF_MATRICES, TINY_LLAMA as TINY, Seq, new_cache, run_step,
                                       tiny_gguf)

# loaded here, from the usual kernel cache (`make install` built them), before the tests' private caches
pytestmark = pytest.mark.skipif(None in (norm_act(), decoder_layers(), gguf_matmul(), paged_decode()),
                                reason="no C++ compiler here")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_gives_the_bits_of_apply_rotary_and_the_cache_write(dtype):
    """float32 included: there torch's addcmul fuses its multiply-add (a quarter of the values differ without)."""
    t, heads, kvh, d, bs = 37, 6, 2, 64, 16
    gen = torch.Generator().manual_seed(0)
    qkv = (torch.randn(t, (heads + 2 * kvh) * d + 8, generator=gen) * 3).to(dtype)[:, 8:]   # a row stride of its own
    angles = torch.rand(t, 1, d // 2, generator=gen) * 100
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    slots = torch.randperm(5 * bs, generator=gen)[:t]
    spec = KVCacheSpec(num_layers=1, num_kv_heads=kvh, head_dim=d, block_size=bs, dtype=dtype)
    ours, torchs = PagedKVCache(spec, 5), PagedKVCache(spec, 5)
    q = torch.empty(t, kvh, heads // kvh, d)
    norm_act().rope_store(qkv, cos, sin, slots, ours.layer(0), q)
    qk = apply_rotary(qkv[:, :(heads + kvh) * d].reshape(t, heads + kvh, d), cos, sin)
    torchs.write(0, slots, qk[:, heads:], qkv[:, (heads + kvh) * d:].reshape(t, kvh, d))
    assert torch.equal(q.view(t, heads, d), qk[:, :heads].float())
    assert torch.equal(ours.data, torchs.data) and ours.data.abs().sum() > 0


FILES = {"quantized": {**dict.fromkeys(GGUF_MATRICES, "Q4_0"), "attn_output": "Q4_1", "ffn_down": "Q8_0",
                       "token_embd": "Q8_0"},
         "bf16": ALL_BF16}


@pytest.fixture(params=list(FILES))
def own_bits(tmp_path, request):
    """A tiny model as a GGUF whose every matrix is served at its bits (Q4_0, Q4_1 and Q8_0; or all BF16), in bf16."""
    path = tiny_gguf(tmp_path, TINY, FILES[request.param], seed=5)
    return load_model(ModelConfig(model=str(path), quantization="gguf", dtype="bfloat16"))


def run_steps(model, fused) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Every kind of step the engine runs, with `fused` (or the Python loop, None): a whole prompt, decodes, a
    chunk after cached context beside decodes, several rows of one sequence (a speculative verification). Returns
    the logits, the cache and how many steps the fused call took."""
    model.fused, calls = fused, [0]
    if fused is not None:
        def counted(*args, _call=type(fused).__call__):
            calls[0] += 1
            return _call(fused, *args)
        model.fused = counted
    kv = PagedKVCache(KVCacheSpec.for_model(model.arch, 16, model.dtype), 12)
    a = Seq(list(range(3, 50)), blocks=[7, 2, 9, 4])
    b = Seq(list(range(60, 100)), blocks=[1, 11, 5])
    c = Seq(list(range(20, 60)), blocks=[0, 3, 8, 6, 10])
    run_step(model, kv, [(a, 40)])                              # a prompt
    run_step(model, kv, [(b, 17)])
    for _ in range(3):
        run_step(model, kv, [(a, 1), (b, 1)])                   # decodes
    run_step(model, kv, [(c, 20)])
    run_step(model, kv, [(a, 1), (b, 5), (c, 12)])              # a decode beside chunks after cached context
    run_step(model, kv, [(c, 4)])                               # rows of one sequence, as a verification
    model.fused = fused
    return [torch.stack(s.logits) for s in (a, b, c)], kv.data, calls[0]


def test_the_fused_layers_give_the_python_loops_bits_for_every_kind_of_step(own_bits):
    model = own_bits.model
    fused = model.fused
    assert fused is not None, "every projection is at its bits: the layers should run in one call"
    ours, ours_kv, calls = run_steps(model, fused)
    plain, plain_kv, none = run_steps(model, None)
    assert calls == 8 and none == 0
    assert all(torch.equal(x, y) for x, y in zip(ours, plain)) and torch.equal(ours_kv, plain_kv)
    assert ours_kv.abs().sum() > 0


def test_the_fused_call_splits_its_time(own_bits):
    import ctypes
    model = own_bits.model
    model.fused.seconds = (ctypes.c_double * 3)()
    try:
        run_steps(model, model.fused)
        parts = list(model.fused.seconds)
    finally:
        model.fused.seconds = None
    assert all(part > 0 for part in parts), parts           # projections, attention, the rest


def test_a_widened_projection_or_a_float32_model_keeps_the_python_loop(tmp_path):
    bits = {kind: "Q4_0" for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
    path = tiny_gguf(tmp_path / "widened", TINY, {**bits, "ffn_down": "F16"}, seed=5)
    assert load_model(ModelConfig(model=str(path), quantization="gguf", dtype="bfloat16")).model.fused is None
    path = tiny_gguf(tmp_path / "own", TINY, {**bits, "ffn_down": "Q4_0"}, seed=5)
    assert load_model(ModelConfig(model=str(path), quantization="gguf", dtype="float32")).model.fused is None
    loaded = load_model(ModelConfig(model=str(path), quantization="gguf", dtype="bfloat16"))
    assert loaded.model.fused is not None
    seq = Seq(list(range(3, 30)), blocks=[1, 0])
    run_step(loaded.model, new_cache(loaded, 2), [(seq, 27)])
    assert torch.isfinite(seq.logits[-1]).all()
