"""Property test over the prefill/decode handoff (docs/design/disaggregation.md): which side holds
what, and when, whatever fails.

Two schedulers over fake tiers share one FakeStore: a prefill side (write-through) and a decode side.
A handoff runs as the engines run it: the prefill request takes one token and ends; `hand_off`
starts the store writes of its prompt blocks and the answer waits until `stored_run` says no write
that could lengthen the stored run is still out; the decode request then queues with the same
prompt and loads what it finds. Store calls on either side succeed, fail, hang past the deadline,
or return a corrupted or another key's record; a client leaves at any point (prefill running,
answer waiting for writes, between the legs, decode loading, decode running). After every rule both
sides pass `audit()`; the fake runners check every KV position a step reads (a bad load can never be
served); at the end nothing is held on either side.

It proves only what it reaches: each run counts the handoff states it hit and fails on any it never
reached.
"""

import os
from collections import Counter

from hypothesis import HealthCheck, settings
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
from tests.kvcache.fakes import FakeStore, at_rest, drive, make_request, make_tiered_scheduler, step
from tests.reached import assert_reached

EXAMPLES = int(os.environ.get("KVSTRATA_HANDOFF_MACHINE_EXAMPLES", "200"))
STEPS = 40
PREFIXES = [[16 * k + j for j in range(13)] for k in range(3)]
STATES = ("prefill_running", "writes_pending", "stored_all", "stored_part", "stored_none", "decode_loading",
          "decode_loaded", "decode_recomputed", "decode_finished", "abort_prefill", "abort_waiting_writes",
          "abort_between", "abort_loading", "abort_decoding")


