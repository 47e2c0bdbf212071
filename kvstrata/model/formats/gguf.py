"""The `gguf` weight format: a GGUF file's matrices served at their own bits, by our kernel
(kernels/csrc/gguf_matmul.cpp) straight from the file's blocks, never widened to 16 bits (BF16's are 16). The
types it runs are the kernel header's table (`kvstrata.model.kernels.gguf.GGUF_TYPES`); any other is widened to
the dtype (`dense_projection`), with a warning that counts them.

A decode step is memory-bound, so the weights stay at the file's 4.5-8.5 bits a weight and the
activations come down to meet them, as llama.cpp does: each activation row is quantized to int8 in
blocks of 32 (scale max|x| / 127), and a weight block times an activation block is one integer dot
product (AVX-512 VNNI's u8 x s8 sums, or AVX2's), scaled once in float32:
- Q4_0 (d, 4-bit q):  w = d * (q - 8)
- Q4_1 (d, m, q):     w = d * q + m
- Q8_0 (d, int8 q):   w = d * q
- Q5_0 / Q5_1 (5-bit q): as Q4_0 (offset 16) / Q4_1
- Q4_K / Q5_K (blocks of 256: 8 of 32 with 6-bit scales sc and minimums mn, f16 d and dmin): w = d sc q - dmin mn
- Q6_K (d, int8 sc per 16, 6-bit q per weight, in blocks of 256): w = d * sc * (q - 32)
with the file's float16 d and m as they are (the K-quants' d sc and dmin mn in float32, where they are exact).
The weights are repacked once at load (tiles of 16 rows, csrc/gguf_blocks.h) at the file's bytes for Q4_0, Q4_1
and Q8_0, wider for the 5- and 6-bit kinds (a byte a weight) and the K-quants' scales. A fused projection whose
parts are of kinds that share no layout (a Q4_K_M file's Q5_0 q and k beside its Q8_0 v) runs each part at its
bits into its columns of one output (`GGUFParts`). Every ISA path gives the same bits, and a row's
result never depends on the other rows of its batch, so greedy outputs do not depend on batching or on
what the caches held. `benchmarks/quant_accuracy.py` measures the perplexity int8 activations cost
(llama.cpp pays the same). BF16 matrices take the activations as they are (bf16, or float32) in float32
FMAs with denormals flushed, the bits of AVX512-BF16's dot product (csrc/bf16_tiles.h).

Block layouts (ggml): Q4_0 {f16 d; u8 qs[16]}, Q4_1 {f16 d; f16 m; u8 qs[16]}, Q8_0 {f16 d; i8 qs[32]};
a 4-bit block holds weight j in the low nibble of qs[j] and weight j + 16 in its high nibble; Q5_0 / Q5_1 add
u32 qh (the fifth bits) after d (and m). Q4_K {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}, Q5_K adds u8
qh[32] before qs, Q6_K {u8 ql[128]; u8 qh[64]; i8 sc[16]; f16 d}, each for 256 weights (the C++ packer unpacks
them). What a new type touches: docs/design/model.md.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from kvstrata.model import kernels
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
from kvstrata.model.formats.dense import DenseFormat, dense_projection
from kvstrata.model.kernels.gguf import GGUF_TYPES, gguf_type
from kvstrata.model.kernels.layers import KvsProjection
from kvstrata.model.kernels.memory import huge_page_bytes
from kvstrata.model.sources.gguf_convert import BLOCKS_FILE

logger = logging.getLogger(__name__)


def as_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """Q4_0 rows as Q4_1 rows of the same weights (m = -8 d, exact in float16), for a fused projection whose
    parts mix the two."""
    blocks = raw.reshape(raw.shape[0], -1, gguf_type("Q4_0").block_bytes)
    d = blocks[..., :2].contiguous().view(torch.float16)
    m = (d.float() * -8).to(torch.float16).view(torch.uint8)
    return torch.cat([blocks[..., :2], m, blocks[..., 2:]], dim=-1).reshape(raw.shape[0], -1)


@dataclass(frozen=True)
class GGUFLinear(Projection):
    """A projection whose weights are a GGUF type's blocks in the kernel's layout: x (M, in) -> (M, out),
    in the dtype x came in (float32 and bfloat16 directly, others through float32)."""

    kind: str                       # a GGUF_TYPES name
    packed: torch.Tensor            # uint8, the kernel's layout
    n_out: int
    n_in: int
    bias: torch.Tensor | None       # (out,) in the model dtype
    kernel: kernels.GGUFMatmul      # the kernel at the ISA level it was packed for

    @classmethod
    def from_rows(cls, kind: str, raw: torch.Tensor, bias: torch.Tensor | None = None,
                  kernel: kernels.GGUFMatmul | None = None) -> GGUFLinear:
        """raw (out, blocks * block bytes) uint8: a matrix's rows as the file holds them."""
        kernel = kernel or kernels.face(kernels.GGUFMatmul)
        assert kernel is not None, f"the GGUF kernel is off here ({kernels.off_reason()})"
        facts = gguf_type(kind)
        assert raw.shape[1] % facts.block_bytes == 0
        n_in = raw.shape[1] // facts.block_bytes * facts.block_weights
        return cls(kind, kernel.pack(kind, raw.contiguous(), n_in), raw.shape[0], n_in, bias, kernel)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _run([self], self.n_out, self.bias, x)

    def kernel_view(self) -> KvsProjection | None:
        if self.bias is not None:
            return None
        return KvsProjection(self.packed.data_ptr(), gguf_type(self.kind).kind, self.n_out, self.n_in)


