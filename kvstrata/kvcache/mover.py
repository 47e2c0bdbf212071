"""`TierBuffers`: the physical KV of the device and host tiers, and blocks <-> store records.

The `BlockMover` the tier manager drives in the engine. Copies between tiers are one indexed copy
per batch of blocks over all layers; records are built and checked by `kvstrata.kvcache.stores.records`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstrata.core.hashing import BlockHash
from kvstrata.kvcache.buffers import PagedKVCache
from kvstrata.kvcache.stores.records import RecordError, decode_record, encode_record


class TierBuffers:
    def __init__(self, device: PagedKVCache, host: PagedKVCache | None, model_fingerprint: str):
        assert host is None or host.spec == device.spec, "host and device KV must share one layout"
        self.caches = {"device": device} | ({"host": host} if host is not None else {})
        self.spec = device.spec
        self.fingerprint = model_fingerprint

    def copy(self, src_tier: str, dst_tier: str, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        src, dst = self.caches[src_tier], self.caches[dst_tier]
        src_ids = torch.tensor([s for s, _ in pairs], device=src.device)
        dst_ids = torch.tensor([d for _, d in pairs], device=dst.device)
        picked = _blocks_view(src).index_select(1, src_ids)              # (L*2*KVH, n, bs*D)
        moved = picked.to(dst.device, non_blocking=True)
        if needs_sync_before_cpu_read(picked.device, moved.device):
            _wait_for_stream(picked.device)
        _blocks_view(dst).index_copy_(1, dst_ids, moved)

    def encode(self, tier: str, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bytes:
        return encode_record(self.spec, self.fingerprint, block_hash, token_ids,
                             self.caches[tier].read_block(block_id))

    def decode_into(self, tier: str, block_id: int, record: bytes, block_hash: BlockHash,
                    token_ids: Sequence[int]) -> None:
        stored_tokens, payload = decode_record(record, self.spec, self.fingerprint, block_hash)
        if stored_tokens != list(token_ids):
            raise RecordError("tokens", "the record holds other tokens under this hash")
        self.caches[tier].write_block(block_id, payload)


def needs_sync_before_cpu_read(src: torch.device, dst: torch.device) -> bool:
    """A non-blocking copy from an accelerator into CPU memory may still be running when it returns:
    the CPU must not read the staging tensor until the copy's stream has passed it."""
    return src.type != "cpu" and dst.type == "cpu"


def _wait_for_stream(device: torch.device) -> None:
    """Wait for the work queued so far on `device`'s current stream (an event: not a device-wide sync)."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    done.synchronize()


def _blocks_view(cache: PagedKVCache) -> torch.Tensor:
    """(L*2*KVH, N, bs*D): every block's slab in one dimension, for one gather or scatter."""
    l, two, h, bs, d = cache.spec.block_shape
    return cache.data.view(l * two * h, cache.num_blocks, bs * d)


def host_cache(device: PagedKVCache, num_blocks: int) -> PagedKVCache | None:
    """The host tier's buffer: CPU memory, pinned when the device is a GPU (for async copies)."""
    if num_blocks <= 0:
        return None
    return PagedKVCache(device.spec, num_blocks, "cpu", pin_memory=device.device.type == "cuda"
                        and torch.cuda.is_available())
