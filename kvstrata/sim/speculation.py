"""Speculative decoding in the simulator: how many drafts a workload accepts, drawn per step.

The simulator has no model to verify drafts with, so a workload's acceptance is an input, in the
form the engine measures it (`kvstrata:spec_decode_num_accepted_tokens_per_pos` over
`kvstrata:spec_decode_num_drafts`):

    a_i = P(at least i + 1 drafts accepted | a step with drafts),   a_0 >= a_1 >= ... (a prefix is accepted)

The default is geometric, a_i = alpha^(i + 1) (each draft accepted with probability alpha once the
one before was). Two more measured shares say how many rows a step verifies: `draft_rate`, of a
speculating request's decodes with room for drafts, those that find one (an n-gram lookup can
miss; a miss decodes one token, as in the engine), and `draft_lengths`, s_i = P(a draft has at
least i + 1 tokens) (a lookup drafts what followed its match, which can be fewer than K tokens;
none given: always K). A step draws its draft's length L from s, then one uniform u, and accepts
the positions i < L with g_i > u, where g_i = a_i / s_i (kept non-increasing): then
P(accepted >= i + 1) = s_i g_i = a_i, the measured acceptance, and rejected rows cost what the
engine's shorter drafts cost.

Everything else is the engine's own code: `SimulatedDrafts` stands in for the scheduler's
`DraftProposer`, so draft slots go through the real `grow(request, 1, K)` and `settle_drafts`,
the real budget, room and `disable_by_batch_size` checks, and the real `judge` that pauses a
request whose drafts are accepted too rarely (by DEFAULT_BREAK_EVEN: no step is timed here). A speculative step's chunk of 1 + K tokens costs
what the cost model charges for it (`BatchShape.of` counts it as a chunk continuing its sequence,
its draft rows as prefill rows, as the runner computes it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from kvstrata.core.config import MAX_SPECULATIVE_TOKENS
from kvstrata.core.request import Request

DEFAULT_ALPHA = 0.6        # a middling per-draft acceptance; measure the workload's own (--spec-acceptance)


@dataclass(frozen=True)
class Acceptance:
    """A workload's accepted-length distribution: `per_position[i]` = P(at least i + 1 accepted)."""

    per_position: tuple[float, ...]
    draft_rate: float = 1.0              # share of decodes that find a draft
    draft_lengths: tuple[float, ...] = ()   # P(a draft has at least i + 1 tokens); () always full

    def __post_init__(self) -> None:
        values = self.per_position
        if not values or len(values) > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"acceptance needs 1 to {MAX_SPECULATIVE_TOKENS} positions, not {len(values)}")
        if any(not 0.0 <= a <= 1.0 for a in values) or any(b > a for a, b in itertools.pairwise(values)):
            raise ValueError("acceptance per position must lie in [0, 1] and never rise (an accepted draft "
                             f"follows accepted ones): {list(values)}")
        if not 0.0 <= self.draft_rate <= 1.0:
            raise ValueError(f"the draft rate must lie in [0, 1], not {self.draft_rate}")
        lengths = self.draft_lengths
        if lengths and (lengths[0] != 1.0 or any(not 0.0 <= s <= 1.0 for s in lengths)
                        or any(b > a for a, b in itertools.pairwise(lengths))):
            raise ValueError(f"draft lengths are P(at least i + 1 tokens) per position: 1 first, never rising, "
                             f"not {list(lengths)}")
        if lengths and any(a > s + 1e-9 for a, s in zip(values, (*lengths, *[0.0] * len(values)))):
            raise ValueError("a position cannot be accepted more often than drafts reach it: "
                             f"acceptance {list(values)}, draft lengths {list(lengths)}")

    @classmethod
    def geometric(cls, alpha: float, draft_rate: float = 1.0, draft_lengths: tuple[float, ...] = ()) -> Acceptance:
        """Each draft token accepted with probability `alpha` once the one before was (and if the
        draft reaches it)."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"a per-draft acceptance must lie in [0, 1], not {alpha}")
        reach = [*draft_lengths, *[0.0 if draft_lengths else 1.0] * MAX_SPECULATIVE_TOKENS]
        return cls(tuple(float(alpha ** (i + 1) * reach[i]) for i in range(MAX_SPECULATIVE_TOKENS)), draft_rate,
                   tuple(draft_lengths))

    @classmethod
    def parse(cls, text: str, draft_rate: float = 1.0, draft_lengths: str | None = None) -> Acceptance:
        """'0.7': geometric; '0.9,0.7,0.5,0.3': P(at least i + 1 accepted) per position; draft
        lengths '1,0.8,0.5': P(at least i + 1 drafted)."""
        values, lengths = _numbers(text, "acceptance"), tuple(_numbers(draft_lengths, "draft lengths"))
        if len(values) == 1:
            return cls.geometric(values[0], draft_rate, lengths)
        return cls(tuple(values), draft_rate, lengths)

    @classmethod
    def measured(cls, num_drafts: int, accepted_per_pos: list[int], draft_rate: float = 1.0,
                 drafted_per_pos: list[int] | None = None) -> Acceptance:
        """From the engine's counters: steps with drafts, accepted drafts by position, and (if
        counted) steps whose draft reached each position."""
        if num_drafts < 1:
            raise ValueError("no step had drafts: there is no acceptance to measure")
        lengths = tuple(n / num_drafts for n in drafted_per_pos) if drafted_per_pos else ()
        return cls(tuple(n / num_drafts for n in accepted_per_pos) or (0.0,), draft_rate, lengths)

    def draft_length(self, u: float, k: int) -> int:
        """Tokens of a draft of at most k, for a uniform draw `u` in [0, 1)."""
        lengths = self.draft_lengths
        if not lengths:
            return k
        return sum(1 for s in lengths[:k] if s > u)

    def accepted(self, u: float, num_drafts: int) -> int:
        """Drafts accepted of a draft of `num_drafts` tokens, for a uniform draw `u` in [0, 1)."""
        values, lengths = self.per_position, self.draft_lengths
        count = 0
        while count < min(num_drafts, len(values)):
            reach = lengths[count] if count < len(lengths) else (0.0 if lengths else 1.0)
            if not reach or values[count] <= u * reach:          # g_i = a_i / s_i against u
                break
            count += 1
        return count

    def mean_accepted(self, k: int) -> float:
        """Expected accepted drafts of a step with k drafts: sum of P(at least i + 1)."""
        return float(sum(self.per_position[:k]))


def _numbers(text: str | None, name: str) -> list[float]:
    if text is None:
        return []
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{name}: a number or numbers per position, e.g. '0.7' or '0.9,0.7,0.5,0.3', "
                         f"not {text!r}") from None


class SimulatedDrafts:
    """Stands in for the scheduler's `DraftProposer` (its `propose`), and verifies the drafts.

    Drafts are placeholder tokens: `propose` returns `k` of them (or none, 1 - draft_rate of the
    time); `verify` draws how many the model accepted. One seeded generator draws both in event
    order, so a replay is deterministic. Counts what it drew, for the report.
    """

    def __init__(self, acceptance: Acceptance, token: int, seed: int = 0):
        self.acceptance = acceptance
        self.token = token
        self._rng = np.random.default_rng(seed)
        self.num_drafts = 0                  # steps with drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * MAX_SPECULATIVE_TOKENS

    def propose(self, request: Request, k: int) -> list[int]:
        acceptance = self.acceptance
        if acceptance.draft_rate < 1.0 and self._rng.random() >= acceptance.draft_rate:
            return []
        if acceptance.draft_lengths:
            k = acceptance.draft_length(float(self._rng.random()), k)
        return [self.token] * k

    def verify(self, num_drafts: int) -> int:
        """How many of a step's `num_drafts` drafts were accepted."""
        accepted = self.acceptance.accepted(float(self._rng.random()), num_drafts)
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_pos[position] += 1
        return accepted

    def report(self) -> dict:
        """vLLM's spec_decode figures: drafts, draft tokens, accepted tokens, acceptance rate, mean
        accepted length (accepted drafts plus the token every step samples), per position."""
        steps = self.num_drafts
        used = max((i + 1 for i, n in enumerate(self.accepted_per_pos) if n), default=0)
        return {"num_drafts": steps, "num_draft_tokens": self.num_draft_tokens,
                "mean_draft_length": self.num_draft_tokens / steps if steps else 0.0,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
                "mean_accepted_length": 1 + self.num_accepted_tokens / steps if steps else 1.0,
                "accepted_per_pos": self.accepted_per_pos[:used]}


def speedup(plain: dict, speculative: dict) -> dict[str, float]:
    """What speculation buys, from two `summarize` reports of one trace: throughput with over
    without, and TPOT without over with (above 1: faster)."""
    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    return {"throughput": ratio(speculative["throughput_tok_s"], plain["throughput_tok_s"]),
            "tpot_p50": ratio(plain["tpot_s"]["p50"], speculative["tpot_s"]["p50"]),
            "tpot_p99": ratio(plain["tpot_s"]["p99"], speculative["tpot_s"]["p99"])}
