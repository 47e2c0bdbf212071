"""The `none` weight format: projections in the model dtype's own floats. `PackedLinear` (oneDNN, weights
reordered once at load) on CPU, `DenseLinear` (`F.linear`) elsewhere and under `--compile`. Both are called as
`proj(x)`, x (M, in) -> (M, out); the other formats widen to them what they cannot run at their own bits.

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

import torch
import torch.nn.functional as F

from kvstrata.core.machine import machine
from kvstrata.model.arch import ModelArch
from kvstrata.model.arch import tensors as names
from kvstrata.model.formats.base import (
    Checkpoint,
    PackContext,
    Packed,
    Projection,
    Target,
    WeightFootprint,
    WeightFormat,
    weight_counts,
)
from kvstrata.model.formats.onednn import bound_kernel_caches

PACK_ROWS_HINT = 16


@dataclass(frozen=True)
class DenseLinear(Projection):
    """A projection in the model dtype: y = x @ weight.T + bias."""

    weight: torch.Tensor           # (out, in)
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


@dataclass(frozen=True)
class PackedLinear(Projection):
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


def dense_projection(weight: torch.Tensor, bias: torch.Tensor | None, ctx: PackContext) -> Projection:
    """A float projection as this model runs it: handed to oneDNN where it can take it (not under --compile:
    dynamo cannot trace its packed weights), a lone row padded to two where attention is exact in 16 bits
    (`PackedLinear.__call__`)."""
    dense = DenseLinear(weight, bias)
    if ctx.traceable or not can_pack(weight):
        return dense
    return PackedLinear.from_dense(dense, 2 if ctx.exact and ctx.dtype.itemsize < 4 else 1)


def native_bf16() -> bool:
    """bf16 matmuls in hardware (AVX512-BF16 / AMX; `kvstrata.core.machine`) and a oneDNN that uses them. oneDNN
    also runs bf16 on plain AVX-512 and AVX2 by converting, slower than float32 there."""
    if not machine().native_bf16:
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):     # a torch build without oneDNN
        return False


class DenseFormat(WeightFormat):
    """`--quantization none`: every matrix in the dtype, multiplied by oneDNN (CPU) or torch."""

    name = "none"

    def auto_dtype(self, target: Target) -> torch.dtype:
        """bfloat16 on CUDA, and on a CPU only where oneDNN has a native bf16 GEMM: elsewhere oneDNN emulates
        bf16 and its matmuls run several times slower than float32 at every batch size. With it, bf16 is the
        better serving default from batch ~8 up (docs/design/model.md, "The dtype")."""
        return torch.bfloat16 if target.device.type == "cuda" or native_bf16() else torch.float32

    def footprint(self, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> WeightFootprint:
        """Every parameter in the dtype; on CPU a tied head is packed for oneDNN as a copy of the embeddings, and
        packing a projection briefly holds it twice (a float32 tensor of the largest at its peak)."""
        parameters, _, embed, largest = weight_counts(arch)
        size = dtype.itemsize
        resident = parameters * size + (embed * size if arch.tie_word_embeddings and device.type == "cpu" else 0)
        return WeightFootprint(resident + largest * 4, resident, parameters, f"{_name(dtype)} weights")

    def pack(self, checkpoint: Checkpoint, ctx: PackContext) -> Packed:
        a = ctx.arch
        biases = {"qkv": a.attention_bias, "o": a.attention_out_bias, "gate_up": False, "down": False}
        layers = [{p: dense_projection(checkpoint.matrix(i, p), checkpoint.bias(i, p, biases[p]), ctx)
                   for p in names.PROJECTIONS} for i in range(a.num_layers)]
        head = ctx.embeddings if a.tie_word_embeddings else checkpoint.take(names.LM_HEAD)
        return Packed(layers, dense_projection(head, None, ctx))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
