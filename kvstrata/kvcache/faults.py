"""Fault injection: make chosen calls at the tier and step boundaries raise, to prove nothing leaks.

The no-leak promise is only as good as the paths that were made to fail. A `FaultInjector` decides,
per call site, whether this call raises `InjectedFault`: every Nth call, or chosen calls a test arms
(the next k, after skipping m). Sites:

    copy      a KV copy between the device and host tiers     (BlockMover.copy)
    encode    building a store record from a block            (BlockMover.encode)
    decode    writing a store record into a block             (BlockMover.decode_into)
    execute   a whole model step                              (the engine's runner call)

`kvstrata serve` reads `KVSTRATA_FAULTS` (e.g. `copy=7,execute=50`: every 7th copy and every 50th
model step raise) for soak tests of a real server; without it nothing is wrapped and nothing is paid.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvstrata.core.hashing import BlockHash
from kvstrata.kvcache.transfers import BlockMover

SITES = ("copy", "encode", "decode", "execute")
ENV_VAR = "KVSTRATA_FAULTS"


class InjectedFault(RuntimeError):
    def __init__(self, site: str, call: int):
        super().__init__(f"injected {site} fault (call {call})")
        self.site = site


@dataclass
class FaultInjector:
    """Which calls raise: every `every[site]`th call of a site, and the calls numbered in `fail_at`."""

    every: dict[str, int] = field(default_factory=dict)
    fail_at: dict[str, set[int]] = field(default_factory=dict)
    calls: Counter = field(default_factory=Counter)
    raised: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        unknown = set(self.every) - set(SITES)
        if unknown:
            raise ValueError(f"unknown fault sites {sorted(unknown)}; known: {', '.join(SITES)}")
        if any(n < 1 for n in self.every.values()):
            raise ValueError("a fault period must be a positive integer")

    @classmethod
    def parse(cls, spec: str) -> FaultInjector:
        """`site=N[,site=N...]`: every Nth call of each named site raises."""
        every = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            site, _, period = part.partition("=")
            if not period.isdigit():
                raise ValueError(f"bad fault spec {part!r}: expected site=N, e.g. copy=7")
            every[site.strip()] = int(period)
        return cls(every)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultInjector | None:
        spec = environ.get(ENV_VAR, "")
        return cls.parse(spec) if spec.strip() else None

    def arm(self, site: str, times: int = 1, after: int = 0) -> None:
        """Make `times` calls of `site` raise, once `after` more calls have gone through."""
        assert site in SITES, f"unknown fault site {site}"
        first = self.calls[site] + after + 1
        self.fail_at.setdefault(site, set()).update(range(first, first + times))

    def check(self, site: str) -> None:
        """Count a call of `site`; raise InjectedFault if this one is to fail."""
        self.calls[site] += 1
        call, period = self.calls[site], self.every.get(site)
        chosen = self.fail_at.get(site, set())
        if call in chosen or (period and call % period == 0):
            chosen.discard(call)
            self.raised[site] += 1
            raise InjectedFault(site, call)


class FaultyMover:
    """A BlockMover whose calls fail when the injector says so (before touching anything)."""

    def __init__(self, mover: BlockMover, faults: FaultInjector):
        self.mover, self.faults = mover, faults

    def copy(self, src_tier: str, dst_tier: str, pairs: Sequence[tuple[int, int]]) -> None:
        self.faults.check("copy")
        self.mover.copy(src_tier, dst_tier, pairs)

    def encode(self, tier: str, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bytes:
        self.faults.check("encode")
        return self.mover.encode(tier, block_id, block_hash, token_ids)

    def decode_into(self, tier: str, block_id: int, record: bytes, block_hash: BlockHash,
                    token_ids: Sequence[int]) -> None:
        self.faults.check("decode")
        self.mover.decode_into(tier, block_id, record, block_hash, token_ids)
