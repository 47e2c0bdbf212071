"""Property test over device + host + store tiers with faults.

Random traffic, aborts and preemptions (also during loads), store calls that fail, return a
corrupted record, or hang past the timeout. After every rule: the scheduler's and every pool's
audit, including in-flight accounting; the fake runner checks every attended position holds the
right token (so a bad load can never be served). Teardown: no USED or IN_FLIGHT block anywhere.
"""

import os

from fakes import drain, make_request, make_tiered_scheduler, step
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule


EXAMPLES = int(os.environ.get("KVSTRATA_TIERS_MACHINE_EXAMPLES", "600"))
# More distinct prefixes than the device holds, so blocks cycle through host and store.
PREFIXES = [[16 * k + j for j in range(12)] for k in range(5)] + [list(range(1, 9)) + [7, 7, 7, 7]]


class TieredMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 12), num_host_blocks=st.integers(0, 6), budget=st.integers(2, 16),
                write_policy=st.sampled_from(["write_back", "write_through"]), store=st.booleans())
    def setup(self, num_blocks, num_host_blocks, budget, write_policy, store):
        self.scheduler, self.runner, self.executor, self.clock, _ = make_tiered_scheduler(
            num_blocks=num_blocks, num_host_blocks=num_host_blocks, store=store, write_policy=write_policy,
            max_num_batched_tokens=budget, max_model_len=24, max_num_seqs=4,
            reserve_ratio_init=0.3, reserve_ratio_min=0.1)
        self.next_id = 0

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.sampled_from([3, 4, 8, 12, 12]),
          suffix=st.lists(st.integers(0, 9), max_size=3), max_tokens=st.integers(1, 6))
    def add_request(self, prefix, cut, suffix, max_tokens):
        request = make_request(f"r{self.next_id}", prefix[:cut] + suffix, max_tokens=max_tokens,
                               arrival=float(self.next_id))
        self.next_id += 1
        try:
            self.scheduler.add_request(request)
        except ValueError:
            pass

    @rule()
    def step(self):
        step(self.scheduler, self.runner)

    @rule(fault=st.sampled_from([None, None, "io", "timeout"]), corrupt=st.booleans())
    def store_answers(self, fault, corrupt):
        self.executor.run_next(fault=fault, corrupt=corrupt)

    @rule()
    def store_catches_up(self):
        self.executor.run_all()

    @rule()
    def store_hangs_past_the_timeout(self):
        self.clock.now += 2.0

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        self.scheduler.finish(data.draw(st.sampled_from(sorted(self.scheduler.requests))))

    @precondition(lambda self: self.scheduler.running or self.scheduler.loading)
    @rule(data=st.data())
    def preempt(self, data):
        request = data.draw(st.sampled_from(self.scheduler.running + self.scheduler.loading))
        assert self.scheduler.preempt(request.request_id)

    @invariant()
    def books_balance(self):
        if hasattr(self, "scheduler"):
            self.scheduler.audit()

    def teardown(self):
        if hasattr(self, "scheduler"):
            drain(self.scheduler, self.runner, self.executor)


TestTieredMachine = TieredMachine.TestCase
TestTieredMachine.settings = settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
