"""Property test: families of samples (n / best_of) among ordinary requests never break the books.

Random traffic mixes plain requests and families; rules step, abort one sample, abort a whole
family (as the engine does), and preempt (a family's samples together). After every rule the
scheduler's and the pools' audits pass (a block shared by a family counts once per table holding
it, and a sample's reserved copy block once), and the fake runner checks every KV position a step
reads, so a wrong copy of a family's last prompt block, or a block shared while written, fails.
At teardown everything drains and every block is FREE or CACHED with refcount 0. Each run counts
the family states it reached and fails on a zero.
"""

import os
from collections import Counter

from fakes import FakeMover, FakeRunner, drain, make_family, make_request, make_scheduler, step
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from kvstrata.request import RequestStatus

EXAMPLES = int(os.environ.get("KVSTRATA_STATE_MACHINE_EXAMPLES", "2000")) // 2
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
FAMILY_STATES = ("fork", "fork_copied_last_block", "fork_full_blocks_only", "preempted_before_fork",
                 "preempted_after_fork", "abort_family_before_fork", "abort_family_after_fork",
                 "abort_one_sample", "family_waits_for_room", "family_finished", "family_preempted_by_scheduler")
REACHED: Counter = Counter()


def reach(state: str) -> None:
    event(state)
    REACHED[state] += 1


class FamilyMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(8, 28), block_size=st.sampled_from([2, 4]),
                budget=st.integers(2, 24), max_num_seqs=st.integers(2, 8), caching=st.booleans(),
                chunked=st.booleans(), ratio=st.sampled_from([0.0, 0.3, 1.0]))
    def setup(self, num_blocks, block_size, budget, max_num_seqs, caching, chunked, ratio):
        max_model_len = 24 if chunked else max(2, budget)
        self.runner = FakeRunner(num_blocks, block_size)
        self.scheduler = make_scheduler(
            num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(budget, max_model_len) if not chunked else budget,
            max_model_len=max_model_len, prefix_caching=caching, chunked=chunked,
            reserve_ratio_init=ratio, reserve_ratio_min=min(ratio, 0.1), mover=FakeMover(self.runner, 0))
        self.block_size = block_size
        self.families: dict[str, list] = {}
        self.next_id = 0
        self.clock = 0.0

    def _arrive(self, make, prompt, *args, **kwargs):
        request = make(f"r{self.next_id}", prompt or [0], *args, arrival=self.clock, block_size=self.block_size,
                       **kwargs)
        self.next_id += 1
        self.clock += 1.0
        try:
            self.scheduler.add_request(request)
        except ValueError:
            samples = request.family.samples if request.family else [request]
            assert not any(s.request_id in self.scheduler.requests for s in samples)   # refused: no trace
            return None
        return request

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 9), max_size=6),
          cut=st.integers(1, 12), max_tokens=st.integers(1, 8))
    def add_request(self, prefix, suffix, cut, max_tokens):
        self._arrive(make_request, prefix[:cut] + suffix, max_tokens)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 9), max_size=4),
          cut=st.integers(1, 12), n=st.integers(2, 4), max_tokens=st.integers(1, 8))
    def add_family(self, prefix, suffix, cut, n, max_tokens):
        leader = self._arrive(make_family, prefix[:cut] + suffix, n, max_tokens)
        if leader is not None:
            self.families[leader.family.family_id] = leader.family.samples

    @rule(prefixes=st.lists(st.sampled_from(PREFIXES), min_size=2, max_size=4), steps=st.integers(1, 4))
    def families_crowd_in_and_run(self, prefixes, steps):
        """Several long families at once: the pool runs short as their samples grow, and the scheduler preempts."""
        for prefix in prefixes:
            self.add_family(prefix, [self.next_id % 10], len(prefix), 2, 8)
        for _ in range(steps):
            self.step()

    @rule()
    def step(self):
        waiting_families = [f for f in self._live_families() if f[0].status is RequestStatus.WAITING]
        output = step(self.scheduler, self.runner)
        if any("/" in request_id for request_id in output.preempted):
            reach("family_preempted_by_scheduler")
        for chunk in output.chunks:
            if chunk.forks:
                reach("fork")
                size = self.block_size
                reach("fork_copied_last_block" if chunk.request.num_prompt_tokens % size else "fork_full_blocks_only")
        if any(f[0].status is RequestStatus.WAITING and not f[0].num_preemptions for f in waiting_families) \
                and output.chunks:
            reach("family_waits_for_room")
        for samples in list(self.families.values()):
            if all(s.is_finished for s in samples):
                if all(s.status is not RequestStatus.FINISHED_ABORTED for s in samples):
                    reach("family_finished")
                del self.families[samples[0].family.family_id]

    def _live_families(self):
        return [samples for samples in self.families.values() if not all(s.is_finished for s in samples)]

    @precondition(lambda self: self._live_families())
    @rule(data=st.data())
    def abort_family(self, data):
        samples = data.draw(st.sampled_from(self._live_families()))
        reach("abort_family_after_fork" if samples[0].family.forked else "abort_family_before_fork")
        for sample in samples:                  # as the engine aborts a family: every sample by id
            self.scheduler.finish(sample.request_id)
        assert all(s.is_finished for s in samples)

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort_one(self, data):
        request = self.scheduler.requests[data.draw(st.sampled_from(sorted(self.scheduler.requests)))]
        if request.family is not None:
            reach("abort_one_sample")
        assert self.scheduler.finish(request.request_id).status is RequestStatus.FINISHED_ABORTED

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def preempt(self, data):
        request = data.draw(st.sampled_from(self.scheduler.running))
        family = request.family
        assert self.scheduler.preempt(request.request_id)
        if family is not None:
            reach("preempted_after_fork" if family.forked else "preempted_before_fork")
            active = (RequestStatus.RUNNING, RequestStatus.LOADING)
            assert not any(s.status in active for s in family.samples), "a family is preempted whole"

    @invariant()
    def books_balance(self):
        if hasattr(self, "scheduler"):
            self.scheduler.audit()

    def teardown(self):
        if hasattr(self, "scheduler"):
            drain(self.scheduler, self.runner)


def test_families_keep_the_books_and_reach_every_family_state():
    REACHED.clear()
    run_state_machine_as_test(FamilyMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
    print("family states reached (steps):", dict(sorted(REACHED.items())))
    missing = [state for state in FAMILY_STATES if not REACHED[state]]
    assert not missing, f"the state machine never reached {missing}: {dict(REACHED)}"
