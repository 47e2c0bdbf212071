"""The physical KV tensors of one tier (device or host), and moving blocks in and out of them.

Layout: ONE tensor of shape (L, 2, KVH, N, bs, D), allocated once, for
L layers, K and V, KVH kv heads, N blocks of bs tokens, head dim D. With KV groups (a hybrid model's
sliding and global layers, kvstrata.kvcache.kv_groups) L is a group's layers and a block is a page of one
group: layer l reads plane `page_slot[l]` of the pages of its group's block table.

    data[layer]            (2, KVH, N, bs, D)   a view, no copy
    data[layer][0][h]      (N * bs, D)          every token slot of head h, flat: slot = block * bs + offset

Why this order:
* Gathering a batch's blocks for attention is one `index_select` over the N axis of
  data[layer] viewed as (2 * KVH, N, bs * D); the result (2, KVH, B, ctx, D) is already
  the (B, KVH, ctx, D) strided view attention wants (per (b, h) a contiguous (ctx, D) matrix),
  so K and V come out of one copy with no transpose copy after it.
* Layers live in one tensor so a whole block (all layers) moves to or from the host or the store
  with one indexed copy instead of L of them.

A block's bytes (for the store) are its (L, 2, KVH, bs, D) slab in the cache dtype, C order:
see `KVCacheSpec.block_shape`.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.kvcache.kv_groups import KVGroups


@dataclass(frozen=True)
class KVCacheSpec:
    """Everything that fixes a block's size and byte layout (also what a store record must match)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    groups: KVGroups | None = None      # None: one group of every layer, a block holds them all

    @classmethod
    def for_model(cls, arch, block_size: int, dtype: torch.dtype, groups: KVGroups | None = None) -> KVCacheSpec:
        """Spec for a `ModelArch` (kvstrata.model.arch), its layers grouped by `groups` (when there are several)."""
        return cls(arch.num_layers, arch.num_kv_heads, arch.head_dim, block_size, dtype,
                   groups if groups is not None and groups.num_groups > 1 else None)

    @property
    def page_layers(self) -> int:
        """Layers a block holds: a group's, or every layer."""
        return self.num_layers if self.groups is None else self.groups.layers_per_page

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block (a page of one group): (L, 2, KVH, bs, D)."""
        return (self.page_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        l, two, h, bs, d = self.block_shape
        return l * two * h * bs * d * torch.empty((), dtype=self.dtype).element_size()


class PagedKVCache:
    """K and V of `num_blocks` blocks for every layer; slots are addressed by flat index.

    Mutated only through `write` (the model, one layer at a time) and `write_blocks`
    (tier transfers). Callers may hold a `layer()` view for the duration of a forward.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu",
                 pin_memory: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, not {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        l, _, h, bs, d = spec.block_shape
        self.data = _zeros((l, 2, h, num_blocks, bs, d), spec.dtype, torch.device(device),
                           pin_memory)                     # (L, 2, KVH, N, bs, D)
        self.device = self.data.device
        # Each layer's plane of the pages, and its flat view, made once: (2, KVH, N * bs, D) for slot writes.
        self._plane = spec.groups.page_slot if spec.groups is not None else tuple(range(l))
        self._slots = [self.data[p].view(2, h, num_blocks * bs, d) for p in self._plane]
        # Bytes from the start not yet mapped by `map_pages` (lazily zeroed CPU memory only).
        self._unmapped = self.nbytes if self.data.device.type == "cpu" and not pin_memory else 0

    @classmethod
    def blocks_for_budget(cls, spec: KVCacheSpec, budget_bytes: int) -> int:
        """How many blocks fit in `budget_bytes` (0 when not even one does)."""
        return max(0, int(budget_bytes) // spec.bytes_per_block)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def unmapped_bytes(self) -> int:
        """Bytes at the end of the buffer `map_pages` has yet to map (0 for memory it cannot map)."""
        return self._unmapped

    def map_pages(self, max_bytes: int) -> bool:
        """Map up to `max_bytes` more of the buffer's lazily zeroed pages, contents untouched; False
        once all are mapped (or the OS cannot). Why: the first write to a fresh page costs a page
        fault (with transparent huge pages, ~2 MiB mapped per block written): seconds spread over the
        first requests a server answers (docs/design/tiers-and-stores.md). An idle engine maps them
        ahead (see LLMEngine.map_kv_pages); safe while steps write the cache, since
        MADV_POPULATE_WRITE only faults pages in."""
        if self._unmapped <= 0:
            return False
        done = self.nbytes - self._unmapped
        size = min(max_bytes, self._unmapped)
        if not _populate_write(self.data.data_ptr() + done, size):
            self._unmapped = 0
            return False
        self._unmapped -= size
        return True

    def layer(self, layer: int) -> torch.Tensor:
        """(2, KVH, N, bs, D) view of one layer's K and V."""
        return self.data[self._plane[layer]]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v of shape (T, KVH, D) at flat slots `slot_mapping` (T,)."""
        slots = self._slots[layer]                              # (2, KVH, N * bs, D)
        slots[0].index_copy_(1, slot_mapping, k.transpose(0, 1))   # (KVH, T, D)
        slots[1].index_copy_(1, slot_mapping, v.transpose(0, 1))

    def read_blocks(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Copy of blocks `block_ids`, all layers: (n, L, 2, KVH, bs, D), on this cache's device."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        l, two, h, bs, d = self.spec.block_shape
        picked = self.data.view(l * two * h, self.num_blocks, bs * d).index_select(1, ids)  # (L*2*KVH, n, bs*D)
        return picked.view(l, two, h, len(ids), bs, d).permute(3, 0, 1, 2, 4, 5).contiguous()

    def write_blocks(self, block_ids: Sequence[int] | torch.Tensor, data: torch.Tensor) -> None:
        """Overwrite blocks `block_ids` with `data` of shape (n, L, 2, KVH, bs, D) (any device)."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        l, two, h, bs, d = self.spec.block_shape
        assert data.shape == (len(ids), l, two, h, bs, d), f"block data of shape {tuple(data.shape)}"
        src = data.to(self.device, self.spec.dtype).permute(1, 2, 3, 0, 4, 5)   # (L, 2, KVH, n, bs, D)
        self.data.view(l * two * h, self.num_blocks, bs * d).index_copy_(
            1, ids, src.reshape(l * two * h, len(ids), bs * d))

    def read_block(self, block_id: int) -> bytes:
        """One block's bytes in the store layout: (L, 2, KVH, bs, D) of the cache dtype, C order."""
        block = self.read_blocks([block_id])[0].cpu()
        return block.view(torch.uint8).numpy().tobytes()

    def write_block(self, block_id: int, data: bytes | bytearray | memoryview | torch.Tensor) -> None:
        """Overwrite one block from `read_block` bytes or a (L, 2, KVH, bs, D) tensor."""
        if not isinstance(data, torch.Tensor):
            if len(data) != self.bytes_per_block:
                raise ValueError(f"block data has {len(data)} bytes, expected {self.bytes_per_block}")
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.spec.dtype)
        self.write_blocks([block_id], data.reshape(1, *self.spec.block_shape))


_MADV_POPULATE_WRITE = 23      # Linux 5.14+: fault pages in writable without changing them


def _populate_write(address: int, nbytes: int) -> bool:
    """madvise(MADV_POPULATE_WRITE) over [address, address + nbytes), widened to whole pages (the
    pages belong to the same mapping); False where the OS lacks it (not Linux, an older kernel)."""
    if not sys.platform.startswith("linux"):
        return False
    page = mmap.PAGESIZE
    start = address - address % page
    return _libc().madvise(start, address + nbytes - start, _MADV_POPULATE_WRITE) == 0


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin_memory: bool) -> torch.Tensor:
    """A zeroed tensor. On CPU (unpinned) its pages come from calloc, zero until first written, so
    a GiB of KV costs nothing at start (torch.zeros writes every page: 0.2-2 s per GiB here) and
    memory is taken as blocks are first used. Zero, not empty: attention reads whole blocks, and
    masked slots must hold finite values (0 * NaN is NaN)."""
    if device.type != "cpu" or pin_memory:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
