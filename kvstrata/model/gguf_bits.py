"""GGUF weights served at their own bits (`--quantization gguf`): Q4_0, Q4_1 and Q8_0 projections run by
torch's 4-bit kernel `_weight_int4pack_mm_for_cpu` straight from the file's blocks, never widened to 16 bits.

Every supported type is a sum of 4-bit terms in the kernel's form, w = (q - 8) * scale + zero, with one
scale and zero per group of 32 weights along the input (a GGUF block is such a group):
- Q4_0 (d, 4-bit q):  w = d * (q - 8)          -> one term, scale d, zero 0;
- Q4_1 (d, m, q):     w = d * q + m            -> one term, scale d, zero m + 8 d;
- Q8_0 (d, int8 q):   q = 16 hi + lo, hi in [-8, 7], lo in [0, 15], so w = d * q is
                      (hi + 8 - 8) * 16 d + (lo - 8) * d + 8 d -> two terms (16 d, 0) and (d, 8 d).
So a term reads half a byte a weight: Q4 types a quarter of bf16's bytes, Q8_0 half. The kernel takes its
scales and zeros in the activation dtype and is fast in bfloat16 (float32 activations take a scalar
path there, ~30x slower: docs/design/model.md), so activations go in as bfloat16 whatever the model's
dtype, and the scales are bfloat16 roundings of the file's float16 ones (a relative 2^-9 at most; the
file's 4-bit rounding is 2^-4): `benchmarks/quant_accuracy.py` measures the perplexity it costs.

Block layouts (ggml): Q4_0 {f16 d; u8 qs[16]}, Q4_1 {f16 d; f16 m; u8 qs[16]}, Q8_0 {f16 d; i8 qs[32]};
a 4-bit block holds weight j in the low nibble of qs[j] and weight j + 16 in its high nibble.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

BLOCKS_FILE = "gguf-blocks"                           # in a converted GGUF's folder (kvstrata.model.gguf_convert)
GROUP = 32                                            # weights per GGUF block, and per kernel group
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}    # the types served at their own bits
INNER_K_TILES = 1                                     # what the CPU kernel's packing takes (any works)


@dataclass(frozen=True)
class Int4Terms:
    """A weight (out, in) as a sum of 4-bit terms: w = sum over terms of (q - 8) * scale + zero per group."""

    q: tuple[torch.Tensor, ...]         # each (out, in) int32 in [0, 15]
    scale: tuple[torch.Tensor, ...]     # each (out, in / 32) float32
    zero: tuple[torch.Tensor, ...]      # each (out, in / 32) float32

    def dequantized(self) -> torch.Tensor:
        """(out, in) float32: what the kernel multiplies by, before its scales are rounded to bf16."""
        out, n_in = self.q[0].shape
        w = torch.zeros(out, n_in // GROUP, GROUP)
        for q, scale, zero in zip(self.q, self.scale, self.zero):
            w += (q.view(out, -1, GROUP) - 8).float() * scale[..., None] + zero[..., None]
        return w.view(out, n_in)

    @staticmethod
    def cat(parts: list[Int4Terms]) -> Int4Terms:
        """Stacked along the output rows (the fused q|k|v and gate|up); every part has as many terms."""
        assert len({len(p.q) for p in parts}) == 1, "fused parts must have as many terms"
        stack = lambda field: tuple(torch.cat(ts) for ts in zip(*(getattr(p, field) for p in parts)))  # noqa: E731
        return Int4Terms(stack("q"), stack("scale"), stack("zero"))


def decode_blocks(raw: torch.Tensor, kind: str) -> Int4Terms:
    """A GGUF tensor's raw rows, (out, blocks * BLOCK_BYTES[kind]) uint8, as 4-bit terms."""
    assert kind in BLOCK_BYTES, f"{kind} is not served at its own bits"
    out = raw.shape[0]
    blocks = raw.reshape(out, -1, BLOCK_BYTES[kind])                                    # (out, nb, bytes)
    d = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1).float()           # (out, nb)
    if kind == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.int32)             # (out, nb, 32)
        hi = torch.div(q, 16, rounding_mode="floor")                                    # [-8, 7]
        lo = q - 16 * hi                                                                # [0, 15]
        return Int4Terms((_rows(hi + 8), _rows(lo)), (16 * d, d), (torch.zeros_like(d), 8 * d))
    first = 4 if kind == "Q4_1" else 2
    qs = blocks[..., first:].to(torch.int32)                                            # (out, nb, 16)
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1)                                          # (out, nb, 32)
    zero = (blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float() + 8 * d if kind == "Q4_1"
            else torch.zeros_like(d))
    return Int4Terms((_rows(q),), (d,), (zero,))


def _rows(q: torch.Tensor) -> torch.Tensor:
    return q.reshape(q.shape[0], -1).contiguous()


@dataclass(frozen=True)
class Int4Linear:
    """A projection whose weights are 4-bit terms packed for `_weight_int4pack_mm_for_cpu`: x (M, in) -> (M, out),
    in the dtype x came in (computed in bfloat16, see the module docstring)."""

    packed: tuple[torch.Tensor, ...]            # each (out, in / 2) uint8, the kernel's layout
    scales_and_zeros: tuple[torch.Tensor, ...]  # each (in / 32, out, 2) bfloat16
    bias: torch.Tensor | None                   # (out,) in the model dtype
    nbytes: int

    @classmethod
    def from_terms(cls, terms: Int4Terms, bias: torch.Tensor | None = None) -> Int4Linear:
        packed = tuple(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES) for q in terms.q)
        sz = tuple(torch.stack([s.t(), z.t()], dim=-1).to(torch.bfloat16).contiguous()
                   for s, z in zip(terms.scale, terms.zero))
        nbytes = sum(p.numel() * p.element_size() for p in packed) + sum(t.numel() * 2 for t in sz)
        return cls(packed, sz, bias, nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        widen = x.dtype != torch.bfloat16           # a float32 model; no conversion (a dispatch each) in bf16
        xb = x.to(torch.bfloat16) if widen else x
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed[0], GROUP, self.scales_and_zeros[0])
        for packed, sz in zip(self.packed[1:], self.scales_and_zeros[1:]):
            y += torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP, sz)
        y = y.to(x.dtype) if widen else y
        return y if self.bias is None else y.add_(self.bias)


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

    def terms(self, names: list[str]) -> Int4Terms | None:
        """The 4-bit terms of the matrices `names` stacked by rows, or None unless every one has some of
        the same count (a Q8_0 part beside a Q4 part is widened instead)."""
        if not all(name in self.raw for name in names) or len({self.types[n] == "Q8_0" for n in names}) > 1:
            return None
        return Int4Terms.cat([decode_blocks(self.raw[n], self.types[n]) for n in names])

    def widened(self, names: list[str]) -> str:
        """What a warning says of the matrices `names` left in the model dtype: their types, counted."""
        return ", ".join(f"{n} {kind}" for kind, n in Counter(self.types[name] for name in names).most_common())