def handoff_machine(reached: Counter) -> type[RuleBasedStateMachine]:
    class HandoffMachine(RuleBasedStateMachine):
        @initialize(prefill_blocks=st.integers(8, 14), decode_blocks=st.integers(8, 14), budget=st.integers(4, 16))
        def setup(self, prefill_blocks, decode_blocks, budget):
            store = FakeStore()
            self.prefill, self.p_runner, self.p_calls, self.p_clock, _ = make_tiered_scheduler(
                num_blocks=prefill_blocks, num_host_blocks=0, store=store, write_policy="write_through",
                max_num_batched_tokens=budget, max_model_len=24, max_num_seqs=4)
            self.decode, self.d_runner, self.d_calls, self.d_clock, _ = make_tiered_scheduler(
                num_blocks=decode_blocks, num_host_blocks=0, store=store, max_num_batched_tokens=budget,
                max_model_len=24, max_num_seqs=4)
            self.next_id = 0
            self.prefilling = {}        # request id -> request, on the prefill side
            self.waiting_writes = {}    # request id -> (request, hashes): ended, the answer held
            self.handed = []            # (prompt, number of blocks handed over): between the legs
            self.decoding = {}          # request id -> (request, blocks handed over)

        # ---- the prefill leg ------------------------------------------------------------------------
        @rule(prefix=st.sampled_from(PREFIXES), cut=st.sampled_from([5, 9, 13]), suffix=st.integers(0, 9))
        def start_handoff(self, prefix, cut, suffix):
            request = make_request(f"p{self.next_id}", prefix[:cut] + [suffix], max_tokens=1,
                                   arrival=float(self.next_id))
            self.next_id += 1
            self.prefill.add_request(request)
            self.prefilling[request.request_id] = request

        @rule(outcomes=st.lists(st.sampled_from(["ok", "ok", "ok", "fail", "hang"]), min_size=1, max_size=8))
        def prefill_side_runs(self, outcomes):
            """Steps of the prefill side, each followed by one store call answered as drawn; then the
            answers whose writes have settled go out."""
            for outcome in outcomes:
                if any(r.status is RequestStatus.RUNNING for r in self.prefilling.values()):
                    reached["prefill_running"] += 1
                step(self.prefill, self.p_runner)
                self.p_clock.now += 0.25
                for request_id, request in list(self.prefilling.items()):
                    if request.status is RequestStatus.FINISHED_LENGTH:
                        del self.prefilling[request_id]
                        self.waiting_writes[request_id] = (request, self.prefill.tiers.hand_off(request))
                if outcome == "hang":
                    self.p_calls.hang_next()
                else:
                    self.p_calls.run_next(fault=None if outcome == "ok" else "connection")
                self.settle_answers()

        def settle_answers(self):
            for request_id, (request, hashes) in list(self.waiting_writes.items()):
                stored, pending = self.prefill.tiers.stored_run(hashes)
                if pending:
                    reached["writes_pending"] += 1
                    continue
                del self.waiting_writes[request_id]
                reached["stored_all" if stored == len(hashes) else "stored_part" if stored else "stored_none"] += 1
                self.handed.append((request.prompt_token_ids, stored))

        # ---- the decode leg -------------------------------------------------------------------------
        @precondition(lambda self: self.handed)
        @rule(max_tokens=st.integers(1, 5))
        def start_decode(self, max_tokens):
            prompt, stored = self.handed.pop(0)
            request = make_request(f"d{self.next_id}", prompt, max_tokens=max_tokens, arrival=float(self.next_id))
            self.next_id += 1
            self.decode.add_request(request)
            self.decoding[request.request_id] = (request, stored)

        @rule(outcomes=st.lists(st.sampled_from(["ok", "ok", "ok", "fail", "hang", "corrupt", "swap", "none"]),
                                min_size=1, max_size=8))
        def decode_side_runs(self, outcomes):
            """Steps of the decode side, each followed by one store call answered as drawn (none: the
            calls out stay out, so a load may still run when the client leaves)."""
            for outcome in outcomes:
                if any(r.status is RequestStatus.LOADING for r, _ in self.decoding.values()):
                    reached["decode_loading"] += 1
                step(self.decode, self.d_runner)
                self.d_clock.now += 0.25
                for request_id, (request, stored) in list(self.decoding.items()):
                    if request.status is RequestStatus.FINISHED_LENGTH:
                        del self.decoding[request_id]
                        reached["decode_finished"] += 1
                        if stored:
                            loaded = request.num_cached_tokens >= stored * 4
                            reached["decode_loaded" if loaded else "decode_recomputed"] += 1
                if outcome == "hang":
                    self.d_calls.hang_next()
                elif outcome != "none":
                    self.d_calls.run_next(fault="connection" if outcome == "fail" else None,
                                          corrupt=outcome == "corrupt", swap=outcome == "swap")

        # ---- a client leaving -----------------------------------------------------------------------
        @rule(where=st.sampled_from(["prefill", "waiting_writes", "between", "decode"]), which=st.integers(0, 3))
        def client_leaves(self, where, which):
            if where == "prefill" and self.prefilling:
                request = list(self.prefilling.values())[which % len(self.prefilling)]
                del self.prefilling[request.request_id]
                self.prefill.finish(request.request_id)
                reached["abort_prefill"] += 1
            elif where == "waiting_writes" and self.waiting_writes:
                del self.waiting_writes[list(self.waiting_writes)[which % len(self.waiting_writes)]]
                reached["abort_waiting_writes"] += 1          # its blocks were released when it ended
            elif where == "between" and self.handed:
                self.handed.pop(which % len(self.handed))
                reached["abort_between"] += 1                 # nothing is held on either side
            elif where == "decode" and self.decoding:
                request, _ = list(self.decoding.values())[which % len(self.decoding)]
                reached["abort_loading" if request.status is RequestStatus.LOADING else "abort_decoding"] += 1
                del self.decoding[request.request_id]
                self.decode.finish(request.request_id)

        @invariant()
        def both_sides_balance(self):
            self.prefill.audit()
            self.decode.audit()

        def teardown(self):
            for scheduler, runner, calls, clock in ((self.prefill, self.p_runner, self.p_calls, self.p_clock),
                                                    (self.decode, self.d_runner, self.d_calls, self.d_clock)):
                drive(scheduler, runner, calls, clock=clock)
                at_rest(scheduler)

    return HandoffMachine


def test_the_handoff_loses_nothing_and_reaches_every_state():
    reached: Counter = Counter()
    run_state_machine_as_test(handoff_machine(reached), settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
    assert_reached(reached, STATES, "handoff machine")
