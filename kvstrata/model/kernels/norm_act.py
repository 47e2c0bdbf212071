"""RMSNorm, SiLU-and-multiply and RoPE with the K/V write (csrc/norm_act.cpp): bf16 rows on the CPU, one call
each where torch dispatches ten ops, four and about twenty; a decode step calls them ~120 times. Raw pointers:
each method checks what the kernel relies on."""

from __future__ import annotations

import torch

from kvstrata.model.kernels.abi import Library


class NormAct:
    def __init__(self, lib: Library) -> None:
        self.lib = lib
        self.rope_max_head_dim = lib.kvs_rope_max_head_dim()

    @staticmethod
    def takes(dtype: torch.dtype, device: torch.device, *widths: int) -> bool:
        """Whether a model of this dtype on this device, with rows of these widths, can use the kernels."""
        return dtype == torch.bfloat16 and device.type == "cpu" and all(w % 16 == 0 for w in widths)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x (T, E) -> LlamaRMSNorm(x) (T, E), float32 statistics; x bf16 (rows of unit stride, any row stride:
        a head of a fused projection) and weight (E,) bf16 or float32 (Gemma's 1 + w: scaled in float32, rounded
        once), contiguous; E a multiple of 16."""
        assert x.dtype == torch.bfloat16 and weight.dtype in (torch.bfloat16, torch.float32)
        assert x.stride(1) == 1 and weight.is_contiguous() and x.shape[1:] == weight.shape and x.shape[1] % 16 == 0
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        call = self.lib.kvs_rms_norm if weight.dtype == torch.bfloat16 else self.lib.kvs_rms_norm_wide
        call(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                   kv_layer: torch.Tensor, q: torch.Tensor) -> None:
        """A layer's attention inputs in one call, the bits of `apply_rotary` and `PagedKVCache.write`: qkv (T,
        (H + 2 KVH) D) with unit column stride, cos and sin (T, 1, D) (`RotaryTables.lookup`) in its dtype;
        RoPE'd queries into q (T, KVH, G, D) float32 (the paged kernel's, widened from the model dtype), RoPE'd
        keys and the values into kv_layer (2, KVH, N, bs, D) at the flat slots (T,)."""
        t, kvh, g, d = q.shape
        heads = kvh * g
        two, kvh_, n, bs, d_kv = kv_layer.shape
        assert (two, kvh_, d_kv) == (2, kvh, d) and d % 2 == 0 and d <= self.rope_max_head_dim
        assert qkv.dtype == cos.dtype == sin.dtype == kv_layer.dtype and qkv.dtype in (torch.float32, torch.bfloat16)
        assert qkv.shape == (t, (heads + 2 * kvh) * d) and qkv.stride(1) == 1 and kv_layer.is_contiguous()
        assert cos.shape == sin.shape == (t, 1, d) and cos.is_contiguous() and sin.is_contiguous()
        assert q.dtype == torch.float32 and q.is_contiguous() and slots.dtype == torch.int64 and slots.shape == (t,)
        assert slots.is_contiguous() and cos.device.type == "cpu"
        self.lib.kvs_rope_store(qkv.data_ptr(), qkv.stride(0), int(qkv.dtype == torch.bfloat16), cos.data_ptr(),
                                sin.data_ptr(), slots.data_ptr(), t, heads, kvh, d, kv_layer.data_ptr(), n * bs,
                                q.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up (T, 2 I) bf16, contiguous -> SiLU(gate) * up (T, I) bf16."""
        assert gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous() and gate_up.dim() == 2
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self.lib.kvs_silu_mul(gate_up.data_ptr(), out.data_ptr(), *out.shape)
        return out
