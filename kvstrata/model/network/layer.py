"""One decoder layer's Python steps around attention: RMSNorm, the projections (with the step's adapters'
updates), RoPE, the residuals and the SiLU-gated MLP. The math follows transformers' `LlamaDecoderLayer`, so logits
match it in float32; kvstrata.model.network.steps walks the layers, and `--compile` compiles these two steps."""

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
    if fused is not None:
        return fused.rms_norm(x, weight, eps)
    xs = x.to(stat_dtype)
    normed = (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True).add_(eps))).float()
    return weight * normed.to(x.dtype)


class DecoderLayer:
    """One layer: its norms and projections, and the Python steps around attention."""

    def __init__(self, arch: ModelArch, index: int, input_norm: torch.Tensor, post_norm: torch.Tensor,
                 projections: dict[str, Projection], norm_act: NormAct | None, stat_dtype: torch.dtype) -> None:
        self.arch = arch
        self.index = index                         # its place in the stack (which adapter weights it takes)
        self.input_norm = input_norm
        self.post_norm = post_norm
        self.projections = projections
        self.norm_act = norm_act
        self.norm_stat_dtype = stat_dtype

    def project(self, name: str, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """One projection, plus the step's adapters' low-rank updates on their rows (kvstrata.model.adapters)."""
        y = self.projections[name](x)
        return y if lora is None else lora.apply(self.index, name, x, y)

    def qkv_rows(self, h: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """h (T, E) -> RMSNorm, fused QKV (T, (H + 2 KVH) D), before RoPE."""
        x = rms_norm(h, self.input_norm, self.arch.rms_norm_eps, self.norm_stat_dtype, self.norm_act)    # (T, E)
        return self.project("qkv", x, lora)

    def attention_inputs(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lora: LoRABatch | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h (T, E) -> q (T, H, D), k and v (T, KVH, D): RMSNorm, fused QKV, RoPE on q and k."""
        a = self.arch
        t = h.shape[0]
        nh, nkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        qkv = self.qkv_rows(h, lora)                                              # (T, (H + 2 KVH) D)
        qk = apply_rotary(qkv[:, :(nh + nkv) * d].view(t, nh + nkv, d), cos, sin)  # (T, H + KVH, D)
        return qk[:, :nh], qk[:, nh:], qkv[:, (nh + nkv) * d:].view(t, nkv, d)

    def after_attention(self, h: torch.Tensor, o: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """The residual stream h (T, E) and attention's output o (T, H D) -> the layer's output (T, E):
        O projection, residual, RMSNorm, fused gate|up, SiLU(gate) * up, down, residual."""
        h = h + self.project("o", o, lora)
        x = rms_norm(h, self.post_norm, self.arch.rms_norm_eps, self.norm_stat_dtype, self.norm_act)
        gu = self.project("gate_up", x, lora)                                     # (T, 2 I)
        if self.norm_act is not None:
            return h + self.project("down", self.norm_act.silu_mul(gu), lora)
        i = self.arch.intermediate_size
        return h + self.project("down", F.silu(gu[:, :i]) * gu[:, i:], lora)
