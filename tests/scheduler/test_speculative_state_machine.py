"""Property test: speculative steps among the scheduler machine's traffic never break the books.

The scheduler's state machine (test_scheduler_state_machine: plain traffic, crowds, aborts,
preemptions, priority changes) where every request speculates: its drafts are the fake model's own
continuation, wrong from a random position on (or all right), so steps accept every length of draft,
reject within a block and across a block boundary, and reject everything. Rules also abort or
preempt a request in the middle of its speculative step (after schedule, before update). After
every rule the scheduler's and the pools' audits pass (no draft slot outlives its step, no table
holds a block past its known tokens), the fake runner checks every KV position a step reads, and at
teardown everything drains to FREE or CACHED. Each run counts the states it reached and fails on a zero.
"""

import functools
import math
import os
import random
from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule, run_state_machine_as_test

from kvstrata.scheduler.drafts import DEFAULT_BREAK_EVEN, may_draft
from tests.kvcache.fakes import OracleProposer, step
from tests.reached import assert_reached
from tests.scheduler.test_scheduler_state_machine import SchedulerMachine

EXAMPLES = int(os.environ.get("KVSTRATA_STATE_MACHINE_EXAMPLES", "1000")) // 2
SPEC_STATES = ("all_accepted", "partly_accepted", "all_rejected", "rejection_within_block",
               "rejection_across_block", "drafts_refused_for_room", "abort_mid_speculation",
               "preempt_mid_speculation", "resumed_after_speculating", "paused_after_drafts_that_did_not_pay")
REACHED: Counter = Counter()


def reach(state: str) -> None:
    event(state)
    REACHED[state] += 1


class SpeculativeMachine(SchedulerMachine):
    @initialize(seed=st.integers(0, 2**32 - 1), lookahead=st.integers(1, 6),
                break_even=st.sampled_from([0.0, DEFAULT_BREAK_EVEN]))
    def speculate(self, seed, lookahead, break_even):
        rng = random.Random(seed)
        self.oracle = OracleProposer(lambda request, k: rng.randint(0, k))    # k: every draft right
        self.lookahead = lookahead
        self.break_even = break_even      # 0: drafts always pay (never paused); the default: failing ones pause

    def speculating_scheduler(self):
        """The scheduler, drafting by the oracle and judging drafts by this run's break-even."""
        scheduler = self.scheduler
        scheduler.proposer = self.oracle
        scheduler.schedule = functools.partial(type(scheduler).schedule, scheduler,
                                               break_even=lambda decodes: self.break_even)
        return scheduler

    def arrive(self, make, prompt, **options):
        def speculating(*args, **kwargs):
            request = make(*args, **kwargs)
            request.num_lookahead_tokens = self.lookahead
            return request
        return super().arrive(speculating, prompt, **options)

    @rule()
    def step(self):
        self.oracle.proposed.clear()
        output = step(self.speculating_scheduler(), self.runner)
        self.observe(output)
        assert not (output.preempted and any(c.draft_token_ids for c in output.chunks)), \
            "a step that preempted gave out drafts"
        if any(c.request.num_preemptions and c.request.num_draft_tokens for c in output.chunks):
            reach("resumed_after_speculating")       # preempted (by a rule or the scheduler) after drafts

    def observe(self, output):
        drafted = {c.request.request_id for c in output.chunks if c.draft_token_ids}
        if set(self.oracle.proposed) - drafted:
            reach("drafts_refused_for_room")
        if any(not may_draft(c.request) for c in output.chunks if c.request.num_lookahead_tokens):
            reach("paused_after_drafts_that_did_not_pay")
        for chunk in output.chunks:
            drafts = len(chunk.draft_token_ids)
            if not drafts:
                continue
            accepted = self.runner.accepted[chunk.request.request_id]
            reach("all_accepted" if accepted == drafts else "all_rejected" if accepted == 0 else "partly_accepted")
            if accepted < drafts:
                end, kept = chunk.start + chunk.num_tokens, chunk.start + 1 + accepted
                same = math.ceil(end / self.block_size) == math.ceil(kept / self.block_size)
                reach("rejection_within_block" if same else "rejection_across_block")

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data(), abort=st.booleans())
    def end_one_mid_step(self, data, abort):
        """Schedule, then abort or preempt a request the step computes (one with drafts if any), then run it."""
        output = self.speculating_scheduler().schedule()
        chunks = [c for c in output.chunks if c.draft_token_ids] or output.chunks
        if chunks:
            chunk = data.draw(st.sampled_from(chunks))
            if chunk.draft_token_ids:
                reach("abort_mid_speculation" if abort else "preempt_mid_speculation")
            if abort:
                self.scheduler.finish(chunk.request.request_id)
            else:
                self.scheduler.preempt(chunk.request.request_id)
        self.scheduler.update(output, self.runner.execute(output), self.runner.accepted)


def run_machine(examples: int, steps: int) -> Counter:
    REACHED.clear()
    run_state_machine_as_test(SpeculativeMachine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))   # derandomized: the states reached do not vary by run
    return Counter(REACHED)


def test_speculative_steps_keep_the_books_and_reach_every_state():
    reached = run_machine(EXAMPLES, 25)
    assert_reached(reached, SPEC_STATES, "speculative machine")
