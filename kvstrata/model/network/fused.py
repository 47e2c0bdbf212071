"""A step's decoder layers in one C++ call (csrc/decoder_layers.cpp), for a bf16 model whose every projection
our GGUF kernel runs (the embedded default model and any Q4_0 / Q4_1 / Q8_0 / Q6_K / BF16 file, served at its bits).

Why: at one row a decode step is ~97 MB of weights read in ~3.6 ms (SmolLM2 at Q4_1, Zen 4), and the Python
loop around those reads dispatched ~12 calls a layer, each a few microseconds of interpreter, ctypes and
argument checks: ~1.3 ms a step outside the weights and attention. The C++ loop calls the very entry points
the Python loop calls (norm, projections, RoPE with the K/V write, the paged kernels), so logits and KV are
the same bits (tests/model/test_fused_layers.py); only the residual adds and attention's bf16 output are its
own, rounded as torch rounds. It takes a step only when the paged kernel attends every row
(`AttentionPlan.kernel_only`) and no adapter is in it; otherwise the Python loop runs, as before.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvstrata.kvcache.buffers import PagedKVCache
from kvstrata.model.attention import AttentionPlan
from kvstrata.model.gguf_bits import GGUFLinear
from kvstrata.model.kernels import GGUFMatmul, decoder_layers, function_address

i64, ptr = ctypes.c_int64, ctypes.c_void_p


class _Kernels(ctypes.Structure):
    _fields_ = [(name, ptr) for name in ("rms_norm", "silu_mul", "rope_store", "gguf_matmul", "paged_decode",
                                         "paged_rows")]


class _Projection(ctypes.Structure):
    _fields_ = [("packed", ptr), ("kind", i64), ("level", i64), ("out", i64), ("in_", i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ptr), ("post_norm", ptr), ("qkv", _Projection), ("o", _Projection),
                ("gate_up", _Projection), ("down", _Projection), ("kv", ptr)]


class _Step(ctypes.Structure):
    _fields_ = [(name, i64) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                         "num_blocks", "block_size")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos", ptr), ("sin", ptr), ("slots", ptr),
        ("decodes", i64), ("decode_tables", ptr), ("decode_table_stride", i64), ("first", ptr), ("decode_lens", ptr),
        ("rows_start", i64), ("segments", i64), ("row_tables", ptr), ("row_table_stride", i64), ("starts", ptr),
        ("row_lens", ptr), ("seconds", ptr)]


PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass
class FusedLayers:
    """The layers of a model `fused_layers` took, ready to run a step: `__call__(h, ...)` replaces the residual
    stream h with the last layer's output. `seconds`, when set, gets each call's time added by part
    (projections, attention, the rest: benchmarks/model_step.py --breakdown)."""

    model: torch.nn.Module                       # the LlamaModel (its layers hold the weights the pointers read)
    kernels: _Kernels
    layers: list[_Layer]                         # without their caches' addresses (set per cache)
    seconds: ctypes.Array | None = None
    _bound: tuple[int, ctypes.Array] | None = None     # (the cache's address, the layers with theirs)

    def _layers_for(self, kv: PagedKVCache) -> ctypes.Array:
        address = kv.data.data_ptr()
        if self._bound is None or self._bound[0] != address:
            array = (_Layer * len(self.layers))(*self.layers)
            for index in range(len(self.layers)):
                array[index].kv = kv.layer(index).data_ptr()
            self._bound = (address, array)
        return self._bound[1]

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
                 kv: PagedKVCache) -> None:
        """h (T, E) bf16 contiguous, updated in place; cos and sin (T, 1, D) (`RotaryTables.lookup`); `plan`
        `kernel_only`, over `kv` (bf16, the model's)."""
        a = self.model.arch
        t = h.shape[0]
        assert plan.kernel_only and h.dtype == kv.spec.dtype == torch.bfloat16 and h.is_contiguous()
        assert cos.shape == sin.shape == (t, 1, a.head_dim) and cos.is_contiguous() and sin.is_contiguous()
        assert plan.slot_mapping.dtype == torch.int64 and plan.slot_mapping.is_contiguous()
        assert kv.data.is_contiguous() and kv.layer(0).shape[1:] == (a.num_kv_heads, kv.num_blocks, kv.block_size,
                                                                     a.head_dim)
        step = _Step(t, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size, kv.num_blocks,
                     kv.block_size, a.rms_norm_eps, a.head_dim ** -0.5, cos.data_ptr(), sin.data_ptr(),
                     plan.slot_mapping.data_ptr())
        if plan.in_place is not None:
            c = plan.in_place
            assert c.start == 0 and c.tables.stride(1) == 1 and c.first.is_contiguous() and c.lens.is_contiguous()
            assert c.tables.dtype == c.first.dtype == c.lens.dtype == torch.int64
            step.decodes, step.decode_tables, step.decode_table_stride = c.end, c.tables.data_ptr(), c.tables.stride(0)
            step.first, step.decode_lens = c.first.data_ptr(), c.lens.data_ptr()
        if plan.rows is not None:
            r = plan.rows
            assert r.end == t and r.tables.stride(1) == 1 and r.starts.is_contiguous() and r.lens.is_contiguous()
            assert r.tables.dtype == r.starts.dtype == r.lens.dtype == torch.int64
            step.rows_start, step.segments = r.start, r.lens.shape[0]
            step.row_tables, step.row_table_stride = r.tables.data_ptr(), r.tables.stride(0)
            step.starts, step.row_lens = r.starts.data_ptr(), r.lens.data_ptr()
        if self.seconds is not None:
            step.seconds = ctypes.addressof(self.seconds)
        decoder_layers()(ctypes.byref(self.kernels), self._layers_for(kv), len(self.layers), ctypes.byref(step),
                         h.data_ptr())


def fused_layers(model: torch.nn.Module) -> FusedLayers | None:
    """The model's layers for `FusedLayers`, or None unless it is bf16 on the CPU with our kernels (norms and
    activations fused, the paged kernel, the decoder-layers library) and every projection a `GGUFLinear`
    without bias."""
    arch = model.arch
    if model.dtype != torch.bfloat16 or model.device.type != "cpu" or model.norm_act is None:
        return None
    if model.attn.kernel is None or decoder_layers() is None or arch.head_dim > model.norm_act.rope_max_head_dim:
        return None
    if not model.attn.kernel.supports(torch.bfloat16, model.attn.group, arch.head_dim, 16, model.device):
        return None
    if (arch.num_heads * arch.head_dim) % 16:
        return None
    projections = [layer.projections.get(name) for layer in model.layers for name in PROJECTIONS]
    if not all(isinstance(p, GGUFLinear) and p.bias is None for p in projections):
        return None
    kernels = _Kernels(*(function_address(name) for name in ("rms_norm", "silu_mul", "rope_store", "gguf_matmul",
                                                              "paged_decode", "paged_rows")))

    def projection(p: GGUFLinear) -> _Projection:
        return _Projection(p.packed.data_ptr(), GGUFMatmul.KINDS[p.kind], p.level, p.n_out, p.n_in)

    layers = [_Layer(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(),
                     *(projection(layer.projections[name]) for name in PROJECTIONS)) for layer in model.layers]
    return FusedLayers(model, kernels, layers)
