"""One decoder layer's Python steps around attention: RMSNorm, the projections (with the step's adapters'
updates), RoPE, the residuals and the gated MLP. The math follows transformers' `LlamaDecoderLayer`, so logits
match it in float32, and what a description adds (kvstrata.model.arch.ModelArch) follows its family's: Qwen 3's and
Gemma 3's norms over each head of q and k, Gemma's norms on attention's and the MLP's outputs and its GELU(tanh).
kvstrata.model.network.steps walks the layers, and `--compile` compiles these two steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstrata.model.adapters.lora import LoRABatch
from kvstrata.model.arch import ModelArch
from kvstrata.model.formats.base import Projection
from kvstrata.model.kernels import NormAct
from kvstrata.model.network.rope import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, stat_dtype: torch.dtype = torch.float32,
             fused: NormAct | None = None) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalize in float32, scale in the model dtype. In float32 that is
    `F.rms_norm` (one op to dispatch, half the time of five at one row); in bfloat16 our kernel when
    `fused` (one call, a row's sum in a fixed order), else ten plain ops, since `F.rms_norm` would
    scale in float32. `stat_dtype=float64` sums the mean square in float64: torch splits one row's sum
    across threads but not a batch's rows, so in float32 a row's bits depend on the batch, which bf16
    rounding can turn into another greedy token."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    if fused is not None and weight.dtype in (x.dtype, torch.float32) and x.shape[-1] % 16 == 0:
        return fused.rms_norm(x, weight, eps)
    xs = x.to(stat_dtype)
    normed = (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True).add_(eps))).float()
    if weight.dtype == torch.float32:      # Gemma's 1 + w (kvstrata.model.builder): scaled in float32, rounded once
        return (normed * weight).to(x.dtype)
    return weight * normed.to(x.dtype)


class DecoderLayer:
    """One layer: its norms and projections, and the Python steps around attention."""

    def __init__(self, arch: ModelArch, index: int, input_norm: torch.Tensor, post_norm: torch.Tensor,
                 projections: dict[str, Projection], norm_act: NormAct | None, stat_dtype: torch.dtype,
                 others: dict[str, torch.Tensor] | None = None) -> None:
        others = others or {}
        self.arch = arch
        self.index = index                         # its place in the stack (which adapter weights it takes)
        self.window = arch.window(index)           # its sliding window, None for a global layer
        self.input_norm = input_norm
        self.post_norm = post_norm
        self.q_norm, self.k_norm = others.get("q_norm"), others.get("k_norm")          # over each head
        self.attn_out_norm, self.mlp_out_norm = others.get("attn_out_norm"), others.get("mlp_out_norm")
        assert (self.q_norm is not None) == arch.qk_norm and (self.attn_out_norm is not None) == arch.sandwich_norms
        self.projections = projections
        self.norm_act = norm_act
        self.norm_stat_dtype = stat_dtype

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.arch.rms_norm_eps, self.norm_stat_dtype, self.norm_act)

    def head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (T, heads, D): each head's vector normed (q_norm, k_norm)."""
        t, heads, d = x.shape
        return self.norm(x.reshape(t * heads, d), weight).view(t, heads, d)

    def project(self, name: str, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """One projection, plus the step's adapters' low-rank updates on their rows (kvstrata.model.adapters)."""
        y = self.projections[name](x)
        return y if lora is None else lora.apply(self.index, name, x, y)

    def qkv_rows(self, h: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """h (T, E) -> RMSNorm, fused QKV (T, (H + 2 KVH) D), before RoPE."""
        return self.project("qkv", self.norm(h, self.input_norm), lora)

    def attention_inputs(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lora: LoRABatch | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h (T, E) -> q (T, H, D), k and v (T, KVH, D): RMSNorm, fused QKV, (q and k normed per head,) RoPE on q
        and k."""
        a = self.arch
        t = h.shape[0]
        nh, nkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        qkv = self.qkv_rows(h, lora)                                              # (T, (H + 2 KVH) D)
        v = qkv[:, (nh + nkv) * d:].view(t, nkv, d)
        if self.q_norm is not None:
            q = self.head_norm(qkv[:, :nh * d].view(t, nh, d), self.q_norm)
            k = self.head_norm(qkv[:, nh * d:(nh + nkv) * d].view(t, nkv, d), self.k_norm)
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v
        qk = apply_rotary(qkv[:, :(nh + nkv) * d].view(t, nh + nkv, d), cos, sin)  # (T, H + KVH, D)
        return qk[:, :nh], qk[:, nh:], v

    def after_attention(self, h: torch.Tensor, o: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """The residual stream h (T, E) and attention's output o (T, H D) -> the layer's output (T, E):
        O projection, (RMSNorm,) residual, RMSNorm, fused gate|up, act(gate) * up, down, (RMSNorm,) residual."""
        o = self.project("o", o, lora)
        h = h + (o if self.attn_out_norm is None else self.norm(o, self.attn_out_norm))
        gu = self.project("gate_up", self.norm(h, self.post_norm), lora)          # (T, 2 I)
        i = self.arch.intermediate_size
        if self.arch.activation == "gelu_tanh":
            gated = F.gelu(gu[:, :i], approximate="tanh") * gu[:, i:]
        elif self.norm_act is not None:
            gated = self.norm_act.silu_mul(gu)
        else:
            gated = F.silu(gu[:, :i]) * gu[:, i:]
        m = self.project("down", gated, lora)
        return h + (m if self.mlp_out_norm is None else self.norm(m, self.mlp_out_norm))
