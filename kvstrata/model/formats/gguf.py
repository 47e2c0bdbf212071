"""GGUF weights served at their own bits (`--quantization gguf`): Q4_0, Q4_1, Q8_0, Q6_K and BF16 projections run
by our kernel (csrc/gguf_matmul.cpp) straight from the file's blocks, never widened to 16 bits (BF16's are 16).

A decode step is memory-bound, so the weights stay at the file's 4.5-8.5 bits a weight and the
activations come down to meet them, as llama.cpp does: each activation row is quantized to int8 in
blocks of 32 (scale max|x| / 127), and a weight block times an activation block is one integer dot
product (AVX-512 VNNI's u8 x s8 sums, or AVX2's), scaled once in float32:
- Q4_0 (d, 4-bit q):  w = d * (q - 8)
- Q4_1 (d, m, q):     w = d * q + m
- Q8_0 (d, int8 q):   w = d * q
- Q6_K (d, int8 sc per 16, 6-bit q per weight, in blocks of 256): w = d * sc * (q - 32)
with the file's float16 d and m as they are. The weights are repacked once at load (tiles of 16 rows,
see the C++ source) at the same bytes as the file, but Q6_K at a byte a weight (1.125 with its scales,
against the file's 0.82 and bfloat16's 2: llama-quantize keeps the output matrix of a Q4_0 file in Q6_K,
a third of a 1B model's bytes). Every ISA path gives the same bits, and a row's
result never depends on the other rows of its batch, so greedy outputs do not depend on batching or on
what the caches held. `benchmarks/quant_accuracy.py` measures the perplexity int8 activations cost
(llama.cpp pays the same). BF16 matrices take the activations as they are (bf16, or float32) in float32
FMAs with denormals flushed, the bits of AVX512-BF16's dot product (csrc/bf16_tiles.h).

Block layouts (ggml): Q4_0 {f16 d; u8 qs[16]}, Q4_1 {f16 d; f16 m; u8 qs[16]}, Q8_0 {f16 d; i8 qs[32]};
a 4-bit block holds weight j in the low nibble of qs[j] and weight j + 16 in its high nibble. Q6_K
{u8 ql[128]; u8 qh[64]; i8 sc[16]; f16 d} for 256 weights (the C++ packer unpacks it).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from kvstrata.core.machine import machine
from kvstrata.model import kernels

BLOCKS_FILE = "gguf-blocks"                           # in a converted GGUF's folder (kvstrata.model.gguf_convert)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q6_K": 210, "BF16": 2}    # the types served at their own bits
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q6_K": 256, "BF16": 1}


def kernel_level() -> int:
    """Which of the kernel's paths this CPU takes: 3 AVX-512 VNNI + BF16 (BF16 matrices by VDPBF16PS), 2 AVX-512
    VNNI, 1 AVX2, 0 plain C++ (all give the same bits)."""
    cpu = machine()
    if all(cpu.has(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")):
        return 3 if cpu.has("avx512_bf16") else 2
    return 1 if cpu.has("avx2") and cpu.has("fma") else 0


def as_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """Q4_0 rows as Q4_1 rows of the same weights (m = -8 d, exact in float16), for a fused projection whose
    parts mix the two."""
    blocks = raw.reshape(raw.shape[0], -1, BLOCK_BYTES["Q4_0"])
    d = blocks[..., :2].contiguous().view(torch.float16)
    m = (d.float() * -8).to(torch.float16).view(torch.uint8)
    return torch.cat([blocks[..., :2], m, blocks[..., 2:]], dim=-1).reshape(raw.shape[0], -1)


@dataclass(frozen=True)
class GGUFLinear:
    """A projection whose weights are a GGUF type's blocks in the kernel's layout: x (M, in) -> (M, out),
    in the dtype x came in (float32 and bfloat16 directly, others through float32)."""

    kind: str                       # a BLOCK_BYTES type
    packed: torch.Tensor            # uint8, the kernel's layout
    n_out: int
    n_in: int
    bias: torch.Tensor | None       # (out,) in the model dtype
    level: int                      # the kernel path (kernel_level())

    @classmethod
    def from_rows(cls, kind: str, raw: torch.Tensor, bias: torch.Tensor | None = None,
                  level: int | None = None) -> GGUFLinear:
        """raw (out, blocks * BLOCK_BYTES[kind]) uint8: a matrix's rows as the file holds them."""
        kernel = kernels.gguf_matmul()
        assert kernel is not None, "the GGUF kernel could not be built here"
        n_in = raw.shape[1] // BLOCK_BYTES[kind] * BLOCK_WEIGHTS[kind]
        assert raw.shape[1] % BLOCK_BYTES[kind] == 0
        packed = kernel.pack(kind, raw.contiguous(), n_in)
        return cls(kind, packed, raw.shape[0], n_in, bias, kernel_level() if level is None else level)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel = kernels.gguf_matmul()
        assert kernel is not None and x.dim() == 2 and x.shape[1] == self.n_in
        xk = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        if xk.stride(1) != 1:
            xk = xk.contiguous()
        y = xk.new_empty(xk.shape[0], self.n_out)
        kernel(self.kind, self.level, self.packed, self.n_out, xk, y)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)


def in_one_arena(slots: list[tuple[dict, str]]) -> None:
    """Move the `GGUFLinear` at each `where[key]` of `slots` into one buffer on transparent huge pages
    (`kernels.huge_page_bytes`), each at a 64-byte boundary: a small model's matrices are each below a huge
    page, and a step reads them all in turn (SmolLM2 BF16's weights at +12-15% on the Zen 4 VM). Each slot is
    replaced as its weights are copied, which drops the old buffer (the slot held its only reference), so
    memory peaks at one matrix above the model's."""
    aligned = [-(-where[key].nbytes // 64) * 64 for where, key in slots]
    arena = kernels.huge_page_bytes(sum(aligned))
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
        path = folder / BLOCKS_FILE
        if not path.is_file():
            raise ValueError(f"--quantization gguf serves a GGUF file's own blocks, and {folder} did not come "
                             "from a GGUF file; pass a .gguf model, or --quantization none or int8")
        with safe_open(path, "pt") as f:
            return cls({name: f.get_tensor(name) for name in f.keys()}, json.loads(f.metadata()["types"]))

    def linear(self, names: list[str], bias: torch.Tensor | None = None) -> GGUFLinear | None:
        """The matrices `names` stacked by rows as one `GGUFLinear`, or None unless each is in a type served at
        its bits and they can share one (Q4_0 beside Q4_1 runs as Q4_1; other mixes are widened)."""
        if not all(name in self.raw for name in names):
            return None
        kinds = {self.types[n] for n in names}
        if kinds == {"Q4_0", "Q4_1"}:
            raws = [self.raw[n] if self.types[n] == "Q4_1" else as_q4_1(self.raw[n]) for n in names]
            return GGUFLinear.from_rows("Q4_1", torch.cat(raws), bias)
        if len(kinds) > 1:
            return None
        return GGUFLinear.from_rows(kinds.pop(), torch.cat([self.raw[n] for n in names]), bias)

    def widened(self, names: list[str]) -> str:
        """What a warning says of the matrices `names` left in the model dtype: their types, counted."""
        return ", ".join(f"{n} {kind}" for kind, n in Counter(self.types[name] for name in names).most_common())
