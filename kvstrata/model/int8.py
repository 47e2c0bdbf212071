"""`Int8Linear`: y = x @ w.T with int8 weights (one scale per output row) and int8 activations
(one scale per token, computed at run time), multiplied by `torch._int_mm` (int32 accumulation).

Why this kernel. Measured on the project's CPU (2 threads; all of SmolLM2's projections, 30 layers,
538 MB in fp32, 134 MB in int8), ms per pass over the set, best of 9:

    rows  fp32 (linear.py)  FBGEMM linear_dynamic  oneDNN (same op)  per-token + _int_mm  _weight_int8pack_mm
      1        12.2               4.8 *                 6.6                 3.9 **              32.3 **
      8        30.0               6.0 *                 9.7                 9.4 **             268 **
     32        61.8              13.0 *                14.5                16.8 **            1080 **
    (* with the 49152-row head, ** without it: about 1 ms more at 1 row)

FBGEMM's `linear_dynamic` (torch.ao's dynamic quantization) is the fastest and one op per call,
but it quantizes the activations with ONE scale per call: SmolLM2's activations carry outliers
(most of all the input of the down projection), and perplexity on bench/data/gpl-3.0.txt (first
2,048 tokens, 1,024-token windows) went 21.26 -> 61.4. With one scale per token and these same
int8 weights it is 22.31, and 21.60 (+1.6%) once `kvstrata.model.quantize` has moved the
activations' outliers into the weights (SmoothQuant). Weight-only int8 would be 21.38, but the one
weight-only kernel torch has on CPU, `_weight_int8pack_mm` (what torchao's int8 weight-only uses
there), is 3-30x slower than fp32 here. torchao's int8 dynamic-activation path is this one
(per-token scales and `_int_mm`) in eager mode; we write its few lines rather than add the package.

Symmetric int8 on both sides (zero points 0), so the int32 product needs only the two scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) float -> (int8 (out, in), float32 scales (out,)): w ~= q * scale[:, None]."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)           # (out,) an all-zero row keeps scale > 0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


@dataclass(frozen=True)
class Int8Linear:
    """A projection with int8 weights; called as `proj(x)` with x float32 (M, in) like `DenseLinear`."""

    weight_t: torch.Tensor          # (in, out) int8, a transposed view of the (out, in) rows
    scale: torch.Tensor             # (out,) float32
    bias: torch.Tensor | None       # (out,) float32

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        assert w.dim() == 2 and w.device.type == "cpu", "int8 linear layers run on CPU"
        q, scale = quantize_rows(w)
        return cls(q.t(), scale, None if bias is None else bias.float().contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, in) float32 -> (M, out) float32."""
        x_scale = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_min_(1e-8).div_(127.0)
        xq = torch.round(x / x_scale).to(torch.int8)                                   # (M, in)
        y = torch._int_mm(xq, self.weight_t).mul(x_scale).mul_(self.scale)            # (M, out) float32
        return y if self.bias is None else y.add_(self.bias)

    @property
    def nbytes(self) -> int:
        """Bytes read per call: the int8 weights and one float32 scale per row."""
        return self.weight_t.numel() + self.scale.numel() * 4
