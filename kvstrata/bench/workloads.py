"""Seeded request sequences for the serving benchmark, as token ids.

A workload is a tuple of sessions; a session is one or more turns sent one after another (the
multi-turn workload resends the growing history, `turn_gap` seconds after the previous reply).
Prompts are token ids, not text, so every server sees exactly the same tokens whatever its
tokenizer would make of a string. Ids are drawn from [TOKEN_LOW, TOKEN_HIGH): valid in any
vocabulary of 32k+ and clear of the special tokens at the low end.

The same (kind, parameters, seed) always gives the same sequence, on any machine (numpy's PCG64).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvstrata.core.hashing import BlockHasher
from kvstrata.sim.traces import TRACE_BLOCK, TraceTokens, read_mooncake

TOKEN_LOW, TOKEN_HIGH = 1000, 30000


@dataclass(frozen=True)
class Turn:
    prompt: tuple[int, ...]      # every token sent (for a later turn: the whole history)
    max_tokens: int


@dataclass(frozen=True)
class Session:
    turns: tuple[Turn, ...]
    arrival: float | None = None     # seconds from the start (traces); None: drawn from the arrival process


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    turn_gap: float = 0.0            # seconds between a reply and the next turn of the same session
    params: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class WorkloadOptions:
    """Every knob of every workload; each kind reads the ones it needs. The CLI makes one flag per field."""

    num_requests: int = _opt(64, "requests in all (multi-turn: conversations x turns)")
    input_len: int = _opt(128, "prompt tokens (shared-prefix: question after the prefix; multi-turn: per user turn)")
    output_len: int = _opt(128, "output tokens per request (trace: a cap)")
    range_ratio: float = _opt(0.0, "random: lengths uniform in [len*(1-r), len*(1+r)]")
    num_prefixes: int = _opt(4, "shared-prefix: number of distinct system prompts")
    prefix_len: int = _opt(512, "shared-prefix: tokens per system prompt")
    turns: int = _opt(4, "multi-turn: turns per conversation")
    turn_gap: float = _opt(1.0, "multi-turn: seconds between a reply and the next turn")
    trace_skip: int = _opt(0, "trace: requests skipped at the start")
    trace_time_scale: float = _opt(1.0, "trace: arrival times multiplied by this (2: half the rate)")
    trace_length_scale: float = _opt(1.0, "trace: tokens per hash id = 512 x this (prefix sharing stays exact)")
    max_input_len: int | None = _opt(None, "trace: prompt cap after scaling (leading blocks kept)")


def _ids(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(TOKEN_LOW, TOKEN_HIGH, n))


def _length(rng: np.random.Generator, mean: int, ratio: float) -> int:
    low, high = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return int(rng.integers(low, high + 1))


def random_workload(opts: WorkloadOptions, seed: int) -> Workload:
    """Independent prompts: nothing to share, so prefix caching can only cost."""
    rng = np.random.default_rng([seed, 1])
    sessions = tuple(Session((Turn(_ids(rng, _length(rng, opts.input_len, opts.range_ratio)),
                                   _length(rng, opts.output_len, opts.range_ratio)),))
                     for _ in range(opts.num_requests))
    return Workload("random", sessions, params={"input_len": opts.input_len, "output_len": opts.output_len,
                                                "range_ratio": opts.range_ratio})


def shared_prefix_workload(opts: WorkloadOptions, seed: int) -> Workload:
    """K system prompts of L tokens, each followed by many distinct questions, in shuffled order."""
    if opts.num_prefixes < 1:
        raise ValueError("num_prefixes must be at least 1")
    rng = np.random.default_rng([seed, 2])
    prefixes = [_ids(rng, opts.prefix_len) for _ in range(opts.num_prefixes)]
    owners = rng.permutation(np.arange(opts.num_requests) % opts.num_prefixes)
    sessions = tuple(Session((Turn(prefixes[k] + _ids(rng, opts.input_len), opts.output_len),)) for k in owners)
    return Workload("shared-prefix", sessions, params={
        "num_prefixes": opts.num_prefixes, "prefix_len": opts.prefix_len, "question_len": opts.input_len,
        "output_len": opts.output_len})


def multi_turn_workload(opts: WorkloadOptions, seed: int) -> Workload:
    """Conversations of `turns` user messages; each turn resends the history.

    The assistant's part of the history is synthetic (`output_len` seeded tokens), not what the server
    replied, so every server sees the same sequence; as in vLLM's multi-turn benchmark, the reusable
    prefix of turn k+1 is the prompt of turn k plus nothing of the reply it generated.
    """
    if opts.turns < 1:
        raise ValueError("turns must be at least 1")
    rng = np.random.default_rng([seed, 3])
    sessions = []
    for _ in range(max(1, opts.num_requests // opts.turns)):
        history: tuple[int, ...] = ()
        turns = []
        for _ in range(opts.turns):
            history += _ids(rng, opts.input_len)
            turns.append(Turn(history, opts.output_len))
            history += _ids(rng, opts.output_len)
        sessions.append(Session(tuple(turns)))
    return Workload("multi-turn", tuple(sessions), turn_gap=opts.turn_gap, params={
        "turns": opts.turns, "user_len": opts.input_len, "output_len": opts.output_len, "turn_gap_s": opts.turn_gap})


def trace_workload(path: str, opts: WorkloadOptions) -> Workload:
    """A slice of a Mooncake trace replayed at its own (scaled) times.

    Each hash id becomes `512 * trace_length_scale` tokens drawn from the id alone (`kvstrata.sim.traces`),
    so equal ids give equal tokens and the trace's prefix sharing is reproduced exactly at any scale.
    Output lengths are capped at `output_len`.
    """
    if not 0 < opts.trace_length_scale <= 1:
        raise ValueError("trace_length_scale must be in (0, 1]")
    block = max(1, round(TRACE_BLOCK * opts.trace_length_scale))
    tokens = TraceTokens(BlockHasher.create(TRACE_BLOCK, "bench"))
    sessions = []
    for request in read_mooncake(path, opts.num_requests, opts.trace_skip, opts.trace_time_scale,
                                 max_output_tokens=opts.output_len):
        length = max(1, math.ceil(request.input_length * block / TRACE_BLOCK))
        if opts.max_input_len is not None:
            length = min(length, opts.max_input_len)
        drawn = tokens.block_tokens(request.hash_ids[:math.ceil(length / block)])[:, :block]
        prompt = tuple(int(t) + TOKEN_LOW for t in drawn.reshape(-1)[:length])
        sessions.append(Session((Turn(prompt, request.output_length),), arrival=request.arrival))
    return Workload(f"trace:{path}", tuple(sessions), params={
        "trace_skip": opts.trace_skip, "time_scale": opts.trace_time_scale,
        "length_scale": opts.trace_length_scale, "tokens_per_hash_id": block,
        "max_output_len": opts.output_len, "max_input_len": opts.max_input_len})


WORKLOADS: dict[str, Callable[[WorkloadOptions, int], Workload]] = {
    "random": random_workload,
    "shared-prefix": shared_prefix_workload,
    "multi-turn": multi_turn_workload,
}


def build_workload(spec: str, opts: WorkloadOptions, seed: int) -> Workload:
    """`random`, `shared-prefix`, `multi-turn` or `trace:PATH` (a trace's order is its own; seed unused)."""
    if spec.startswith("trace:"):
        return trace_workload(spec.removeprefix("trace:"), opts)
    if spec not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)} or trace:PATH, not {spec!r}")
    return WORKLOADS[spec](opts, seed)
