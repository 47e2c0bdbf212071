"""The KV-event wire format an engine publishes (`GET /v1/kv_events`) and a router reads.

    {"instance": "<engine process id>", "block_size": 16, "hash_root": "<hex>", "seq": 42,
     "snapshot": {"device": ["<hex>", ...], "host": [...]} | null,
     "events": [[seq, "device" | "host", 1 (stored) | 0 (removed), "<hex>"], ...],
     "load": {"num_requests": 3, "queued_prompt_tokens": 512}}

Hashes are the chained block hashes of kvstrata.core.hashing, so a router computes the same
hashes from the tokens. The store tier is shared by the fleet and is not published.
"""

from __future__ import annotations

PUBLISHED_TIERS = ("device", "host")
