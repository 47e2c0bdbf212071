"""A step's decoder layers in one C++ call (kernels/csrc/decoder_layers.cpp), for a bf16 model whose every
projection our GGUF kernel runs (the embedded default model and any file whose matrices are all in the GGUF
kernel's types, served at its bits).

Why: at one row a decode step is ~97 MB of weights read in ~3.6 ms (SmolLM2 at Q4_1, Zen 4), and the Python
loop around those reads dispatched ~12 calls a layer, each a few microseconds of interpreter, ctypes and
argument checks: ~1.3 ms a step outside the weights and attention. The C++ loop calls the very entry points
the Python loop calls (norm, projections, RoPE with the K/V write, the paged kernels), so logits and KV are
the same bits (tests/model/test_fused_layers.py); only the residual adds and attention's bf16 output are its
own, rounded as torch rounds. It takes a step only when the paged kernel attends every row
(`AttentionPlan.kernel_only`) and no adapter is in it (kvstrata.model.network.steps); the structs it fills are
the kernel header's (kvstrata.model.kernels.layers).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvstrata.kvcache.buffers import PagedKVCache
from kvstrata.model.arch import tensors as names
from kvstrata.model.kernels import DecoderLayers, NormAct, PagedDecode
from kvstrata.model.kernels.layers import KvsLayer, KvsStep
from kvstrata.model.network.attention import AttentionPlan


@dataclass
class FusedLayers:
    """The layers of a model, ready to run a step: `__call__(h, ...)` replaces the residual stream h with the last
    layer's output. `seconds`, when set, gets each call's time added by part (projections, attention, the rest:
    benchmarks/model_step.py --breakdown)."""

    model: object                                # the DecoderModel (its layers hold what the pointers read)
    call: DecoderLayers
    layers: list[KvsLayer]                       # without their caches' addresses (set per cache)
    seconds: ctypes.Array | None = None
    _bound: tuple[tuple, ctypes.Array] | None = None    # (the cache's address and shape, the layers with theirs)

    def _layers_for(self, kv: PagedKVCache) -> ctypes.Array:
        """The layers with `kv`'s addresses: kept for the last cache seen (read once into a local, so two engines
        stepping one model on two threads never get each other's). Keyed by the address and the shape: a cache
        freed and another of a different size allocated at the same address has its layers elsewhere."""
        key, bound = (kv.data.data_ptr(), tuple(kv.data.shape)), self._bound
        if bound is None or bound[0] != key:
            array = (KvsLayer * len(self.layers))(*self.layers)
            for index in range(len(self.layers)):
                array[index].kv = kv.layer(index).data_ptr()
            bound = self._bound = (key, array)
        return bound[1]

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
        step = KvsStep(t, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size, kv.num_blocks,
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
        self.call(self._layers_for(kv), step, h.data_ptr())


def fused_layers(model, call: DecoderLayers | None, norm_act: NormAct | None, paged: PagedDecode | None
                 ) -> FusedLayers | None:
    """The model's layers for `FusedLayers`, or None unless it is bf16 on the CPU with our kernels (norms and
    activations, the paged kernel, the decoder-layers library) and every projection has a kernel view (a GGUF
    kernel's blocks without bias)."""
    a = model.arch
    if call is None or norm_act is None or paged is None or model.dtype != torch.bfloat16:
        return None
    if model.device.type != "cpu" or a.head_dim > norm_act.rope_max_head_dim or (a.num_heads * a.head_dim) % 16:
        return None
    if not paged.supports(torch.bfloat16, a.num_heads // a.num_kv_heads, a.head_dim, 16, model.device):
        return None
    views = [{name: layer.projections[name].kernel_view() for name in names.PROJECTIONS} for layer in model.layers]
    if any(view is None for layer in views for view in layer.values()):
        return None
    layers = [KvsLayer(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(),
                       *(view[name] for name in names.PROJECTIONS)) for layer, view in zip(model.layers, views)]
    return FusedLayers(model, call, layers)
