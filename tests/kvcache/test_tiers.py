"""TierManager: pure plans, all-or-nothing commits, the admission rule with its reservation."""

import dataclasses

import pytest

from kvstrata.core.config import CacheConfig
from kvstrata.core.hashing import hash_block
from kvstrata.core.request import RequestStatus
from kvstrata.kvcache.tiers import TierManager
from tests.kvcache.fakes import make_request, unchecked_plan


def manager(num_blocks=16, block_size=4, **cache):
    return TierManager(CacheConfig(block_size=block_size, num_device_blocks=num_blocks, **cache), num_blocks)


def admit(tm, request, budget=1000):
    plan = tm.plan(request, budget)
    assert plan is not None
    tm.commit(plan)
    request.status = RequestStatus.RUNNING
    return plan


def compute(tm, request, n):
    request.num_computed_tokens += n
    tm.cache_full_blocks(request)


def test_plan_is_pure():
    tm = manager()
    first = make_request("a", list(range(10)))
    admit(tm, first)
    compute(tm, first, 10)
    before = tm.snapshot()
    plan = tm.plan(make_request("b", list(range(10)) + [99]), 100)
    assert plan is not None and len(plan.hit_blocks) == 2
    assert tm.snapshot() == before


def test_commit_takes_hits_and_new_blocks():
    tm = manager()
    first = make_request("a", list(range(9)))
    admit(tm, first)
    compute(tm, first, 9)
    tm.release(first)                                  # blocks 1, 0 cached; block 2 free
    second = make_request("b", list(range(8)) + [42, 43])
    plan = admit(tm, second)
    assert [b.block_id for b in plan.hit_blocks] == [0, 1]
    assert plan.num_touched_cached == 2 and plan.num_new_blocks == 1
    assert second.num_computed_tokens == 8 and second.num_cached_tokens == 8
    assert tm.block_ids("b") == [0, 1, 3]
    tm.audit()


def test_full_prefix_hit_recomputes_the_last_token():
    tm = manager()
    first = make_request("a", list(range(8)))
    admit(tm, first)
    compute(tm, first, 8)
    tm.release(first)
    again = make_request("b", list(range(8)))
    plan = admit(tm, again)
    assert len(plan.hit_blocks) == 1 and plan.num_new_tokens == 4   # block 2 recomputed for its logits


def test_refused_admission_changes_nothing():
    tm = manager(num_blocks=6, reserve_ratio_init=1.0)
    runner = make_request("run", list(range(8)), max_tokens=8)
    admit(tm, runner)
    compute(tm, runner, 8)
    before = tm.snapshot()
    assert tm.plan(make_request("big", list(range(100, 116)), max_tokens=1), 100) is None
    assert tm.snapshot() == before


def test_stale_plan_is_refused():
    tm = manager()
    plan = tm.plan(make_request("a", list(range(6))), 100)
    admit(tm, make_request("b", list(range(50, 56))))
    with pytest.raises(RuntimeError, match="stale"):
        tm.commit(plan)


def test_exception_during_commit_rolls_back_everything(monkeypatch):
    tm = manager(num_blocks=5)
    first = make_request("a", list(range(12)))
    admit(tm, first)
    compute(tm, first, 12)
    tm.release(first)                                  # 3 cached, 2 free
    before = tm.snapshot(with_order=False)
    counts = tm.audit()

    def boom(*args):
        raise OSError("injected fault after the blocks were allocated")
    monkeypatch.setattr(tm.loads, "start", boom)
    request = make_request("b", list(range(8)) + [70, 71, 72, 73, 74, 75, 76])
    plan = tm.plan(request, 100)
    assert plan.num_new_blocks == 2 and len(plan.hit_blocks) == 2 and plan.num_touched_cached == 2
    with pytest.raises(OSError, match="injected"):
        tm.commit(plan)
    assert tm.snapshot(with_order=False) == before
    assert tm.audit() == counts
    assert not tm.holds("b")


