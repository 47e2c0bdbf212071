"""What moves KV between tiers, and the records that own blocks while it moves.

The tier manager decides what moves where; a `BlockMover` does the copying (torch tensors in the
engine, token arrays in tests, nothing at all in the simulator), so the accounting never imports
torch. Copies between device and host are synchronous in the step loop (a memcpy on CPU, an
in-stream copy on CUDA, ordered before any kernel that overwrites the block). Store I/O runs on an
executor; a `LoadTransfer` owns its IN_FLIGHT device blocks until the load settles, whatever
happens to the request meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from kvstrata.core.hashing import BlockHash
from kvstrata.core.request import Request
from kvstrata.kvcache.block_pool import Block


class BlockMover(Protocol):
    """Physical KV of the device and host tiers. Tiers are named "device" and "host"."""

    def copy(self, src_tier: str, dst_tier: str, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy blocks (src id, dst id) from one tier's buffer to another's."""

    def encode(self, tier: str, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bytes:
        """A store record of one block."""

    def decode_into(self, tier: str, block_id: int, record: bytes, block_hash: BlockHash,
                    token_ids: Sequence[int]) -> None:
        """Check a store record against what is expected and write its KV into the block.

        Raises (with a `reason` attribute where it can) if the record fails any check.
        """


class Executor(Protocol):
    def submit(self, fn: Callable, /, *args) -> Future: ...


@dataclass
class LoadTransfer:
    """Store records on their way into device blocks. Owns `targets` (IN_FLIGHT) until settled.

    `request` is None once the request has let go (aborted, preempted, finished): the settled
    blocks then go to the cache (loaded) or back to the free list (failed) instead of to it.

    The first `num_group0` targets are blocks of the request's table (KV group 0's), in order; with KV groups
    the others are other groups' pages, never published to the listener, and the load is `whole`: all of it
    lands, or the request starts over (kvstrata.kvcache.loads).
    """

    request: Request | None
    targets: list[Block]
    hashes: list[BlockHash]
    token_ids: list[tuple[int, ...]]
    future: Future
    started: float
    deadline: float
    first_admission: bool            # the request's first admission: its hits count as cached prompt tokens
    num_group0: int
    whole: bool

    @property
    def orphaned(self) -> bool:
        return self.request is None
