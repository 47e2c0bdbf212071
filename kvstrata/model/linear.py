"""The float projections: `PackedLinear` (oneDNN, weights reordered once at load) on CPU,
`DenseLinear` (`F.linear`) elsewhere. Both are called as `proj(x)`, x (M, in) -> (M, out).

Why pack. `F.linear` on CPU calls MKL's gemm on the plain (out, in) weight, which copies it into
its own blocked layout inside every call; oneDNN's inner-product primitive takes the weight once
in its layout (`mkldnn._reorder_linear_weight`, what inductor's CPU freezing pass does) and then
reads it straight through. Measured on this project's 2-core AMD EPYC (AVX-512, BF16), 2 threads,
one layer's projections plus the 49,152-row head, ms per pass (F.linear -> packed):

    rows      1            16           128          512
    fp32    7.8 -> 2.7   16.5 -> 3.9   48 -> 19     192 -> 94
    bf16    2.2 -> 1.4    3.0 -> 2.2   10.4 -> 9.4   49 -> 47

Whole decode steps (benchmarks/model_step.py, 600 tokens of context): bf16 batch 1 / 16 / 32 20.4 /
30.4 / 44.8 -> 13.8 / 27.1 / 38.1 ms; fp32 batch 16 / 32 70.4 / 112 -> 39.2 / 61.5 ms, and batch 1
15.8 -> ~19 ms, the one loss (against the per-thread split `bmm` this replaced). Results stay
float32 sums (within ~3e-6 of float64 for fp32, as MKL's). The hint is the row count oneDNN tunes
its blocking for; any row count works with it (16 and 64 measured alike, 1 worse from 16 rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

PACK_ROWS_HINT = 16


class Projection(Protocol):
    """What the decoder calls for each of its projections: `proj(x)`, x (M, in) -> (M, out)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int:
        """Bytes of weights one call reads."""
        ...


@dataclass(frozen=True)
class DenseLinear:
    """A projection in the model dtype: y = x @ weight.T + bias. The int8 counterpart is
    `kvstrata.model.int8.Int8Linear`."""

    weight: torch.Tensor           # (out, in)
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


@dataclass(frozen=True)
class PackedLinear:
    """A float projection whose weight oneDNN holds in its own layout (an opaque tensor: no
    `.weight` to read back, so whoever needs the float rows, e.g. int8 quantization, runs first)."""

    packed: torch.Tensor           # mkldnn layout, logically (out, in)
    bias: torch.Tensor | None
    nbytes: int
    min_rows: int = 1              # 2 under --batch-invariant: a lone row is padded to two (see below)

    @classmethod
    def from_dense(cls, dense: DenseLinear, min_rows: int = 1) -> PackedLinear:
        assert can_pack(dense.weight), "oneDNN packs float32 / bfloat16 CPU weights"
        packed = torch.ops.mkldnn._reorder_linear_weight(dense.weight, PACK_ROWS_HINT)
        return cls(packed, dense.bias, dense.nbytes, min_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN computes a single row on another path than two or more: in bf16, 41 of 2,048 random
        rows (SmolLM2's projections, 4 layers) came out different in their last bit alone than in a
        batch, none when padded to two rows (and none between any two row counts from 2 to 255).
        So `min_rows=2` makes a row's bits independent of its batch."""
        m = x.shape[0]
        if m < self.min_rows:
            x = torch.cat([x, x.new_zeros(self.min_rows - m, x.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y[:m] if m < self.min_rows else y


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `PackedLinear` can hold this weight: a float32 or bfloat16 CPU tensor, with a torch
    built with oneDNN (bfloat16 also needs the CPU to have AVX-512, as oneDNN's bf16 kernels do)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
