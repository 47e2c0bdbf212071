"""KV groups through the host tier and the store: the tiers' property machine with a global and one or two sliding
groups, faults at every boundary.

Each group's pages go down the tiers keyed apart (`group_hash`) and come back from whichever tier holds them: a
hit needs the global groups' pages of the whole prefix and a sliding group's of its window only. A copy or load
that fails sends the request back to wait (it gives back every page: a sliding group holds nothing before its
window to recompute the failed block from), and its next admission takes device hits only. The fake runner checks
every position each group's rows read holds the request's token, so a page loaded into the wrong place, or read
after it was let go, fails; the audit after every rule checks every pool and every group's table. Each run counts
what it reached and fails on a zero: another group's pages loaded from the host and from the store (a window
reloaded), sliding pages let go, hits served by a window alone, hits cut short to what every group serves,
requests started over after a failed copy or load, requests let go with other groups' pages loading. KV events
hear group 0's hashes only.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, run_state_machine_as_test

from kvstrata.kvcache.faults import FaultInjector
from kvstrata.kvcache.kv_groups import KVGroups
from tests.kvcache import test_tiers_state_machine as tiered
from tests.kvcache.fakes import FakeStore, at_rest, drive, make_request, make_tiered_scheduler
from tests.reached import assert_reached

EXAMPLES = int(os.environ.get("KVSTRATA_TIERS_MACHINE_EXAMPLES", "500"))
GROUP_STATES = ("group_host_load", "group_store_load", "window_released", "window_hit", "window_cut_hit", "restart",
                "group_load_orphaned")


def grouped_machine(reached: Counter) -> type:
    base = tiered.tiered_machine(reached)

    class GroupedTiersMachine(base):
        @initialize(num_blocks=st.integers(12, 30), num_host_blocks=st.integers(0, 12), budget=st.integers(2, 16),
                    write_policy=st.sampled_from(["write_back", "write_through"]), store=st.booleans(),
                    window=st.integers(2, 7), sliding=st.sampled_from([1, 2]))
        def setup(self, num_blocks, num_host_blocks, budget, write_policy, store, window, sliding):
            self.faults = FaultInjector()
            self.groups = KVGroups.for_windows([None] + [window] * sliding)
            self.scheduler, self.runner, self.executor, self.clock, _ = make_tiered_scheduler(
                num_blocks=num_blocks, num_host_blocks=num_host_blocks, store=store, write_policy=write_policy,
                max_num_batched_tokens=budget, max_model_len=24, max_num_seqs=4, reserve_ratio_init=0.3,
                reserve_ratio_min=0.1, faults=self.faults, groups=self.groups)
            self.write_policy = write_policy
            self.next_id = 0
            self.made = []
            self.heard = set()
            self.scheduler.tiers.device.listener = lambda block_hash, stored: self.heard.add(block_hash)
            loads = self.scheduler.tiers.loads
            orphan = loads.orphan

            def counted(rb):                      # an abort or preemption with other groups' pages loading
                if rb.load is not None and rb.load.num_group0 < len(rb.load.targets):
                    self.reach("group_load_orphaned")
                return orphan(rb)
            loads.orphan = counted

        def teardown(self):
            if not hasattr(self, "scheduler"):
                return
            super().teardown()
            group0 = {block_hash for request in self.made for block_hash in request.block_hashes}
            assert self.heard <= group0, "a page of a group other than 0 was published"
            stats = self.scheduler.tiers.stats
            for state, count in (("group_host_load", stats.group_loads["host"]),
                                 ("group_store_load", stats.group_loads["store"]),
                                 ("window_released", stats.window_released), ("window_hit", stats.window_hits),
                                 ("window_cut_hit", stats.window_cut_hits),
                                 ("restart", stats.restarts)):
                if count:
                    self.reach(state)

    return GroupedTiersMachine


def run_machine(examples: int) -> Counter:
    reached: Counter = Counter()
    run_state_machine_as_test(grouped_machine(reached), settings=settings(
        max_examples=examples, stateful_step_count=tiered.STEPS, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))
    return reached


def test_kv_groups_through_every_tier_keep_their_books_under_faults():
    reached = run_machine(EXAMPLES)          # derandomized: at 500 the rarest states come ten times or more
    assert_reached(reached, tiered.HARD_STATES + GROUP_STATES, "grouped tiers machine")


@pytest.mark.slow
def test_kv_groups_tiers_machine_long_run():
    """`make test-slow`: 10^5 steps."""
    reached = run_machine(2500)
    assert all(reached[state] for state in tiered.HARD_STATES + GROUP_STATES), reached


def test_sliding_pages_no_likely_hit_reads_never_go_down_the_tiers():
    """A sliding page let go outside the prompt's last window is evicted first and not copied to the host (it would
    push out pages hits read); the same prompt sent again still hits whole, from the host."""
    groups = KVGroups.for_windows([None, 4])
    scheduler, runner, executor, clock, _ = make_tiered_scheduler(
        num_blocks=64, num_host_blocks=64, block_size=2, store=False, groups=groups, max_num_batched_tokens=4)
    prompt = [(5 * i) % 13 for i in range(20)]
    first = drive(scheduler, runner, executor, [make_request("a", prompt, max_tokens=8, block_size=2)], clock)
    tiers = scheduler.tiers
    evicted = tiers.device.evict(tiers.device.num_cached)
    stale = [item for item in evicted if item.stale]
    tiers.write_back.offload_evicted(evicted)
    assert stale and not any(item.published for item in stale)
    assert tiers.host.num_cached == len(evicted) - len(stale)
    assert not any(tiers.host.contains(item.block_hash) for item in stale)
    again = drive(scheduler, runner, executor, [make_request("b", prompt, max_tokens=8, block_size=2)], clock)
    assert again["b"] == first["a"] and tiers.stats.hit_tokens["host"] == 18


class AskedStore(FakeStore):
    """A FakeStore that keeps the keys of every lookup."""

    def __init__(self):
        super().__init__()
        self.asked: list[list[bytes]] = []

    def exists(self, keys):
        self.asked.append(list(keys))
        return super().exists(keys)


def test_a_lookup_asks_the_store_only_what_the_device_and_host_lack():
    """A conversation's next turn with its last turn on the device: the lookup asks for group 0's new blocks and a
    sliding group's pages from the window of the device's hit on, not every group's every page (on Gemma 3 270M at
    4,000 tokens that was 1,524 keys, the disk store's stat calls on every revisit). The turn still hits what the
    device holds and answers as it does with no store at all."""
    groups = KVGroups.for_windows([None, 4, None, 4])
    store = AskedStore()
    scheduler, runner, executor, clock, _ = make_tiered_scheduler(
        num_blocks=64, num_host_blocks=16, block_size=2, store=store, groups=groups, max_model_len=128)
    prompt = [(7 * i) % 17 + 1 for i in range(30)]
    first = drive(scheduler, runner, executor, [make_request("a", prompt, max_tokens=6, block_size=2)], clock)
    turn = prompt + first["a"] + [3, 1, 4, 1, 5, 9, 2]
    store.asked.clear()
    again = drive(scheduler, runner, executor, [make_request("b", turn, max_tokens=4, block_size=2)], clock)
    limit = (len(turn) - 1) // 2
    local = (len(prompt) + len(first["a"]) - 1) // 2      # the blocks the first turn left on the device
    asked = store.asked[0]
    assert len(asked) == (limit - local) + (limit - groups.first_needed(1, local * 2, 2))
    assert len(asked) < groups.num_groups * limit / 2
    assert scheduler.tiers.stats.hit_tokens["device"] >= local * 2
    plain, plain_runner, plain_executor, plain_clock, _ = make_tiered_scheduler(
        num_blocks=64, num_host_blocks=0, block_size=2, store=False, groups=groups, max_model_len=128)
    alone = drive(plain, plain_runner, plain_executor, [make_request("b", turn, max_tokens=4, block_size=2)],
                  plain_clock)
    assert again["b"] == alone["b"]
    at_rest(scheduler)


def test_the_window_where_a_prompt_left_a_shared_prefix_is_kept():
    """Prompts that share a prefix (a system prompt) and then differ: the first finds nothing cached and its window
    at the prefix's end goes stale; the second finds the prefix's global pages but not that window (cut short), and
    keeps the window where it left the prefix; so the third hits the whole prefix after every page went down to
    the host."""
    groups = KVGroups.for_windows([None, 4])
    scheduler, runner, executor, clock, _ = make_tiered_scheduler(
        num_blocks=64, num_host_blocks=64, block_size=2, store=False, groups=groups, max_num_batched_tokens=4)
    tiers, system = scheduler.tiers, [(5 * i) % 13 + 1 for i in range(12)]       # 6 blocks

    def ask(name: str, first: int) -> list[int]:
        prompt = system + list(range(first, first + 6))
        out = drive(scheduler, runner, executor, [make_request(name, prompt, max_tokens=2, block_size=2)], clock)
        tiers.write_back.offload_evicted(tiers.device.evict(tiers.device.num_cached))    # stale pages dropped
        return out[name]

    ask("a", 20)
    ask("b", 30)
    assert tiers.stats.window_cut_hits == 1 and tiers.stats.hit_tokens["host"] == 0
    third = ask("c", 40)
    assert tiers.stats.window_cut_hits == 1 and tiers.stats.hit_tokens["host"] == len(system)
    plain, plain_runner, plain_executor, plain_clock, _ = make_tiered_scheduler(
        num_blocks=64, num_host_blocks=0, block_size=2, store=False, groups=groups)
    alone = drive(plain, plain_runner, plain_executor, [make_request("c", system + list(range(40, 46)), max_tokens=2,
                                                                     block_size=2)], plain_clock)
    assert third == alone["c"]
    at_rest(scheduler)
