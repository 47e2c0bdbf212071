"""What a simulation runs: the fleet's shape (engines, router, tiers and their capacities in tokens), the
scheduler's settings, speculation, and the host's cores (kvstrata.sim.simulator replays a trace through it)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.core.config import POLICIES, WRITE_POLICIES, SpeculativeConfig
from kvstrata.sim.routing import ROUTERS
from kvstrata.sim.speculation import DEFAULT_ALPHA, Acceptance
from kvstrata.sim.traces import TRACE_BLOCK, check_tokens_per_id


@dataclass(frozen=True)
class SimConfig:
    """What is simulated. Capacities are per engine, in tokens; None is unbounded, 0 is no tier."""

    block_size: int = 512
    device_cache_tokens: int | None = None
    host_cache_tokens: int | None = 0
    store_cache_tokens: int | None = 0            # one store, shared by the fleet
    instances: int = 1
    router: str = "round_robin"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 8192
    policy: str = "fcfs"
    max_tpot_ms: float = 0.0                      # the engine's step-time target for prefill beside decodes
                                                  # (its default is 150; 0: no cut, as --validate runs it)
    write_policy: str = "write_back"
    store_timeout: float = 2.0
    audit: bool = False
    tokens_per_id: int = TRACE_BLOCK              # tokens per trace hash id (fewer: a shrunk trace, traces.shrink)
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off)
    acceptance: Acceptance | None = None          # its drafts' acceptance (None: geometric, DEFAULT_ALPHA)
    local_prefill_tokens: int = 0                 # P/D splits: prompts a decode engine lacks at most this many
                                                  # tokens of are prefilled there (the router's flag)
    host_cores: float | None = None               # cores the whole fleet shares (None: each engine has its own)
    serving_overhead: float = 0.0                 # with host_cores: CPU seconds the fleet spends around a second
                                                  # of steps (HTTP, streaming, the router, the store's server)
    swa_full: bool = False                        # a hybrid model's sliding layers at full length (the engine's
                                                  # --swa-full), not in KV groups keeping their windows

    def validate(self) -> SimConfig:
        size = self.block_size
        if size < 1 or size & (size - 1) or TRACE_BLOCK % size:
            raise ValueError(f"block_size must be a power of two dividing {TRACE_BLOCK}, not {size}")
        check_tokens_per_id(self.tokens_per_id, size)
        if self.device_cache_tokens is not None and self.device_cache_tokens < size:
            raise ValueError(f"the device cache must hold at least one block of {size} tokens")
        for name in ("host_cache_tokens", "store_cache_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must not be negative")
        if self.instances < 1:
            raise ValueError("instances must be at least 1")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {self.router!r}")
        if self.policy not in POLICIES or self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, write_policy one of {WRITE_POLICIES}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if self.max_tpot_ms < 0:
            raise ValueError(f"max_tpot_ms must be 0 (off) or positive, not {self.max_tpot_ms}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be 0 (hand every prompt over) or positive, "
                             f"not {self.local_prefill_tokens}")
        if self.host_cores is not None and self.host_cores <= 0:
            raise ValueError(f"host_cores must be positive (or None: a core per engine), not {self.host_cores}")
        if self.serving_overhead < 0:
            raise ValueError(f"serving_overhead must not be negative, not {self.serving_overhead}")
        if self.acceptance is not None and self.speculative is None:
            raise ValueError("an acceptance without a speculative config simulates nothing: pass one")
        return self

    @property
    def draft_acceptance(self) -> Acceptance:
        return self.acceptance or Acceptance.geometric(DEFAULT_ALPHA)
