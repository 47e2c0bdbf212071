"""Property test over device + host + store tiers with faults at every boundary.

Random traffic, aborts and preemptions (also during loads); store calls that fail, return a
corrupted record or another key's record, hang past the timeout or never answer; copies, encodes
and decodes that raise. After every rule: the scheduler's and every pool's audit, including
in-flight accounting; the fake runner checks every attended position holds the right token (so a
bad load or a failed copy can never be served). Teardown: no USED or IN_FLIGHT block anywhere.

A property test proves only what it reaches: each run counts the hard states it hit (requests
LOADING, orphaned loads, host and store hits, write-backs, write-throughs, each kind of fault)
and fails if any count is zero. The same machine runs again with every request speculating (drafts
from the fake model's own continuation, wrong from a random position on), so speculative steps
meet loads, offloads, preemptions, aborts and faults.
"""

import os
import random
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

from kvstrata.kvcache.faults import FaultInjector
from tests.kvcache.fakes import OracleProposer, drain, make_request, make_tiered_scheduler, step
from tests.reached import assert_reached

EXAMPLES = int(os.environ.get("KVSTRATA_TIERS_MACHINE_EXAMPLES", "500"))
STEPS = 40
# More distinct prefixes than the device holds, so blocks cycle through host and store.
PREFIXES = [[16 * k + j for j in range(12)] for k in range(5)] + [list(range(1, 9)) + [7, 7, 7, 7]]
HARD_STATES = ("loading", "orphaned_load", "host_hit", "store_hit", "write_back", "write_through",
               "store_write", "fault_copy", "fault_encode", "fault_decode", "store_error", "store_timeout",
               "bad_record", "step_with_loading_and_running")
SPEC_STATES = ("drafts_accepted", "drafts_rejected")


