"""Property test: families of samples (n / best_of) among ordinary requests never break the books.

The scheduler's state machine (test_scheduler_state_machine: plain traffic, crowds, aborts,
preemptions, priority changes) with families added: rules add families, abort a whole family (as
the engine does, every sample by id) or one sample, and preempt (a family's samples together).
After every rule the scheduler's and the pools' audits pass (a block shared by a family counts
once per table holding it, and a sample's reserved copy block once), and the fake runner checks
every KV position a step reads, so a wrong copy of a family's last prompt block, or a block shared
while written, fails. At teardown everything drains and every block is FREE or CACHED with
refcount 0. Each run counts the family states it reached and fails on a zero.
"""

import os
from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule, run_state_machine_as_test

from kvstrata.core.request import RequestStatus
from tests.kvcache.fakes import make_family, step
from tests.reached import assert_reached
from tests.scheduler.test_scheduler_state_machine import PREFIXES, SchedulerMachine

EXAMPLES = int(os.environ.get("KVSTRATA_STATE_MACHINE_EXAMPLES", "2000")) // 2
FAMILY_STATES = ("fork", "fork_copied_last_block", "fork_full_blocks_only", "preempted_before_fork",
                 "preempted_after_fork", "abort_family_before_fork", "abort_family_after_fork",
                 "abort_one_sample", "family_waits_for_room", "family_finished", "family_preempted_by_scheduler")
REACHED: Counter = Counter()


def reach(state: str) -> None:
    event(state)
    REACHED[state] += 1


class FamilyMachine(SchedulerMachine):
    @initialize()
    def no_families_yet(self):
        self.families: dict[str, list] = {}

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 9), max_size=4),
          cut=st.integers(1, 12), n=st.integers(2, 4), max_tokens=st.integers(1, 8))
    def add_family(self, prefix, suffix, cut, n, max_tokens):
        leader = self.arrive(make_family, prefix[:cut] + suffix, n=n, max_tokens=max_tokens)
        if leader is not None:
            self.families[leader.family.family_id] = leader.family.samples

    def add_long(self, prefix):
        """Every other long request of a crowd is a family: the pool runs short as samples grow."""
        if self.next_id % 2:
            self.add_family(prefix, [self.next_id % 10], len(prefix), 2, 8)
        else:
            super().add_long(prefix)

    def _live_families(self) -> list[list]:
        return [samples for samples in self.families.values()
                if not all(s.is_finished for s in samples)]

    @rule()
    def step(self):
        waiting = [f for f in self._live_families() if f[0].status is RequestStatus.WAITING]
        output = step(self.scheduler, self.runner)
        if any("/" in request_id for request_id in output.preempted):
            reach("family_preempted_by_scheduler")
        for chunk in output.chunks:
            if chunk.forks:
                reach("fork")
                reach("fork_copied_last_block" if chunk.request.num_prompt_tokens % self.block_size
                      else "fork_full_blocks_only")
        if output.chunks and any(f[0].status is RequestStatus.WAITING and not f[0].num_preemptions for f in waiting):
            reach("family_waits_for_room")
        for family_id, samples in list(self.families.items()):
            if all(s.is_finished for s in samples):
                if all(s.status is not RequestStatus.FINISHED_ABORTED for s in samples):
                    reach("family_finished")
                del self.families[family_id]

    @precondition(lambda self: self._live_families())
    @rule(data=st.data())
    def abort_family(self, data):
        samples = data.draw(st.sampled_from(self._live_families()))
        reach("abort_family_after_fork" if samples[0].family.forked else "abort_family_before_fork")
        for sample in samples:
            self.scheduler.finish(sample.request_id)
        assert all(s.is_finished for s in samples)

    @precondition(lambda self: self._live_families())
    @rule(data=st.data())
    def abort_one_sample(self, data):
        samples = [s for s in data.draw(st.sampled_from(self._live_families())) if not s.is_finished]
        sample = data.draw(st.sampled_from(samples))
        reach("abort_one_sample")
        assert self.scheduler.finish(sample.request_id).status is RequestStatus.FINISHED_ABORTED

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


def test_families_keep_the_books_and_reach_every_family_state():
    REACHED.clear()
    run_state_machine_as_test(FamilyMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
    assert_reached(REACHED, FAMILY_STATES, "family machine")