def test_rollback_restores_evicted_blocks(monkeypatch):
    tm = manager(num_blocks=3, reserve_ratio_init=0.0, reserve_ratio_min=0.0)
    first = make_request("a", list(range(12)))
    admit(tm, first)
    compute(tm, first, 12)
    tm.release(first)                                  # all 3 cached, none free
    before = tm.snapshot(with_order=False)
    monkeypatch.setattr(tm.loads, "start", lambda *args: 1 / 0)
    plan = tm.plan(make_request("b", list(range(200, 209))), 100)   # needs 3 blocks: evicts all
    with pytest.raises(ZeroDivisionError):
        tm.commit(plan)
    assert tm.snapshot(with_order=False) == before


def test_seed_scenario_lower_tier_hits_plus_reservation_is_refused():
    """The FastDeploy #7890 numbers: 100 free blocks, a request needing 64 of which 40 are
    lower-tier hits, 4 running requests reserving 16 blocks each. The weak check (64 <= 100)
    would admit it; counting everything (40 loads + 24 new + 64 reserve = 128) refuses it."""
    block_size = 16
    tm = manager(num_blocks=120, block_size=block_size, reserve_ratio_init=1.0)
    for i in range(4):
        running = make_request(f"run{i}", [1000 * i + t for t in range(80)], max_tokens=256,
                               block_size=block_size)
        admit(tm, running)
        compute(tm, running, 80)                      # 5 full blocks each, 20 in all
    assert tm.device.num_free == 100 and tm.reserve_for_running() == 64
    request = make_request("seed", list(range(5000, 5000 + 1023)), max_tokens=1, block_size=block_size)
    device_plan = tm.plan(request, 4096)
    assert device_plan is None                        # device-only: 64 new + 64 reserve > 100
    # Express the 40 lower-tier hits in the plan, as the tiers issue's matching will.
    plan = dataclasses.replace(unchecked_plan(tm, request),
                               load_store=request.block_hashes[:40], num_new_blocks=24)
    assert plan.num_blocks_taken == 64 and plan.reserve == 64
    assert plan.num_blocks_taken <= tm.device.num_free     # what the weak check looked at
    assert not tm.fits(plan)
    before = tm.snapshot()
    with pytest.raises(RuntimeError, match="does not fit"):
        tm.commit(plan)
    assert tm.snapshot() == before
    tm.audit()


def test_reservation_decays_per_step_and_resets_on_preemption():
    tm = manager(reserve_ratio_init=0.5, reserve_ratio_min=0.2, reserve_ratio_decay=0.1)
    tm.reservation.on_step()
    tm.reservation.on_step()
    assert tm.reservation.ratio == pytest.approx(0.3)
    for _ in range(10):
        tm.reservation.on_step()
    assert tm.reservation.ratio == pytest.approx(0.2)
    tm.reservation.on_preemption()
    assert tm.reservation.ratio == 0.5


def test_reservation_counts_pending_prompt_and_scaled_decode():
    tm = manager(num_blocks=64, reserve_ratio_init=0.5)
    request = make_request("a", list(range(20)), max_tokens=16)
    admit(tm, request, budget=6)                       # chunk of 6 tokens: 2 blocks, 2 free slots
    # pending prompt 14 + ceil(16 * 0.5) = 22 tokens, minus 2 free slots = 20 -> 5 blocks
    assert tm.reserve_for_running() == 5


def test_hash_chain_matches_across_requests():
    a = make_request("a", [5, 6, 7, 8, 9])
    assert a.block_hashes == [hash_block(a.hasher.root, [5, 6, 7, 8])]
    b = make_request("b", [5, 6, 7, 8, 1])
    assert a.block_hashes == b.block_hashes


def test_prefix_caching_off_never_hits():
    tm = manager(enable_prefix_caching=False)
    first = make_request("a", list(range(9)))
    admit(tm, first)
    compute(tm, first, 9)
    tm.release(first)
    assert tm.device.num_cached == 0
    plan = tm.plan(make_request("b", list(range(9))), 100)
    assert plan.hit_blocks == []
