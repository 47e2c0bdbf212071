"""What a simulation run yields: each request's record and the fleet's figures (`SimResult.to_json` is what
`kvstrata simulate --output-json` writes), and how a set of records is summarized."""

from __future__ import annotations

import math
from array import array
from dataclasses import asdict, dataclass, field

import numpy as np

from kvstrata.sim.config import SimConfig

TIERS = ("device", "host", "store")


@dataclass(slots=True)
class RequestRecord:
    arrival: float
    prompt_tokens: int
    output_tokens: int
    engine: int = -1
    first_token: float = math.nan
    finish: float = math.nan
    cached_tokens: int = 0
    preemptions: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first (nan for one-token outputs)."""
        if self.output_tokens < 2:
            return math.nan
        return (self.finish - self.first_token) / (self.output_tokens - 1)


@dataclass
class SimResult:
    config: SimConfig
    profile: str
    records: list[RequestRecord]
    prompt_blocks: int
    ideal_hit_rate: float
    engines: list[dict]                        # per-engine counters
    store_evictions: int
    wall_s: float
    audited_steps: int = 0
    blocks_at_end: dict[str, int] = field(default_factory=dict)
    speculation: dict | None = None            # drafts and acceptance (SimulatedDrafts.report), when on
    itl: array = field(default_factory=lambda: array("d"))   # seconds between a request's sampling steps
    prompt_engines: int | None = None          # engines that see each prompt first (a disaggregated fleet's
                                               # prefill engines: its decode engines' hits are the handoff)

    def to_json(self) -> dict:
        """The figures `kvstrata simulate --output-json` writes (hit rates are shares of prompt blocks)."""
        size = self.config.block_size
        hits = {tier: sum(e["hit_tokens"][tier] for e in self.engines[:self.prompt_engines]) // size for tier in TIERS}
        evictions = {tier: sum(e["evicted_blocks"][tier] for e in self.engines) for tier in ("device", "host")}
        out = summarize(self.records, hits, self.prompt_blocks)
        out.update(itl_s=_percentiles(np.frombuffer(self.itl, dtype=np.float64)), ideal_hit_rate=self.ideal_hit_rate,
                   preemptions=sum(e["preemptions"] for e in self.engines),
                   evictions={**evictions, "store": self.store_evictions},
                   steps=sum(e["steps"] for e in self.engines),
                   step_cpu_s=sum(e["step_cpu_s"] for e in self.engines),
                   transfers={key: _add(e[key] for e in self.engines)
                              for key in ("loaded_blocks", "offloaded_blocks", "load_failures", "store_errors")},
                   wall_s=round(self.wall_s, 3), profile=self.profile, config=asdict(self.config))
        if self.config.instances > 1:
            out["per_engine"] = []
            for e in self.engines:
                mine = [r for r in self.records if r.engine == e["index"]]
                blocks = sum(math.ceil(r.prompt_tokens / size) for r in mine)
                engine_hits = {tier: e["hit_tokens"][tier] // size for tier in TIERS}
                out["per_engine"].append({**summarize(mine, engine_hits, blocks),
                                          "preemptions": e["preemptions"], "steps": e["steps"],
                                          "step_cpu_s": e["step_cpu_s"]})
        if self.config.audit:
            out["audit"] = {"steps_audited": self.audited_steps, **self.blocks_at_end}
        if self.speculation is not None:
            out["speculation"] = self.speculation
        return out


def summarize(records: list[RequestRecord], hit_blocks: dict[str, int], prompt_blocks: int) -> dict:
    ttft = np.array([r.ttft for r in records])
    tpot = np.array([r.tpot for r in records])
    tpot = tpot[~np.isnan(tpot)]
    start = min((r.arrival for r in records), default=0.0)
    end = max((r.finish for r in records), default=0.0)
    output_tokens = sum(r.output_tokens for r in records)
    rates = {tier: hit_blocks[tier] / prompt_blocks if prompt_blocks else 0.0 for tier in TIERS}
    rates["total"] = sum(hit_blocks.values()) / prompt_blocks if prompt_blocks else 0.0
    return {"requests": len(records), "hit_rate": rates, "ttft_s": _percentiles(ttft), "tpot_s": _percentiles(tpot),
            "throughput_tok_s": output_tokens / (end - start) if end > start else 0.0,
            "simulated_s": end - start, "output_tokens": output_tokens}


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(values.mean())}


def _add(tables) -> dict[str, int]:
    total: dict[str, int] = {}
    for table in tables:
        for key, value in table.items():
            total[key] = total.get(key, 0) + value
    return dict(sorted(total.items()))
