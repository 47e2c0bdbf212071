"""Int8 linear layers on CPU through FBGEMM's dynamic-quantization kernels (`--quantization int8`).

Weights are stored in int8 with one scale per output row (symmetric, zero point 0); at run time
`torch.ops.quantized.linear_dynamic` quantizes the activations of each call to uint8 (one scale
for the call, from its min and max), multiplies in int8 with int32 accumulation and returns float32.
It is one torch op per projection, bias included, like the fp32 path.

Why FBGEMM: measured on the 2-core AVX2 EPYC, 2 threads, all of SmolLM2's projections (30 layers
plus the 49152-row head, 538 MB in fp32, 134 MB in int8), ms per call of the whole set, best of 9:

    rows   fp32 (linear.py)  FBGEMM  oneDNN qlinear  per-token quant + torch._int_mm   _weight_int8pack_mm
      1         12.2           4.8        6.6              3.9 (without the head)           32.3 (no head)
      8         30.0           6.0        9.7              9.4 (without the head)          268
     32         61.8          13.0       14.5             16.8 (without the head)         1080
     64        100.6          20.1       20.6                 -                               -

oneDNN is reached through the same ops with `torch.backends.quantized.engine = "onednn"`; torchao's
int8 dynamic-activation path runs per-token quantization (five elementwise ops) and `torch._int_mm`
in eager mode, and its weight-only int8 path is `_weight_int8pack_mm`. FBGEMM is fastest from 2
rows up, ties at 1 row, and costs one op per projection instead of six.

`reduce_range=True`: FBGEMM's AVX2 kernel adds pairs of uint8 x int8 products in int16
(`vpmaddubsw`), which saturates unless activations use 7 bits. Keeping the 8th bit was 5% faster
and not measurably less accurate on SmolLM2, but saturation depends on the data, so we keep the
safe setting.

Quantizing the model at load takes ~0.55 s for SmolLM2 (0.19 s to round, 0.37 s to pack), so the
int8 weights are not cached on disk: the packed form is FBGEMM's own and is rebuilt each start.
Creating the per-channel quantized weight goes through torch's quantized-tensor API, which warns
that it is deprecated; the warning is silenced here, where it is raised, and only here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

REDUCE_RANGE = True
ENGINE = "fbgemm"


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) float -> (int8 (out, in), float32 scales (out,)): w ~= q * scale[:, None]."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)           # (out,) an all-zero row keeps scale > 0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


@dataclass(frozen=True)
class Int8Linear:
    """y = x @ w.T + bias with w in int8 (per-row scales), packed for FBGEMM. x float32 (M, in)."""

    packed: torch.ScriptObject
    in_features: int
    out_features: int

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        assert w.dim() == 2 and w.device.type == "cpu", "int8 linear layers run on CPU"
        if ENGINE not in torch.backends.quantized.supported_engines:
            raise ValueError(f"this torch build has no {ENGINE} kernels, which --quantization int8 needs")
        q, scale = quantize_rows(w)
        zero_points = torch.zeros_like(scale, dtype=torch.long)
        bias = None if bias is None else bias.float().contiguous()
        previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = ENGINE           # the packed weight keeps its engine's kernels
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
                qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero_points, 0)
            packed = torch.ops.quantized.linear_prepack(qw, bias)
        finally:
            torch.backends.quantized.engine = previous
        return cls(packed, w.shape[1], w.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, in) float32 -> (M, out) float32."""
        return torch.ops.quantized.linear_dynamic(x, self.packed, REDUCE_RANGE)

    @property
    def nbytes(self) -> int:
        """Bytes read per call: the int8 weights and one float32 scale per row."""
        return self.out_features * (self.in_features + 4)
