"""The router's view of one engine, built from its KV events (the wire format: kvstrata.core.kv_events).

`kvstrata router` keeps one `EventView` per engine and feeds it every reply of the engine's
`/v1/kv_events` long-poll: a snapshot replaces what it holds, events add and remove hashes. The
routing policies (kvstrata.router.policies) read it as they read the simulator's scheduler views.

Load is the larger of what the engine last reported and what this router has sent it and not yet
seen answered, so a burst routed between two reports is not all sent to the same engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.core.hashing import BlockHash
from kvstrata.core.kv_events import PUBLISHED_TIERS


@dataclass
class EventView:
    url: str
    available: bool = False                     # out until its first health check and snapshot
    out_since: float = 0.0                      # monotonic time it was last taken out
    instance: str | None = None
    seq: int = 0
    block_size: int | None = None
    hash_root: BlockHash | None = None
    adapter_roots: dict[str, BlockHash] = field(default_factory=dict)   # LoRA adapter name -> its requests' root
    held: dict[str, set[BlockHash]] = field(default_factory=lambda: {tier: set() for tier in PUBLISHED_TIERS})
    reported_requests: int = 0
    reported_queued_tokens: int = 0
    sent_requests: int = 0                      # routed here by this router, not yet answered
    sent_tokens: int = 0                        # their prompt tokens predicted to miss the cache

    def num_requests(self) -> int:
        return max(self.reported_requests, self.sent_requests)

    def queued_prompt_tokens(self) -> int:
        return max(self.reported_queued_tokens, self.sent_tokens)

    def holds(self, tier: str, block_hash: BlockHash) -> bool:
        held = self.held.get(tier)
        return held is not None and block_hash in held

    @property
    def num_held(self) -> int:
        return sum(len(held) for held in self.held.values())

    def apply(self, reply: dict) -> None:
        """Take one `/v1/kv_events` reply: a snapshot (replacing everything) or events after `seq`."""
        snapshot = reply.get("snapshot")
        if snapshot is not None:
            self.held = {tier: {bytes.fromhex(h) for h in snapshot.get(tier, ())} for tier in PUBLISHED_TIERS}
        else:
            assert reply["instance"] == self.instance, "events from another engine instance need a snapshot first"
            for _, tier, stored, hex_hash in reply["events"]:
                held = self.held.setdefault(tier, set())
                if stored:
                    held.add(bytes.fromhex(hex_hash))
                else:
                    held.discard(bytes.fromhex(hex_hash))
        self.instance, self.seq = reply["instance"], reply["seq"]
        self.block_size, self.hash_root = reply["block_size"], bytes.fromhex(reply["hash_root"])
        self.adapter_roots = {name: bytes.fromhex(root) for name, root in reply.get("adapter_roots", {}).items()}
        self.reported_requests = reply["load"]["num_requests"]
        self.reported_queued_tokens = reply["load"]["queued_prompt_tokens"]

    def query(self) -> dict[str, str | int]:
        """The parameters of the next long-poll."""
        params: dict[str, str | int] = {"since": self.seq}
        if self.instance is not None:
            params["instance"] = self.instance
        return params
