"""What the engine thread publishes for every other thread: the only engine state they may read.

The engine thread owns the scheduler, the tiers, the pools and the tokenizer. Once per step (and
after taking commands) it builds an `EngineSnapshot`, a new immutable record, and swaps the
reference; the HTTP server's `/metrics` and the router's load figures read that reference and
nothing else (the server's admission limit counts its own calls in flight,
`AsyncLLMEngine.num_unfinished`). `EngineInfo` holds what never changes once the engine is built.
A reader may see a snapshot one step old, never a half-changed one.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

from kvstrata.core.hashing import BlockHash
from kvstrata.kvcache.block_pool import PoolCounts
from kvstrata.kvcache.store_io import CacheStats

T = TypeVar("T")


@dataclass(frozen=True)
class EngineInfo:
    """Facts fixed at build time (the model, its limits, the hash chain the router recomputes)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    hash_root: BlockHash
    runs: Mapping[str, str]     # what the model runs: its weight format, dtype and step path (/v1/models says it)
    runtime_lora_updating: bool = False    # whether clients may load and unload LoRA adapters (LoRAConfig)


# Step durations, in seconds: `kvstrata_step_duration_seconds` (a decode of the default model on 2 cores
# is 10-70 ms; a long prefill chunk or a stalled step seconds).
STEP_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)


@dataclass
class EngineStats:
    """Counters since start, for metrics and the CLI's figures (the engine thread's own; snapshots copy it)."""

    steps: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    audit_failures: int = 0
    step_failures: int = 0
    step_seconds: float = 0.0
    schedule_seconds: float = 0.0      # of step_seconds: scheduling and admission
    model_seconds: float = 0.0         # of step_seconds: the model and the sampler
    step_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))   # per bucket, +inf last
    # Speculative decoding (vLLM's spec_decode counters): steps with drafts, drafts, accepted drafts,
    # and accepted drafts by position in their step (index 0: the first draft)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def count_step(self, seconds: float) -> None:
        self.steps += 1
        self.step_seconds += seconds
        self.step_counts[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1

    def count_drafts(self, drafts: Mapping[str, int], accepted: Mapping[str, int]) -> None:
        """One step's verification: `drafts` proposed and `accepted` of them, by request."""
        per_pos = self.spec_decode_num_accepted_tokens_per_pos
        for request_id, num_drafts in drafts.items():
            num_accepted = accepted.get(request_id, 0)
            self.spec_decode_num_drafts += 1
            self.spec_decode_num_draft_tokens += num_drafts
            self.spec_decode_num_accepted_tokens += num_accepted
            per_pos.extend([0] * (num_drafts - len(per_pos)))
            for position in range(num_accepted):
                per_pos[position] += 1


@dataclass(frozen=True)
class RequestCounts:
    """Unfinished requests by state (a family's samples waiting to fork are not counted)."""

    running: int = 0
    loading: int = 0
    waiting: int = 0          # waiting or preempted


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine as of the end of one step. Every field is a copy: nothing here changes after publication."""

    requests: RequestCounts
    num_requests: int                       # unfinished requests, samples counted
    queued_prompt_tokens: int               # prompt tokens admitted or queued, not yet computed
    blocks: Mapping[str, PoolCounts]        # per tier: free, cached, used, in flight
    cache: CacheStats
    engine: EngineStats
    num_preemptions: int
    store_errors: Mapping[str, int] | None  # failed store calls as the store counts them; None without a store
    num_unpersisted: int                    # full blocks not yet written to the store (see TierManager.persist)
    kv_unmapped_bytes: int = 0              # KV buffer bytes an idle engine has yet to map (LLMEngine.map_kv_pages)

    @classmethod
    def empty(cls) -> EngineSnapshot:
        return cls(RequestCounts(), 0, 0, MappingProxyType({}), CacheStats(), EngineStats(), 0, None, 0)


def copied(stats: T) -> T:
    """A copy of a counters dataclass whose dict and list fields are copied too (the engine thread keeps
    counting)."""
    return dataclasses.replace(stats, **{f.name: type(getattr(stats, f.name))(getattr(stats, f.name))
                                        for f in dataclasses.fields(stats)
                                        if isinstance(getattr(stats, f.name), (dict, list))})
