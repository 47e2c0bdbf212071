"""Validation slices: which requests of a trace, cut how, replayed with which caches, at which time scale.

    plain     a real slice of the conversation trace (from request 500), prompts cut to 1,024
              tokens: requests share only the system prompt, device cache only
    sessions  whole chat sessions picked from the same trace (a turn's prompt extends an earlier
              turn's), each hash id shrunk to 32 tokens (`traces.shrink`) so a session fits the
              engine's context; small device cache, a host tier and a disk store, so prefixes come
              back from every tier
    speculative  10 requests of the conversation trace over two of its time stamps (from request
              505), prompts cut to 512 tokens, outputs of up to 128 tokens: decoding, where
              speculation acts, is most of the work

A slice is replayed at a *load*: `time_scale_for` stretches its arrivals so the offered work (the
profile's estimate of serving the requests one at a time, with what an unbounded cache would hold
cached) is that share of the time they span.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from kvstrata.calibration.engine_replay import BLOCK_SIZE, MAX_CHUNK
from kvstrata.core.hashing import BlockHasher
from kvstrata.sim.batch_shape import BatchShape
from kvstrata.sim.config import SimConfig
from kvstrata.sim.cost_model import CostModel
from kvstrata.sim.traces import TRACE_BLOCK, TraceRequest, TraceTokens, ideal_hits, read_mooncake, shrink

SESSION_HORIZON = 4000                                    # requests scanned for sessions after `skip`


@dataclass(frozen=True)
class Slice:
    """Requests of a trace, how they are cut, and the caches both sides run them with (tokens)."""

    name: str
    skip: int = 500
    requests: int = 40
    max_input_tokens: int = 1024
    max_output_tokens: int = 16
    sessions: bool = False             # whole chat sessions from `skip` on, one arrival a second, in trace order
    tokens_per_id: int = TRACE_BLOCK
    device_cache_tokens: int = 16384
    host_cache_tokens: int = 0
    store: bool = False                # a disk store (unbounded in the simulator)

    def load(self, path: str | Path) -> tuple[list[TraceRequest], list[int]]:
        """The slice's requests (arrivals from 0, unscaled) and their line numbers in the trace."""
        if not self.sessions:
            trace = read_mooncake(path, self.requests, self.skip, 1.0, self.max_input_tokens, self.max_output_tokens)
            return spread_ties(trace), list(range(self.skip, self.skip + len(trace)))
        scanned = read_mooncake(path, SESSION_HORIZON, self.skip)
        lines = session_lines([r.hash_ids for r in scanned], self.requests)
        picked = shrink([scanned[i] for i in lines], self.tokens_per_id)
        trace = [cap(r, float(rank), self.max_input_tokens, self.max_output_tokens, self.tokens_per_id)
                 for rank, r in enumerate(picked)]
        return trace, [self.skip + i for i in lines]

    def sim_config(self, max_num_seqs: int = 32, policy: str = "fcfs") -> SimConfig:
        return SimConfig(block_size=BLOCK_SIZE, device_cache_tokens=self.device_cache_tokens,
                         host_cache_tokens=self.host_cache_tokens, store_cache_tokens=None if self.store else 0,
                         max_num_seqs=max_num_seqs, max_num_batched_tokens=MAX_CHUNK, policy=policy,
                         tokens_per_id=self.tokens_per_id).validate()


SLICES = {
    "plain": Slice("plain"),
    "sessions": Slice("sessions", requests=80, sessions=True, tokens_per_id=32, device_cache_tokens=1536,
                      host_cache_tokens=1024, store=True),
    "speculative": Slice("speculative", skip=505, requests=10, max_input_tokens=512, max_output_tokens=128),
}


def spread_ties(trace: list[TraceRequest]) -> list[TraceRequest]:
    """Requests stamped with one time (the trace rounds its stamps to seconds) spread evenly until
    the next stamp, the last group over the mean gap; otherwise every load level meets the same bursts."""
    stamps = sorted({r.arrival for r in trace})
    if len(stamps) < 2:
        return trace
    gaps = dict(zip(stamps, [b - a for a, b in zip(stamps, stamps[1:])] + [(stamps[-1] - stamps[0]) / (len(stamps) - 1)]))
    ties: dict[float, int] = {}
    for r in trace:
        ties[r.arrival] = ties.get(r.arrival, 0) + 1
    seen: dict[float, int] = {}
    out = []
    for r in trace:
        index = seen.get(r.arrival, 0)
        seen[r.arrival] = index + 1
        out.append(replace(r, arrival=r.arrival + gaps[r.arrival] * index / ties[r.arrival]))
    return out


def cap(request: TraceRequest, arrival: float, max_input: int, max_output: int, tokens_per_id: int) -> TraceRequest:
    length = min(request.input_length, max_input)
    return TraceRequest(arrival, length, min(request.output_length, max_output),
                        request.hash_ids[:math.ceil(length / tokens_per_id)])


def session_lines(hash_ids: list[tuple[int, ...]], count: int, min_turns: int = 3) -> list[int]:
    """Indices of `count` requests that belong to chat sessions of at least `min_turns` turns.

    A request continues the session of the earlier request it shares the longest prefix of two or
    more ids with (one id alone is the system prompt every request shares); sessions are taken
    whole, in order of their first turn, and the requests returned in trace order.
    """
    owner: dict[tuple[int, ...], int] = {}
    session_of: list[int] = []
    for index, ids in enumerate(hash_ids):
        session = index
        for k in range(len(ids), 1, -1):
            if ids[:k] in owner:
                session = owner[ids[:k]]
                break
        session_of.append(session)
        for k in range(2, len(ids) + 1):
            owner.setdefault(ids[:k], session)
    members: dict[int, list[int]] = {}
    for index, session in enumerate(session_of):
        members.setdefault(session, []).append(index)
    picked: list[int] = []
    for session in sorted(members):
        if len(members[session]) >= min_turns and len(picked) < count:
            picked += members[session]
    if len(picked) < count:
        raise ValueError(f"only {len(picked)} requests in sessions of {min_turns}+ turns; ask for fewer")
    return sorted(picked)[:count]


def offered_work(trace: list[TraceRequest], cost: CostModel, tokens_per_id: int, chunk: int = MAX_CHUNK) -> float:
    """Seconds the profile charges for serving the slice one request at a time, with every prefix
    an unbounded cache would hold (`ideal_hits`) cached."""
    tokens = TraceTokens(BlockHasher.create(BLOCK_SIZE, "offered"), tokens_per_id)
    work, mix = 0.0, cost.mix
    for r, hits in zip(trace, ideal_hits(trace, tokens)):
        for start in range(hits * BLOCK_SIZE, r.input_length, chunk):
            work += cost.step_seconds(BatchShape.alone(start, min(chunk, r.input_length - start), BLOCK_SIZE,
                                                       cost.decode_in_place, mix))
        work += sum(cost.step_seconds(BatchShape.alone(r.input_length + i - 1, 1, BLOCK_SIZE, cost.decode_in_place,
                                                       mix)) for i in range(1, r.output_length))
    return work


def time_scale_for(trace: list[TraceRequest], cost: CostModel, load: float, tokens_per_id: int = TRACE_BLOCK) -> float:
    """Stretch arrivals so the offered work is `load` of their span."""
    span = max(r.arrival for r in trace) - min(r.arrival for r in trace)
    return max(1e-3, offered_work(trace, cost, tokens_per_id) / load / span) if span > 0 else 1.0
