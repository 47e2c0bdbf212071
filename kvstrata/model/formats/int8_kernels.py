"""The `int8` format's projections: y = x @ w.T with int8 weights (one scale per output row) and int8 activations
(one scale per token, computed at run time), through whichever library kernel is fastest on this
CPU (`kvstrata.model.formats.int8_choice` measures them at first load).

The kernels, all with the same int8 rows:
- `int_mm`: per-token symmetric int8 and `torch._int_mm` (oneDNN's s8 x s8 GEMM). Fast where the
  CPU has VNNI; on an AVX2-only CPU it is slower than fp32 (batch 32: 0.06x on a Zen 3 EPYC) and
  its int16 pair sums saturate.
- `fbgemm` / `onednn`: the library's dynamic quantized linear (`quantized::linear_dynamic`), which
  quantizes its input with ONE scale per call. Fed as is, a row's rounding would depend on the other
  rows of its batch (and SmolLM2's outliers would wreck its perplexity). So each row is divided by
  its own max |x| first, and one extra row pins the call's range to [-128/127, 1], whose uint8 grid
  (step 1/127, zero point 128) is exactly symmetric per-token int8 shifted by 128: every row is
  quantized as `int_mm` quantizes it, bit for bit the same whatever else is in the batch
  (tests/model/test_int8.py), and the result is multiplied back by the row's scale. (A range of
  [-1, 1] puts +1 half a step off the grid: each row's largest value would lose precision.)
  Without VNNI, the u8 x s8 products are summed in pairs in int16 (`vpmaddubsw`) and saturate; there
  the weights keep 7 bits (|w| <= 63: a pair stays within 2 * 255 * 63 < 32768) rather than the
  activations (torch.ao's `reduce_range`), which cost more perplexity (with their own smoothing,
  `kvstrata.model.formats.smoothquant`).

The weights of every kernel are symmetric (zero points 0), so only the two scales dequantize. The
figures behind each choice: docs/design/model.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstrata.core.machine import machine
from kvstrata.model.formats.base import Projection


def weight_bits() -> int:
    """Bits the int8 weights keep on this CPU: 8 with VNNI, else 7 (module docstring)."""
    return 8 if machine().int8_dot else 7


@dataclass(frozen=True)
class Int8Rows:
    """A projection's int8 weights as stored (the cached int8 state) and before any kernel packs them."""

    weight: torch.Tensor            # (out, in) int8, |w| <= 2 ** (bits - 1) - 1
    scale: torch.Tensor             # (out,) float32: w ~= weight * scale[:, None]
    bias: torch.Tensor | None       # (out,) float32

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, bits: int = 8) -> Int8Rows:
        assert w.dim() == 2 and w.device.type == "cpu", "int8 linear layers run on CPU"
        assert bits in (7, 8), "int8 rows keep 8 bits, or 7 where pair sums would saturate"
        top = 2 ** (bits - 1) - 1
        w = w.float()
        scale = (w.abs().amax(dim=1) / top).clamp_min(1e-12)            # (out,) an all-zero row keeps scale > 0
        q = torch.round(w / scale[:, None]).clamp_(-top, top).to(torch.int8)
        return cls(q, scale, None if bias is None else bias.float().contiguous())

    def dequantized(self) -> torch.Tensor:
        """(out, in) float32: the weights every kernel multiplies by, for references."""
        return self.weight.float() * self.scale[:, None]

    @property
    def nbytes(self) -> int:
        """Bytes read per call: the int8 weights and one float32 scale per row."""
        return self.weight.numel() + self.scale.numel() * 4


@dataclass(frozen=True)
class IntMMLinear(Projection):
    """Per-token symmetric int8 activations times int8 weights by `torch._int_mm` (int32 sums)."""

    weight_t: torch.Tensor          # (in, out) int8, a transposed view of the (out, in) rows
    scale: torch.Tensor             # (out,) float32
    bias: torch.Tensor | None
    nbytes: int

    @classmethod
    def from_rows(cls, rows: Int8Rows) -> IntMMLinear:
        return cls(rows.weight.t(), rows.scale, rows.bias, rows.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, in) float32 -> (M, out) float32."""
        x_scale = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_min_(1e-8).div_(127.0)
        xq = torch.round(x / x_scale).to(torch.int8)                                   # (M, in)
        y = torch._int_mm(xq, self.weight_t).mul(x_scale).mul_(self.scale)            # (M, out) float32
        return y if self.bias is None else y.add_(self.bias)


@dataclass(frozen=True)
class DynamicLinear(Projection):
    """A library's dynamic quantized linear (FBGEMM or oneDNN), made per-token (module docstring)."""

    packed: torch.ScriptObject      # the library's packed int8 weights (no bias: it is added after rescaling)
    range_row: torch.Tensor         # (1, in) float32: -128/127, 1, then zeros
    bias: torch.Tensor | None
    nbytes: int

    @classmethod
    def from_rows(cls, rows: Int8Rows, engine: str) -> DynamicLinear:
        out, n_in = rows.weight.shape
        assert n_in >= 2, "the range row needs two input channels"
        with warnings.catch_warnings():         # quantized tensors are deprecated, but are what prepack takes
            warnings.simplefilter("ignore", UserWarning)
            w = torch._make_per_channel_quantized_tensor(rows.weight, rows.scale.double(),
                                                         torch.zeros(out, dtype=torch.int64), 0)
        previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = engine           # prepack packs for the engine set now
        try:
            packed = torch.ops.quantized.linear_prepack(w, None)
        finally:
            torch.backends.quantized.engine = previous
        range_row = torch.zeros(1, n_in)
        range_row[0, :2] = torch.tensor([-128 / 127, 1.0])
        return cls(packed, range_row, rows.bias, rows.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, in) float32 -> (M, out) float32."""
        x_scale = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_min_(1e-8)    # (M, 1)
        pinned = torch.cat([x / x_scale, self.range_row])                                             # (M + 1, in)
        y = torch.ops.quantized.linear_dynamic(pinned, self.packed, False)[:-1].mul_(x_scale)
        return y if self.bias is None else y.add_(self.bias)


def _dynamic(engine: str) -> Callable[[Int8Rows], DynamicLinear]:
    return lambda rows: DynamicLinear.from_rows(rows, engine)


# The kernels a CPU may use, by name; `available_kernels` says which it has.
INT8_KERNELS: dict[str, Callable[[Int8Rows], IntMMLinear | DynamicLinear]] = {
    "int_mm": IntMMLinear.from_rows,
    "fbgemm": _dynamic("fbgemm"),
    "onednn": _dynamic("onednn"),
}


def available_kernels() -> list[str]:
    """The kernels that are exact on this CPU and this torch build: `int_mm` only with VNNI (without
    it oneDNN's s8 x s8 pairs saturate in int16), the dynamic kernels wherever torch has their
    engine (over 7-bit weights without VNNI)."""
    engines = torch.backends.quantized.supported_engines
    return [name for name in INT8_KERNELS if (machine().int8_dot if name == "int_mm" else name in engines)]
