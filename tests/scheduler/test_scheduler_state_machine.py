"""Property test: random traffic, aborts, preemptions and priority changes never break the books.

After every rule the scheduler's audit (queues, limits) and the pools' audit (conservation,
refcounts against block tables, hash index) must pass, and the fake runner checks that every
position a step attends to holds the right token. At teardown everything drains, and every
block is FREE or CACHED with refcount 0. Each run counts the states it reached (preemptions by the
scheduler, resumes, prefix hits, chunked prefill, aborts of running requests) and fails on a zero.
"""

import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvstrata.core.request import RequestStatus
from tests.kvcache.fakes import FakeMover, FakeRunner, drain, make_request, make_scheduler, step
from tests.reached import assert_reached

EXAMPLES = int(os.environ.get("KVSTRATA_STATE_MACHINE_EXAMPLES", "1000"))
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
HARD_STATES = ("preempted_by_scheduler", "resumed", "prefix_hit", "chunked_prefill", "abort_running")
REACHED: Counter = Counter()       # what the runs of this module reached, by state


def reach(state: str) -> None:
    event(state)
    REACHED[state] += 1


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 24), block_size=st.sampled_from([2, 4]),
                budget=st.integers(1, 24), max_num_seqs=st.integers(1, 6),
                policy=st.sampled_from(["fcfs", "priority", "lpm"]), caching=st.booleans(),
                chunked=st.booleans(), ratio=st.sampled_from([0.0, 0.3, 1.0]))
    def setup(self, num_blocks, block_size, budget, max_num_seqs, policy, caching, chunked, ratio):
        max_model_len = 24 if chunked else max(2, budget)    # unchunked prompts must fit one step
        self.runner = FakeRunner(num_blocks, block_size)
        self.scheduler = make_scheduler(
            num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(budget, max_model_len) if not chunked else budget,
            max_model_len=max_model_len, policy=policy, prefix_caching=caching, chunked=chunked,
            reserve_ratio_init=ratio, reserve_ratio_min=min(ratio, 0.1),
            mover=FakeMover(self.runner, 0))                 # copies a family's last prompt block
        self.block_size = block_size
        self.next_id = 0
        self.clock = 0.0

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 9), max_size=6),
          cut=st.integers(1, 12), max_tokens=st.integers(1, 8), priority=st.integers(0, 3))
    def add_request(self, prefix, suffix, cut, max_tokens, priority):
        self.arrive(make_request, prefix[:cut] + suffix, max_tokens=max_tokens, priority=priority)

    def arrive(self, make, prompt, **options):
        """Build a request (or a family's leader) with `make` and add it; it, or None if refused."""
        request = make(f"r{self.next_id}", prompt or [0], arrival=self.clock, block_size=self.block_size, **options)
        self.next_id += 1
        self.clock += 1.0
        try:
            self.scheduler.add_request(request)
        except ValueError:
            samples = request.family.samples if request.family is not None else [request]
            assert not any(s.request_id in self.scheduler.requests for s in samples)   # refused: no trace
            return None
        return request

    @rule(prefixes=st.lists(st.sampled_from(PREFIXES), min_size=3, max_size=5), steps=st.integers(1, 4))
    def a_crowd_arrives_and_runs(self, prefixes, steps):
        """Several long requests at once: the pool runs short as they grow, and the scheduler preempts."""
        for prefix in prefixes:
            self.add_long(prefix)
        for _ in range(steps):
            self.step()

    def add_long(self, prefix):
        """One long request of a crowd (the family machine sends families too)."""
        self.add_request(prefix, [self.next_id % 10], len(prefix), 8, 0)

    @rule()
    def step(self):
        output = step(self.scheduler, self.runner)
        if output.preempted:
            reach("preempted_by_scheduler")
        for chunk in output.chunks:
            if chunk.request.num_preemptions:
                reach("resumed")
            if not chunk.sample:
                reach("chunked_prefill")
            if chunk.request.num_cached_tokens > 0:
                reach("prefix_hit")

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        if self.scheduler.requests[request_id].status is RequestStatus.RUNNING:
            reach("abort_running")
        request = self.scheduler.finish(request_id)
        assert request.status is RequestStatus.FINISHED_ABORTED

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def preempt(self, data):
        request = data.draw(st.sampled_from(self.scheduler.running))
        assert self.scheduler.preempt(request.request_id)

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data(), priority=st.integers(0, 3))
    def change_priority(self, data, priority):
        self.scheduler.set_priority(data.draw(st.sampled_from(sorted(self.scheduler.requests))), priority)

    @invariant()
    def books_balance(self):
        if hasattr(self, "scheduler"):
            self.scheduler.audit()

    def teardown(self):
        if hasattr(self, "scheduler"):
            drain(self.scheduler, self.runner)


def run_machine(examples: int, steps: int, machine: type = SchedulerMachine, reached: Counter = REACHED) -> Counter:
    """Run `machine` (this one, or a subclass counting into its own `reached`); what the runs reached."""
    reached.clear()
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
    return Counter(reached)


def test_scheduler_keeps_its_books_and_reaches_every_hard_state():
    reached = run_machine(EXAMPLES // 2, 25)       # each state dozens of times at 500; the slow run takes 10,000
    assert_reached(reached, HARD_STATES, "scheduler machine")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_scheduler_machine_long_run():
    reached = run_machine(10 * EXAMPLES, 50)
    assert all(reached[state] for state in HARD_STATES), reached
