"""`GuardedMover`: the `BlockMover` as the tier manager calls it, so that a failed move costs the
blocks involved their recomputation, never a block and never an exception in the step loop."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstrata.core.hashing import BlockHash
from kvstrata.kvcache.store_io import CacheStats
from kvstrata.kvcache.transfers import BlockMover

logger = logging.getLogger(__name__)


class GuardedMover:
    """Copies and encodes that never raise: a failure is counted in `CacheStats.faults`, logged, and
    answered False / None. `mover` itself is there for decodes, whose failures the caller sorts (a
    bad record is deleted from the store; any other failure is counted here with `fault`)."""

    def __init__(self, mover: BlockMover, stats: CacheStats):
        self.mover = mover
        self.stats = stats

    def copy(self, src_tier: str, dst_tier: str, pairs: list[tuple[int, int]]) -> bool:
        """Copy blocks between tiers; False (the fault counted) if the copy raised."""
        try:
            self.mover.copy(src_tier, dst_tier, pairs)
        except Exception as exc:
            self.fault("copy", exc)
            return False
        return True

    def encode(self, tier: str, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bytes | None:
        """A store record of one block; None (the fault counted) if the encode raised."""
        try:
            return self.mover.encode(tier, block_id, block_hash, token_ids)
        except Exception as exc:
            self.fault("encode", exc)
            return None

    def fault(self, operation: str, exc: Exception) -> None:
        self.stats.count(self.stats.faults, operation)
        logger.warning("%s failed; the blocks involved will be recomputed: %r", operation, exc)
