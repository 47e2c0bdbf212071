"""`kvs_gguf_pack` and `kvs_gguf_matmul` (csrc/gguf_matmul.cpp): a GGUF's matrices packed once, then multiplied
at their own bits. The types and their facts are the header's one table (`abi.gguf_types`). Raw pointers: each
call checks what the kernel relies on; kvstrata.model.formats.gguf is the format that uses it."""

from __future__ import annotations

import torch

from kvstrata.model.kernels.abi import GGUFType, Library, gguf_types
from kvstrata.model.kernels.memory import huge_page_bytes

GGUF_TYPES: dict[str, GGUFType] = {t.name: t for t in gguf_types()}    # the types the kernel runs, by name


def gguf_type(name: str) -> GGUFType:
    """The header's row for a GGUF type the kernel runs; KeyError for another."""
    return GGUF_TYPES[name]


class GGUFMatmul:
    def __init__(self, lib: Library) -> None:
        self.lib = lib

    def packed_bytes(self, kind: str, n_out: int, n_in: int) -> int:
        return self.lib.kvs_gguf_packed_bytes(gguf_type(kind).kind, n_out, n_in)

    def pack(self, kind: str, raw: torch.Tensor, n_in: int) -> torch.Tensor:
        """raw (out, blocks * block bytes) uint8, contiguous -> the kernel's layout (uint8, 1-D)."""
        facts = gguf_type(kind)
        assert raw.dtype == torch.uint8 and raw.is_contiguous() and raw.dim() == 2
        unit = 2 if facts.block_weights == 1 else 32         # bf16 pairs, or activation blocks of 32
        assert n_in % facts.block_weights == 0 and n_in % unit == 0
        assert raw.shape[1] == n_in // facts.block_weights * facts.block_bytes
        packed = huge_page_bytes(self.packed_bytes(kind, raw.shape[0], n_in))
        self.lib.kvs_gguf_pack(facts.kind, raw.data_ptr(), raw.shape[0], n_in, packed.data_ptr())
        return packed

    def __call__(self, kind: str, packed: torch.Tensor, n_out: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (M, out) = x (M, in) @ W.T, both float32 or both bfloat16 with unit column strides (every ISA level
        gives the same bits)."""
        assert x.dtype == y.dtype and x.dtype in (torch.float32, torch.bfloat16) and x.stride(1) == y.stride(1) == 1
        assert y.shape == (x.shape[0], n_out)
        self.lib.kvs_gguf_matmul(gguf_type(kind).kind, packed.data_ptr(), n_out, x.shape[1], x.data_ptr(), x.stride(0),
                                 y.data_ptr(), y.stride(0), x.shape[0], int(x.dtype == torch.bfloat16))
