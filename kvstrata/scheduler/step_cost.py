"""What a step costs on this machine, learned from the steps the engine runs: the time of a step as
`base + per_prefill_token * prefill tokens + per_decode * decodes`, fitted by recursive least squares
that forgets old steps (the host's speed moves), so the engine can keep a step with running decodes
under a time target (`--max-tpot-ms`) by cutting its prefill. Here, beside the scheduler it limits, so
that the simulator learns it from its simulated steps as the engine does from real ones.

Why: a step carrying a 512-token prefill chunk took 0.3-0.4 s beside decodes of 0.03 s (multi-turn
at 90% of saturation, 2-core EPYC), and every running stream waits for it: those steps made the ITL
p99. The figures: docs/design/scheduler.md.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvstrata.core.config import SchedulerConfig
from kvstrata.scheduler.output import SchedulerOutput

MIN_STEPS = 16            # observations before the fit is trusted (until then: no cut)
# A step with decodes may always take this many times a decode-only step: under heavy load the decodes
# alone are slow, and a fixed target would starve prefill (throughput and TTFT fall, for little ITL).
STRETCH = 5.0
# The target grows once this many requests wait for a first token per decoding one (a burst, or every
# request at once): then the cut spares the few at the cost of the many. At 1 it also fired in paced
# multi-turn's small bursts and lengthened their queueing (TTFT mean 277 -> 415 ms in one A/B).
QUEUE_RATIO = 4
FORGETTING = 0.98         # weight of the past per step: the fit follows the host within ~50 steps
# No direction of a fit's inverse information matrix may grow past its prior's variance. Forgetting divides
# the matrix by FORGETTING every step, and a direction no step excites (no prefill for a while; no drafts
# when speculation is off) grows without bound ("covariance windup"): after ~35,000 decode-only steps (20
# minutes of a busy server) it overflowed, the fit turned NaN for good, and every later step with decodes
# got only min_prefill_tokens of prefill.
MAX_VARIANCE = 1e4


class RecursiveFit:
    """Least squares of `seconds ~ theta . x`, updated step by step, forgetting old steps."""

    def __init__(self, features: int, forgetting: float):
        self.forgetting = forgetting
        self.theta = np.zeros(features)
        self.inverse = np.eye(features) * MAX_VARIANCE   # the inverse information matrix of RLS

    def observe(self, x: np.ndarray, seconds: float) -> None:
        gain = self.inverse @ x / (self.forgetting + x @ self.inverse @ x)
        self.theta = self.theta + gain * (seconds - x @ self.theta)
        inverse = (self.inverse - np.outer(gain, x @ self.inverse)) / self.forgetting
        if np.trace(inverse) > MAX_VARIANCE:     # some direction may be past the bound: clip it there
            values, vectors = np.linalg.eigh((inverse + inverse.T) / 2)
            inverse = (vectors * np.minimum(values, MAX_VARIANCE)) @ vectors.T
        self.inverse = inverse


class StepCostModel:
    def __init__(self, forgetting: float = FORGETTING):
        self.split = RecursiveFit(3, forgetting)     # (base s, s per prefill token or draft, s per decode)
        self.drafts = RecursiveFit(3, forgetting)    # decode steps only: (base s, s per decode, s per draft)
        self.prefill_steps = 0                       # observations that had prefill: the slope needs them
        self.per_draft = 0.0                         # s per draft row, as of the last step that had drafts
        self.steps = 0

    @property
    def theta(self) -> np.ndarray:
        return self.split.theta

    def observe(self, prefill_tokens: int, decodes: int, seconds: float, drafts: int = 0) -> None:
        self.split.observe(np.array([1.0, prefill_tokens + drafts, decodes]), seconds)
        self.steps += 1
        self.prefill_steps += prefill_tokens + drafts > 0
        if prefill_tokens:              # a prefill chunk's time varies by more than a step's drafts cost
            return
        self.drafts.observe(np.array([1.0, decodes, drafts]), seconds)
        if drafts and self.drafts.theta[2] > 0:      # kept while no step drafts: the fit's slope then drifts
            self.per_draft = float(self.drafts.theta[2])

    def draft_break_even(self, decodes: int) -> float | None:
        """The acceptance a draft token needs to pay for itself in a step of `decodes` decodes: the time
        its row adds, per decoding request, over a decode-only step's time (an accepted draft saves its
        request one step; its row delays all of them). None while the fit is young or has seen no draft.
        The draft slope is the one learned at the last step with drafts: once drafts stop paying no step
        has any, and the fit's slope, no longer observed, drifts (to zero or below, which would bring
        every request's drafts back at once).

        From its own fit over the steps without prefill: a draft row costs more than a prefill row (its
        logits over the vocabulary, its K + 1-row attention) and, in a large batch, more than a decode's
        whole row (2-core Zen 5 EPYC, bf16, 32 decodes: ~1.5 ms against ~1.0), so the prefill rows that
        fill the split fit would price it too low, and a prefill chunk's time varies by more than a
        step's drafts cost (with them in, the slope came out at a tenth of its size in one run). A
        single stream, all of whose steps have one decode, needs only the decode-only step time the
        fit predicts at one decode, not base and per decode apart."""
        base, per_decode, _ = self.drafts.theta
        if self.steps < MIN_STEPS or self.per_draft <= 0:
            return None
        decoding = base + per_decode * max(decodes, 1)
        return self.per_draft * max(decodes, 1) / decoding if decoding > 0 else None

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """A step that ran: its prefill rows, decodes, draft rows (beyond a decode's one) and time."""
        prefills = [c for c in output.chunks if c.start < c.request.num_prompt_tokens]
        drafts = sum(len(c.draft_token_ids) for c in output.chunks)
        self.observe(sum(c.num_tokens for c in prefills), len(output.chunks) - len(prefills), seconds, drafts)

    def limiter(self, config: SchedulerConfig) -> Callable[[int, int], int] | None:
        """`Scheduler.schedule`'s prefill_limit under `config.max_tpot_ms` (None: no target, no cut)."""
        if not config.max_tpot_ms:
            return None
        return lambda decodes, waiting: self.prefill_limit(config.max_tpot_ms / 1000, decodes,
                                                           config.min_prefill_tokens,
                                                           config.max_num_batched_tokens, waiting)

    def prefill_limit(self, target_s: float, decodes: int, floor: int, ceiling: int, waiting: int = 0) -> int:
        """Most prefill tokens a step with `decodes` decodes can take within `target_s`, or within STRETCH
        times its decodes' own time when that is longer (never below `floor`); `ceiling` while the fit
        is young or says a token costs nothing.

        When over QUEUE_RATIO requests wait for their first token per decoding one, the target grows in
        proportion: the cut makes the waiting wait longer to spare the decoding, and there it spares
        the few at the cost of the many (every request at once: it cost 9% of throughput)."""
        base, per_token, per_decode = self.theta
        if self.steps < MIN_STEPS or self.prefill_steps < MIN_STEPS // 2 or per_token <= 1e-7:
            return ceiling
        decoding = base + per_decode * decodes
        target_s *= max(1.0, waiting / (QUEUE_RATIO * max(decodes, 1)))
        room = max(target_s, STRETCH * decoding) - decoding
        return int(min(ceiling, max(floor, room / per_token)))