def tiered_machine(reached: Counter, lookahead: int = 0) -> type[RuleBasedStateMachine]:
    """The machine class, counting into `reached` the hard states its runs hit; with `lookahead`, every
    request verifies up to that many drafts a step."""

    class TieredMachine(RuleBasedStateMachine):
        @initialize(num_blocks=st.integers(6, 12), num_host_blocks=st.integers(0, 6), budget=st.integers(2, 16),
                    write_policy=st.sampled_from(["write_back", "write_through"]), store=st.booleans())
        def setup(self, num_blocks, num_host_blocks, budget, write_policy, store):
            self.faults = FaultInjector()
            self.scheduler, self.runner, self.executor, self.clock, _ = make_tiered_scheduler(
                num_blocks=num_blocks, num_host_blocks=num_host_blocks, store=store, write_policy=write_policy,
                max_num_batched_tokens=budget, max_model_len=24, max_num_seqs=4,
                reserve_ratio_init=0.3, reserve_ratio_min=0.1, faults=self.faults)
            self.write_policy = write_policy
            self.next_id = 0
            rng = random.Random(num_blocks * 100 + budget)
            self.scheduler.proposer = OracleProposer(lambda request, k: rng.randint(0, k))
            self.made = []

        @rule(prefix=st.sampled_from(PREFIXES), cut=st.sampled_from([3, 4, 8, 12, 12]),
              suffix=st.lists(st.integers(0, 9), max_size=3), max_tokens=st.integers(1, 6))
        def add_request(self, prefix, cut, suffix, max_tokens):
            request = make_request(f"r{self.next_id}", prefix[:cut] + suffix, max_tokens=max_tokens,
                                   arrival=float(self.next_id))
            request.num_lookahead_tokens = lookahead
            self.made.append(request)
            self.next_id += 1
            try:
                self.scheduler.add_request(request)
            except ValueError:
                pass

        @rule(prefixes=st.lists(st.sampled_from(PREFIXES), min_size=1, max_size=3, unique_by=id))
        def a_burst_runs_to_completion(self, prefixes):
            """Traffic that cycles blocks down through host and store, so later requests hit there."""
            for prefix in prefixes:
                self.add_request(prefix, 12, [], 1)
            for _ in range(200):
                if not self.scheduler.requests:
                    break
                step(self.scheduler, self.runner)
                self.executor.run_all()
                self.clock.now += 0.25

        @rule(prefix=st.sampled_from(PREFIXES), max_tokens=st.integers(1, 6),
              load=st.sampled_from(["later", "ok", "corrupt", "swap", "io"]),
              meanwhile=st.sampled_from([None, None, "abort", "preempt"]))
        def a_returning_prefix_is_admitted(self, prefix, max_tokens, load, meanwhile):
            """A prefix served before comes back, the store answers its lookup, and a step admits it
            (from the store, if its blocks went that far down: it is LOADING then, may let go of its
            load `meanwhile`, and its load answers now as `load` says, or later)."""
            request_id = f"r{self.next_id}"
            self.add_request(prefix, 12, [self.next_id % 10], max_tokens)
            while self.executor.run_next(call="exists"):
                pass
            self.step()
            if meanwhile and self.scheduler.tiers.is_loading(request_id):
                if meanwhile == "abort":
                    self.scheduler.finish(request_id)
                else:
                    assert self.scheduler.preempt(request_id)
            if load != "later":
                self.executor.run_next(fault="io" if load == "io" else None, corrupt=load == "corrupt",
                                       swap=load == "swap", call="get")

        @rule()
        def step(self):
            step(self.scheduler, self.runner)
            if self.scheduler.loading and self.scheduler.running:
                self.reach("step_with_loading_and_running")

        @rule(fault=st.sampled_from([None, None, "io", "timeout"]), corrupt=st.booleans(), swap=st.booleans())
        def store_answers(self, fault, corrupt, swap):
            self.executor.run_next(fault=fault, corrupt=corrupt, swap=swap)

        @rule()
        def store_catches_up(self):
            self.executor.run_all()

        @rule()
        def store_never_answers(self):
            self.executor.hang_next()

        @rule()
        def time_passes_past_the_timeout(self):
            self.clock.now += 2.0

        @rule(site=st.sampled_from(["copy", "encode", "decode"]), times=st.integers(1, 3))
        def next_calls_fail(self, site, times):
            self.faults.arm(site, times)

        @precondition(lambda self: self.scheduler.loading)
        @rule(corrupt=st.booleans(), fault=st.sampled_from([None, "io"]))
        def loads_come_back_bad(self, corrupt, fault):
            """Every queued store call answers: wrong records (corrupted, or another key's), or an error."""
            while self.executor.run_next(fault=fault, corrupt=corrupt, swap=not corrupt, call="get"):
                pass

        @precondition(lambda self: self.scheduler.loading)
        @rule(data=st.data(), how=st.sampled_from(["abort", "preempt"]))
        def a_loading_request_lets_go(self, data, how):
            request = data.draw(st.sampled_from(self.scheduler.loading))
            if how == "abort":
                self.scheduler.finish(request.request_id)
            else:
                assert self.scheduler.preempt(request.request_id)

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
                if self.scheduler.loading:
                    self.reach("loading")

        def reach(self, state: str) -> None:
            event(state)
            reached[state] += 1

        def teardown(self):
            if not hasattr(self, "scheduler"):
                return
            self.faults.fail_at.clear()
            drain(self.scheduler, self.runner, self.executor, clock=self.clock)
            stats = self.scheduler.tiers.stats
            accepted = sum(r.num_accepted_tokens for r in self.made)
            for state, count in (
                    ("drafts_accepted", accepted), ("drafts_rejected", sum(r.num_draft_tokens for r in self.made) - accepted),
                    ("orphaned_load", stats.orphaned_loads), ("host_hit", stats.loaded_blocks["host"]),
                    ("store_hit", stats.loaded_blocks["store"]), ("store_write", stats.offloaded_blocks["store"]),
                    ("fault_copy", stats.faults.get("copy", 0)), ("fault_encode", stats.faults.get("encode", 0)),
                    ("fault_decode", stats.faults.get("decode", 0)),
                    ("store_error", sum(n for kind, n in stats.store_errors.items() if kind != "timeout")),
                    ("store_timeout", stats.store_errors.get("timeout", 0)),
                    ("bad_record", sum(stats.load_failures.get(r, 0) for r in ("checksum", "hash", "tokens")))):
                if count:
                    self.reach(state)
            if stats.offloaded_blocks["host"]:
                self.reach(self.write_policy)

    return TieredMachine


def run_machine(examples: int, steps: int, lookahead: int = 0) -> Counter:
    reached: Counter = Counter()
    run_state_machine_as_test(tiered_machine(reached, lookahead), settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))   # derandomized: the states reached do not vary by run
    return reached


def test_tiers_keep_their_books_under_faults_and_reach_every_hard_state():
    reached = run_machine(EXAMPLES, STEPS)
    assert_reached(reached, HARD_STATES, "tiers machine")


def test_speculative_steps_keep_the_books_of_every_tier_under_faults():
    # twice the plain machine's runs: with drafts the rarest states come less often (at half, bad_record
    # was missed once in a full suite run; at 1x, step_with_loading_and_running came 2 times in one run)
    reached = run_machine(6 * EXAMPLES // 5, STEPS, lookahead=4)     # every state reached at 600 (derandomized)
    assert_reached(reached, HARD_STATES + SPEC_STATES, "speculative tiers machine")


@pytest.mark.slow
def test_tiers_machine_long_run():
    """`make test-slow`: 10^5 steps (2,500 runs of 40)."""
    reached = run_machine(2500, STEPS)
    assert all(reached[state] for state in HARD_STATES), reached
