"""What a step costs on this machine, learned from the steps the engine runs: the time of a step as
`base + per_prefill_token * prefill tokens + per_decode * decodes`, fitted by recursive least squares
that forgets old steps (the host's speed moves), so the engine can keep a step with running decodes
under a time target (`--max-tpot-ms`) by cutting its prefill.

Why: a step carrying a 512-token prefill chunk took 0.3-0.4 s beside decodes of 0.03 s (multi-turn
at 90% of saturation, 2-core EPYC), and every running stream waits for it: those steps made the ITL
p99. The figures: docs/design/scheduler.md.
"""

from __future__ import annotations

import numpy as np

MIN_STEPS = 16            # observations before the fit is trusted (until then: no cut)
# A step with decodes may always take this many times a decode-only step: under heavy load the decodes
# alone are slow, and a fixed target would starve prefill (throughput and TTFT fall, for little ITL).
STRETCH = 5.0
# The target grows once this many requests wait for a first token per decoding one (a burst, or every
# request at once): then the cut spares the few at the cost of the many. At 1 it also fired in paced
# multi-turn's small bursts and lengthened their queueing (TTFT mean 277 -> 415 ms in one A/B).
QUEUE_RATIO = 4
FORGETTING = 0.98         # weight of the past per step: the fit follows the host within ~50 steps


class RecursiveFit:
    """Least squares of `seconds ~ theta . x`, updated step by step, forgetting old steps."""

    def __init__(self, features: int, forgetting: float):
        self.forgetting = forgetting
        self.theta = np.zeros(features)
        self.inverse = np.eye(features) * 1e4        # the inverse information matrix of RLS

    def observe(self, x: np.ndarray, seconds: float) -> None:
        gain = self.inverse @ x / (self.forgetting + x @ self.inverse @ x)
        self.theta = self.theta + gain * (seconds - x @ self.theta)
        self.inverse = (self.inverse - np.outer(gain, x @ self.inverse)) / self.forgetting


class StepCostModel:
    def __init__(self, forgetting: float = FORGETTING):
        self.split = RecursiveFit(3, forgetting)     # (base s, s per prefill token, s per decode)
        self.rows = RecursiveFit(2, forgetting)      # (base s, s per row, whatever the row)
        self.prefill_steps = 0                       # observations that had prefill: the slope needs them
        self.steps = 0

    @property
    def theta(self) -> np.ndarray:
        return self.split.theta

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        self.split.observe(np.array([1.0, prefill_tokens, decodes]), seconds)
        self.rows.observe(np.array([1.0, prefill_tokens + decodes]), seconds)
        self.steps += 1
        self.prefill_steps += prefill_tokens > 0

    def draft_break_even(self, decodes: int) -> float | None:
        """The acceptance a draft token needs to pay for itself in a step of `decodes` decodes: the time
        its row adds, per decoding request, over a decode-only step's time (an accepted draft saves its
        request one step; its row delays all of them). None while the fit is young.

        From a fit of a step's time by its rows alone: a draft's row costs what a decode's does (the
        same projections and logits; at batch 32 the logits of a 49k vocabulary weigh as much as the
        layers), and a single stream's steps, all with one decode, could not tell a decode's cost from
        the base in the split fit. A prefill row attends more keys than a draft's, which errs on the
        side of not drafting."""
        base, per_row = self.rows.theta
        if self.steps < MIN_STEPS or self.prefill_steps < MIN_STEPS // 2 or per_row <= 0:
            return None
        step = base + per_row * max(decodes, 1)
        return per_row * max(decodes, 1) / step if step > 0 else None

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
