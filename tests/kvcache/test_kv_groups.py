"""KV cache groups: the grouping of a hybrid model's layers, and a property machine over the groups.

The machine is the scheduler's (random traffic, aborts, preemptions, chunked prefill, prefix hits) with two or
three KV groups, one global and the rest sliding: the fake runner checks every position each group's rows read
holds the request's token and that none reads a page its group let go, and the audit after every rule checks
that a sliding table holds nothing before its window and all of it from there. Each run counts what it reached:
sliding pages let go mid-sequence, hits a sliding group served with its window alone, hits cut short because a
sliding group lacked its window, preemptions and aborts, and fails on a zero.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvstrata.core.hashing import hash_block
from kvstrata.core.request import RequestStatus
from kvstrata.kvcache.faults import FaultInjector, FaultyMover
from kvstrata.kvcache.kv_groups import KVGroups, group_hash
from tests.kvcache.fakes import FakeMover, FakeRunner, drive, make_family, make_request, make_scheduler, step
from tests.reached import assert_reached
from tests.scheduler import test_scheduler_state_machine as base

EXAMPLES = int(os.environ.get("KVSTRATA_STATE_MACHINE_EXAMPLES", "1000")) // 4
HARD_STATES = ("window_released", "window_hit", "window_cut_hit", "preempted_by_scheduler", "abort_running")
REACHED: Counter = Counter()


def gemma3_windows(layers: int, window: int = 512) -> list[int | None]:
    return [None if (i + 1) % 6 == 0 else window for i in range(layers)]


def test_layers_are_grouped_by_kind_in_groups_of_the_kinds_gcd():
    groups = KVGroups.for_windows(gemma3_windows(18))                  # Gemma 3 270M: 3 global, 15 sliding
    assert groups.layers_per_page == 3 and groups.num_groups == 6
    assert groups.groups[0].layers == (5, 11, 17) and groups.windows == (None,) + (512,) * 5
    assert groups.group_of[5] == 0 and groups.group_of[0] == 1 and groups.page_slot[11] == 1
    one_b = KVGroups.for_windows(gemma3_windows(26))                   # Gemma 3 1B: 4 global, 22 sliding
    assert one_b.layers_per_page == 2 and one_b.windows == (None, None) + (512,) * 11
    for windows in ([None] * 4, [64] * 4):                          # one kind: one group of every layer
        assert KVGroups.for_windows(windows).groups[0].layers == (0, 1, 2, 3)
        assert KVGroups.for_windows(windows).groups[0].window is None


def test_a_sliding_group_holds_its_window_and_the_step_at_most():
    groups = KVGroups.for_windows([None, 8])
    assert groups.first_needed(1, 7, 4) == 0 and groups.first_needed(1, 12, 4) == 1
    assert groups.first_needed(0, 99, 4) == 0
    for position in range(40):                         # a decode at `position` reads blocks first..position // 4
        for chunk in (1, 3, 9):
            held = (position + chunk - 1) // 4 - groups.first_needed(1, position, 4) + 1
            assert held <= groups.peak_blocks(1, 99, chunk, 4)


def test_each_group_keys_its_pages_apart():
    block = hash_block(b"\0" * 16, [1, 2, 3, 4])
    keys = {group_hash(block, group) for group in range(6)}
    assert group_hash(block, 0) == block and len(keys) == 6


class GroupsMachine(base.SchedulerMachine):
    """The scheduler machine with a global and one or two sliding KV groups."""

    @initialize(num_blocks=st.integers(10, 40), block_size=st.sampled_from([2, 4]), budget=st.integers(1, 24),
                max_num_seqs=st.integers(1, 6), policy=st.sampled_from(["fcfs", "lpm"]), chunked=st.booleans(),
                ratio=st.sampled_from([0.0, 0.3, 1.0]), window=st.integers(2, 7), sliding=st.sampled_from([1, 2]))
    def setup(self, num_blocks, block_size, budget, max_num_seqs, policy, chunked, ratio, window, sliding):
        max_model_len = 24 if chunked else max(2, budget)
        self.groups = KVGroups.for_windows([None] + [window] * sliding)
        self.runner = FakeRunner(num_blocks, block_size, self.groups.windows)
        self.scheduler = make_scheduler(
            num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(budget, max_model_len) if not chunked else budget,
            max_model_len=max_model_len, policy=policy, chunked=chunked, reserve_ratio_init=ratio,
            reserve_ratio_min=min(ratio, 0.1), mover=FakeMover(self.runner, 0), groups=self.groups)
        self.block_size = block_size
        self.next_id = 0
        self.clock = 0.0

    @rule()
    def step(self):
        stats = self.scheduler.tiers.stats
        before = (stats.window_released, stats.window_hits, stats.window_cut_hits)
        output = step(self.scheduler, self.runner)
        after = (stats.window_released, stats.window_hits, stats.window_cut_hits)
        for state, was, now in zip(("window_released", "window_hit", "window_cut_hit"), before, after):
            if now > was:
                event(state)
                REACHED[state] += 1
        REACHED["preempted_by_scheduler"] += bool(output.preempted)

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        REACHED["abort_running"] += self.scheduler.requests[request_id].status is RequestStatus.RUNNING
        self.scheduler.finish(request_id)


def test_kv_groups_keep_their_books_and_reach_every_hard_state():
    reached = base.run_machine(EXAMPLES, 25, GroupsMachine, REACHED)
    assert_reached(reached, HARD_STATES, "KV groups machine")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_kv_groups_machine_long_run():
    reached = base.run_machine(10 * EXAMPLES, 50, GroupsMachine, REACHED)
    assert all(reached[state] for state in HARD_STATES), reached


def test_families_and_prefix_hits_under_groups_answer_as_one_group_and_publish_group_0_only():
    """Samples fork from a leader whose sliding pages wait for them; later requests hit the first ones' prefix with
    the window alone. The outputs are those of one group, and KV events hear group 0's hashes only."""
    def run(groups, faults=None):
        runner = FakeRunner(64, 2, groups.windows if groups else (None,))
        mover = FakeMover(runner, 0) if faults is None else FaultyMover(FakeMover(runner, 0), faults)
        scheduler = make_scheduler(num_blocks=64, block_size=2, max_num_batched_tokens=6, groups=groups, mover=mover)
        heard = []
        scheduler.tiers.device.listener = lambda block_hash, stored: heard.append(block_hash) if stored else None
        prompt = [(3 * i) % 11 for i in range(21)]
        first = drive(scheduler, runner, requests=[make_family("f", prompt, 3, max_tokens=5, block_size=2)])
        second = drive(scheduler, runner, requests=[make_request(f"r{i}", prompt[:13 + 2 * i] + [i], max_tokens=4,
                                                                 block_size=2) for i in range(3)])
        return first, second, scheduler.tiers.stats, set(heard), set(scheduler.tiers.device.hashes())

    groups = KVGroups.for_windows([None, 4, 4])     # the last prompt block starts a new window block
    first, second, stats, heard, indexed = run(groups)
    faults = FaultInjector(every={"copy": 1})          # every sample's copy of the last block fails: it recomputes
    assert (first, second) == run(None)[:2] == run(groups, faults)[:2] and faults.raised["copy"] > 0
    assert stats.window_released > 0 and stats.window_hits > 0 and stats.hit_tokens["device"] > 0, stats
    pages = {group_hash(block_hash, group) for block_hash in heard for group in (1, 2)}
    assert heard and heard.isdisjoint(pages) and indexed & pages    # the other groups' pages: indexed, unheard


