"""`linear(x, w)`: y = x @ w.T, split across CPU threads by hand for the few-row (decode) case.

Why: on the 2-core AMD EPYC (AVX2) machine, MKL's sgemm behind `F.linear` does not use the second
thread for small M: it reads weights at ~12 GB/s with 1 or 2 threads, while the memory system
gives ~30 GB/s. Cutting the weight's rows into one slab per thread and running the slabs as one
`bmm` (torch parallelises bmm over its batch) reaches ~22 GB/s. Measured on 283 MB of weights,
2 threads (ms, F.linear -> split): M=1 23.6 -> 13.0, M=8 49 -> 31, M=32 93 -> 72,
M=96 159 -> 126; from M=128 F.linear is faster again (188 vs 227), so larger batches keep it.

    w (out, in) viewed as (P, out/P, in)          no copy
    bmm(w, x.T expanded to (P, in, M))     ->  (P, out/P, M)  ->  (M, out)      most M
    bmm(x expanded to (P, M, in), w.T)     ->  (P, M, out/P)  ->  (M, out)      5 <= M < 16

The two orientations hit different MKL kernels; the second is up to 1.8x faster for 5 <= M < 16
and slower elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

SPLIT_MAX_ROWS = 127      # from M = 128 on, F.linear's own threading wins


def split_parts(device: torch.device, dtype: torch.dtype, out_features: list[int]) -> int:
    """Row slabs per matmul: one per CPU thread for float32 when every weight divides evenly, else 1
    (CUDA needs no help; bfloat16 `bmm` on a CPU without native bf16 is far slower than F.linear)."""
    parts = torch.get_num_threads() if device.type == "cpu" and dtype == torch.float32 else 1
    return parts if parts > 1 and all(n % parts == 0 for n in out_features) else 1


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, parts: int = 1
           ) -> torch.Tensor:
    """x (M, in), w (out, in) -> (M, out), contiguous."""
    m = x.shape[0]
    if parts == 1 or m > SPLIT_MAX_ROWS:
        return F.linear(x, w, bias)
    out = w.shape[0]
    slabs = w.view(parts, out // parts, -1)                                          # (P, out/P, in)
    if 5 <= m < 16:
        y = torch.bmm(x.expand(parts, -1, -1), slabs.transpose(1, 2)).transpose(0, 1)   # (M, P, out/P)
    else:
        y = torch.bmm(slabs, x.t().expand(parts, -1, -1)).permute(2, 0, 1)            # (M, P, out/P)
    y = y.contiguous().view(m, out)          # a copy unless M == 1
    return y if bias is None else y.add_(bias)


class Projection(Protocol):
    """What the decoder calls for each of its projections: `proj(x)`, x (M, in) -> (M, out)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int:
        """Bytes of weights one call reads."""
        ...


@dataclass(frozen=True)
class DenseLinear:
    """A projection in the model dtype: y = x @ weight.T + bias through `linear`. The int8
    counterpart is `kvstrata.model.int8.Int8Linear`; both are called as `proj(x)`."""

    weight: torch.Tensor           # (out, in)
    bias: torch.Tensor | None
    parts: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.parts)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()
