"""The float projections: `PackedLinear` (oneDNN, weights reordered once at load) on CPU,
`DenseLinear` (`F.linear`) elsewhere. Both are called as `proj(x)`, x (M, in) -> (M, out).

Why pack. `F.linear` on CPU calls MKL's gemm on the plain (out, in) weight, which copies it into
its own blocked layout inside every call; oneDNN's inner-product primitive takes the weight once
in its layout (`mkldnn._reorder_linear_weight`, what inductor's CPU freezing pass does) and then
reads it straight through: one layer's projections and the head at 16 rows took 16.5 -> 3.9 ms in
fp32 and 3.0 -> 2.2 ms in bf16 (2-core AVX-512 EPYC, 2 threads). Where it loses: an fp32 decode
step of one sequence, 15.8 -> ~19 ms (against the per-thread split `bmm` this replaced). Results
stay float32 sums, as MKL's. The hint is the row count oneDNN tunes its blocking for; any row count
works with it. The full figures: docs/design/model.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvstrata.model.onednn import bound_kernel_caches

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
        bound_kernel_caches()           # before oneDNN's first kernel (kvstrata.model.onednn)
        packed = torch.ops.mkldnn._reorder_linear_weight(dense.weight, PACK_ROWS_HINT)
        return cls(packed, dense.bias, dense.nbytes, min_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN computes a single row on another path than two or more, so a bf16 row alone can differ
        in its last bit from the same row in a batch (never between two row counts from 2 up). So
        `min_rows=2` makes a row's bits independent of its batch (docs/design/model.md)."""
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
