"""A step's decoder layers in one C++ call (kvstrata.model.network.fused) and RoPE with the K/V write in one
(`NormAct.rope_store`): the same bits as torch's ops and the Python loop, for every kind of step the engine
runs, taken only where they can be."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from kvstrata.core.config import ModelConfig
from kvstrata.kvcache.buffers import KVCacheSpec, PagedKVCache
from kvstrata.model.kernels import NormAct, face
from kvstrata.model.loader import load_model
from kvstrata.model.network.decoder import DecoderModel
from kvstrata.model.network.fused import FusedLayers
from kvstrata.model.network.rope import apply_rotary
from kvstrata.model.network.steps import FusedLoop, KernelLoop, TorchLoop
from tests.model.model_helpers import ALL_BF16, GGUF_MATRICES, Seq, kernels_on, new_cache, run_step, tiny_gguf
from tests.model.model_helpers import TINY_LLAMA as TINY

pytestmark = kernels_on


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
    face(NormAct).rope_store(qkv, cos, sin, slots, ours.layer(0), q)
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


def run_steps(model, monkeypatch) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Every kind of step the engine runs: a whole prompt, decodes, a chunk after cached context beside decodes,
    several rows of one sequence (a speculative verification). Returns the logits, the cache and how many steps
    the fused call took."""
    calls = [0]

    def counted(*args, _call=FusedLayers.__call__):
        calls[0] += 1
        return _call(*args)
    monkeypatch.setattr(FusedLayers, "__call__", counted)
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
    monkeypatch.undo()
    return [torch.stack(s.logits) for s in (a, b, c)], kv.data, calls[0]


def test_the_fused_layers_give_the_python_loops_bits_for_every_kind_of_step(own_bits, monkeypatch):
    model = own_bits.model
    assert isinstance(model.loop, FusedLoop), "every projection is at its bits: the layers should run in one call"
    python = DecoderModel(model.parts, dataclasses.replace(model.kernels, layers=None))    # the same weights
    assert isinstance(python.loop, KernelLoop)
    ours, ours_kv, calls = run_steps(model, monkeypatch)
    plain, plain_kv, none = run_steps(python, monkeypatch)
    assert calls == 8 and none == 0
    assert all(torch.equal(x, y) for x, y in zip(ours, plain)) and torch.equal(ours_kv, plain_kv)
    assert ours_kv.abs().sum() > 0


def test_the_fused_call_splits_its_time(own_bits, monkeypatch):
    fused = own_bits.model.loop.fused
    fused.seconds = (ctypes.c_double * 3)()
    run_steps(own_bits.model, monkeypatch)
    assert all(part > 0 for part in fused.seconds), list(fused.seconds)      # projections, attention, the rest


def test_a_cache_at_the_address_of_a_freed_one_gets_its_own_layer_addresses(own_bits):
    """An engine closed and another opened with a smaller cache: the allocator may hand out the same address, but
    the layers lie at other offsets. The fused call reaching the old ones wrote past the new cache (a heap
    corruption, seen as aborts in the engine tests)."""
    fused = own_bits.model.loop.fused
    big = new_cache(own_bits, 8)
    small = new_cache(own_bits, 2)
    small.data = big.data.flatten()[:small.data.numel()].view(small.data.shape)      # the same address, smaller
    assert small.data.data_ptr() == big.data.data_ptr() and small.layer(1).data_ptr() != big.layer(1).data_ptr()
    for kv in (big, small, big):
        layers = fused._layers_for(kv)
        assert [layers[i].kv for i in range(len(layers))] == [kv.layer(i).data_ptr() for i in range(len(layers))]


def test_a_widened_projection_or_a_float32_model_keeps_the_python_loop(tmp_path):
    bits = {kind: "Q4_0" for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
    path = tiny_gguf(tmp_path / "widened", TINY, {**bits, "ffn_down": "F16"}, seed=5)
    assert isinstance(load_model(ModelConfig(model=str(path), quantization="gguf", dtype="bfloat16")).model.loop,
                      KernelLoop)
    path = tiny_gguf(tmp_path / "own", TINY, {**bits, "ffn_down": "Q4_0"}, seed=5)
    assert isinstance(load_model(ModelConfig(model=str(path), quantization="gguf", dtype="float32")).model.loop,
                      TorchLoop)
    loaded = load_model(ModelConfig(model=str(path), quantization="gguf", dtype="bfloat16"))
    assert isinstance(loaded.model.loop, FusedLoop)
    seq = Seq(list(range(3, 30)), blocks=[1, 0])
    run_step(loaded.model, new_cache(loaded, 2), [(seq, 27)])
    assert torch.isfinite(seq.logits[-1]).all()