def test_sliding_pages_no_likely_hit_reads_are_evicted_first():
    """A finished request's sliding pages before its prompt's last window, or let go while it decoded past it, go
    to the head of the LRU: evicting them all still leaves the same prompt sent again its whole hit."""
    groups = KVGroups.for_windows([None, 4])
    runner = FakeRunner(64, 2, groups.windows)
    scheduler = make_scheduler(num_blocks=64, block_size=2, max_num_batched_tokens=4, groups=groups,
                               mover=FakeMover(runner, 0))
    prompt = [(5 * i) % 13 for i in range(20)]
    first = drive(scheduler, runner, requests=[make_request("a", prompt, max_tokens=8, block_size=2)])
    # 27 tokens computed: group 1 let go of blocks 0-11, kept 7-9 (the window of the 9-block hit of the prompt)
    assert scheduler.tiers.stats.window_released == 12
    evicted = scheduler.tiers.device.evict(9)
    assert not any(page.published for page in evicted)                  # group 1's pages only
    again = drive(scheduler, runner, requests=[make_request("b", prompt, max_tokens=8, block_size=2)])
    assert again["b"] == first["a"] and scheduler.tiers.stats.hit_tokens["device"] == 18


def test_a_request_is_refused_unless_its_every_group_fits_when_it_is_recomputed_whole():
    """Without chunked prefill, a request resumed after a preemption recomputes its whole sequence in one step, and a
    sliding group holds every page of it until the step is done: 8 blocks of 17 tokens need 16 pages, not 15 (a
    pool of 15 accepted it and never finished it: the machine found that)."""
    groups = KVGroups.for_windows([None, 4])
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 0]
    for num_blocks, fits in ((15, False), (16, True)):
        runner = FakeRunner(num_blocks, 2, groups.windows)
        scheduler = make_scheduler(num_blocks=num_blocks, block_size=2, chunked=False, max_num_batched_tokens=24,
                                   max_model_len=24, groups=groups, mover=FakeMover(runner, 0))
        request = make_request("r", prompt, max_tokens=8, block_size=2)
        if not fits:
            with pytest.raises(ValueError, match="KV blocks"):
                scheduler.add_request(request)
            continue
        assert len(drive(scheduler, runner, requests=[request])["r"]) == 8