@dataclass(frozen=True)
class GGUFParts(Projection):
    """A fused projection whose parts the file keeps in types that share no layout (Gemma 3's Q5_0 q and k beside a
    Q8_0 v): each part at its own bits, written into its columns of the one output."""

    parts: list[GGUFLinear]         # each without bias (`in_one_arena` may replace them)
    n_out: int
    bias: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self.parts, self.n_out, self.bias, x)


def _run(parts: list[GGUFLinear], n_out: int, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """x (M, in) times each part's matrix, into its columns of y (M, n_out), in the dtype x came in (float32 and
    bfloat16 directly, others through float32), plus the bias."""
    assert x.dim() == 2 and all(x.shape[1] == part.n_in for part in parts)
    xk = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
    if xk.stride(1) != 1:
        xk = xk.contiguous()
    y = xk.new_empty(xk.shape[0], n_out)
    column = 0
    for part in parts:
        part.kernel(part.kind, part.packed, part.n_out, xk, y if len(parts) == 1 else y[:, column:column + part.n_out])
        column += part.n_out
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    return y if bias is None else y.add_(bias)


def in_one_arena(slots: list[tuple[dict, str]]) -> None:
    """Move the `GGUFLinear` at each `where[key]` of `slots` into one buffer on transparent huge pages
    (`kernels.memory.huge_page_bytes`), each at a 64-byte boundary: a small model's matrices are each below a huge
    page, and a step reads them all in turn (SmolLM2 BF16's weights at +12-15% on the Zen 4 VM). Each slot is
    replaced as its weights are copied, which drops the old buffer (the slot held its only reference), so
    memory peaks at one matrix above the model's."""
    aligned = [-(-where[key].nbytes // 64) * 64 for where, key in slots]
    arena = huge_page_bytes(sum(aligned))
    offset = 0
    for (where, key), size in zip(slots, aligned):
        view = arena[offset:offset + where[key].nbytes]
        view.copy_(where[key].packed)
        where[key] = replace(where[key], packed=view)
        offset += size


@dataclass(frozen=True)
class GGUFBlocks:
    """A converted GGUF's own blocks: the raw rows of every matrix in a type served at its bits, by HF
    name, and the GGUF type of every matrix (those left out are widened to the model dtype)."""

    raw: dict[str, torch.Tensor]        # (out, row bytes) uint8
    types: dict[str, str]

    @classmethod
    def read(cls, folder: Path) -> GGUFBlocks:
        with safe_open(folder / BLOCKS_FILE, "pt") as f:
            return cls({name: f.get_tensor(name) for name in f.keys()}, json.loads(f.metadata()["types"]))

    def linear(self, names_: list[str], bias: torch.Tensor | None = None) -> GGUFLinear | GGUFParts | None:
        """The matrices `names_` stacked by rows as one `GGUFLinear` where they share a type (Q4_0 beside Q4_1 runs
        as Q4_1), else as `GGUFParts`; None unless each is in a type served at its bits."""
        if not all(n in self.raw and self.types[n] in GGUF_TYPES for n in names_):
            return None
        kind = shared_kind([self.types[n] for n in names_])
        if kind is None:
            parts = [GGUFLinear.from_rows(self.types[n], self.raw[n]) for n in names_]
            return GGUFParts(parts, sum(part.n_out for part in parts), bias)
        raws = [as_q4_1(self.raw[n]) if self.types[n] == "Q4_0" and kind == "Q4_1" else self.raw[n] for n in names_]
        return GGUFLinear.from_rows(kind, torch.cat(raws), bias)

    def widened(self, names_: list[str]) -> str:
        """What a warning says of the matrices `names_` left in the model dtype: their types, counted."""
        return ", ".join(f"{n} {kind}" for kind, n in Counter(self.types[name] for name in names_).most_common())


def shared_kind(kinds: list[str]) -> str | None:
    """The one type the kernel runs parts of these types in as one matrix, or None (then each part on its own)."""
    distinct = set(kinds)
    if distinct == {"Q4_0", "Q4_1"}:
        return "Q4_1"
    kind = distinct.pop() if len(distinct) == 1 else None
    return kind if kind in GGUF_TYPES else None


def read_types(folder: Path | None) -> dict[str, str] | None:
    """Every matrix's GGUF type by HF name, from a converted GGUF's folder without reading a tensor; None for a
    folder that did not come from a GGUF."""
    if folder is None or not (folder / BLOCKS_FILE).is_file():
        return None
    with safe_open(folder / BLOCKS_FILE, "pt") as f:
        return json.loads(f.metadata()["types"])


def all_at_bits(arch: ModelArch, types: dict[str, str]) -> bool:
    """Whether every projection and the head of `arch` runs at its file's bits (so a step is our kernels only)."""
    matrices = [names.parts(i, p) for i in range(arch.num_layers) for p in names.PROJECTIONS]
    matrices.append([names.head(arch.tie_word_embeddings)])
    return all(types.get(n) in GGUF_TYPES for parts in matrices for n in parts)


class GGUFFormat(WeightFormat):
    """`--quantization gguf` (and `auto` for a GGUF file on the CPU): the file's own blocks."""

    name = "gguf"
    cpu_only = True
    exact_attention = True        # int8 activation blocks: see WeightFormat.exact_attention

    def unavailable(self, target: Target) -> str | None:
        if target.dummy:
            return "--quantization gguf serves a GGUF file's own blocks; dummy weights have none"
        if target.compile:
            return ("--quantization gguf runs kvstrata's GGUF kernel, which --compile cannot trace; drop --compile, "
                    "or widen the file with --quantization none")
        if target.gguf_types is None:
            return ("--quantization gguf serves a GGUF file's own blocks, and these weights did not come from a GGUF "
                    "file; pass a .gguf model, or --quantization none or int8")
        if kernels.off_reason() is not None:
            return f"--quantization gguf needs kvstrata's GGUF kernel, which is off here ({kernels.off_reason()})"
        return None

    def auto_dtype(self, target: Target) -> torch.dtype:
        """bfloat16 where every matrix is at its bits, whatever the CPU's float types: a step is then our kernels
        alone (the fused layers, which take bf16 and widen it in software where the CPU has no bf16); a file
        with widened matrices runs those through oneDNN, so it takes the dtype the `none` format would."""
        if target.gguf_types is not None and all_at_bits(target.arch, target.gguf_types):
            return torch.bfloat16
        return DenseFormat().auto_dtype(target)

    def footprint(self, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> WeightFootprint:
        """Once loaded: the matrices at their bits (at most 1.25 bytes a weight: Q5_K packed, Q6_K 1.125) and
        the embeddings in the dtype. While loading: the file's blocks read whole beside their packed copies, and
        a widened matrix at a time in float32."""
        parameters, linear, embed, largest = weight_counts(arch)
        at_bits = (linear + embed) * 5 // 4
        resident = embed * dtype.itemsize + at_bits
        return WeightFootprint(resident + at_bits + largest * 4, resident, parameters,
                               "the file's blocks beside their packed copies")

    def identity(self) -> dict:
        return {"gguf_kernel": kernels.GGUF_REVISION}

    def pack(self, checkpoint: Checkpoint, ctx: PackContext) -> Packed:
        """Each projection (and the head) whose parts the file keeps in a type the kernel runs, at those bits; the
        rest widened. The packed ones then share one buffer on huge pages (`in_one_arena`)."""
        assert ctx.folder is not None, "unavailable() refuses weights that are no GGUF's"
        a = ctx.arch
        blocks = GGUFBlocks.read(ctx.folder)
        widened: list[str] = []
        biases = {"qkv": a.attention_bias, "o": a.attention_out_bias, "gate_up": False, "down": False}

        def projection(parts: list[str], bias: torch.Tensor | None, weight: Callable[[], torch.Tensor]) -> Projection:
            """At the file's bits where the blocks have them (the float copies dropped unread), else widened."""
            own = blocks.linear(parts, bias)
            if own is not None:
                checkpoint.skip(parts)
                return own
            widened.extend(parts)
            return dense_projection(weight(), bias, ctx)

        layers = [{p: projection(names.parts(i, p), checkpoint.bias(i, p, biases[p]),
                                 lambda i=i, p=p: checkpoint.matrix(i, p)) for p in names.PROJECTIONS}
                  for i in range(a.num_layers)]
        head = {"head": projection([names.head(a.tie_word_embeddings)], None,
                                   (lambda: ctx.embeddings) if a.tie_word_embeddings
                                   else (lambda: checkpoint.take(names.LM_HEAD)))}
        if widened:
            logger.warning("%d %s widened to %s (%s); kvstrata runs %s at their own bits", len(widened),
                           "matrix" if len(widened) == 1 else "matrices", str(ctx.dtype).removeprefix("torch."),
                           blocks.widened(widened), ", ".join(GGUF_TYPES))
        blocks.raw.clear()                  # the file's rows: each slot below then holds its weights' only copy
        in_one_arena([(where, key) for where in [*layers, head] for key in where if isinstance(where[key], GGUFLinear)]
                     + [(proj.parts, i) for where in [*layers, head] for proj in where.values()
                        if isinstance(proj, GGUFParts) for i in range(len(proj.parts))])
        return Packed(layers, head["head"])
