"""Host and store tiers with the fake runner: offload, load-back, faults, and FastDeploy's open paths.

The fake runner checks, on every step, that each position a request attends to holds its real
token: a block loaded from host or store with the wrong content fails the step.
"""

import dataclasses

import pytest

from kvstrata.core.request import RequestStatus
from kvstrata.kvcache.block_pool import BlockState
from kvstrata.kvcache.loads import DAMAGED
from tests.kvcache.fakes import (
    PREFIX,
    FakeMover,
    _BadRecord,
    drive,
    evict_everything,
    loading_again,
    make_request,
    make_tiered_scheduler,
    reference_outputs,
    step,
    unchecked_plan,
)


def test_device_eviction_writes_back_to_host_and_hits_load_back():
    scheduler, runner, executor, _, _ = make_tiered_scheduler(num_blocks=8, num_host_blocks=16, store=False)
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    evict_everything(scheduler, runner, executor, "fill")
    assert scheduler.tiers.stats.offloaded_blocks["host"] >= 4
    again = make_request("b", PREFIX + [98], max_tokens=5)
    outputs = drive(scheduler, runner, executor, [again])
    assert again.num_cached_tokens == 16 and scheduler.tiers.stats.hit_tokens["host"] == 16
    assert outputs["b"] == list(reference_outputs([PREFIX + [98]]).values())[0]


def test_host_eviction_writes_to_store_and_store_hits_load_while_others_run():
    scheduler, runner, executor, _, store = make_tiered_scheduler(num_blocks=8, num_host_blocks=2)
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    evict_everything(scheduler, runner, executor, "fill")
    evict_everything(scheduler, runner, executor, "more")
    assert len(store.records) >= 4
    again = make_request("b", PREFIX + [98], max_tokens=5)
    scheduler.add_request(again)
    step(scheduler, runner)                               # probe answered on the next run of the executor
    executor.run_all()
    step(scheduler, runner)
    assert again.status is RequestStatus.LOADING and scheduler.tiers.audit()["device"].in_flight > 0
    executor.run_all()
    outputs = drive(scheduler, runner, executor, [])
    assert again.num_cached_tokens == 16 and scheduler.tiers.stats.hit_tokens["store"] > 0
    assert again.output_token_ids == list(reference_outputs([PREFIX + [98]]).values())[0]
    assert outputs == {}


@pytest.mark.parametrize("fault, corrupt, reason", [("io", False, None), (None, True, "checksum")])
def test_failed_or_corrupt_loads_fall_back_to_recompute(fault, corrupt, reason):
    scheduler, runner, executor, _, _, again = loading_again()
    executor.run_next(fault=fault, corrupt=corrupt)       # the load itself fails or returns a bad record
    drive(scheduler, runner, executor, [])
    assert again.output_token_ids == list(reference_outputs([PREFIX + [98]]).values())[0]
    stats = scheduler.tiers.stats
    if reason:
        assert stats.load_failures[reason] == 1
    else:
        assert stats.store_errors["io"] >= 1
    counts = scheduler.tiers.audit()["device"]
    assert counts.used == 0 and counts.in_flight == 0


@pytest.mark.parametrize("reason", ["checksum", "hash", "layout", "fingerprint", "version", "tokens"])
def test_a_damaged_record_is_deleted_and_another_engines_is_left(reason, monkeypatch):
    """Either way the load is a miss and the request recomputes; only a record broken in the store goes (a sound
    one of another model, KV format or version belongs to the engines sharing the store with this one)."""
    scheduler, runner, executor, _, store, again = loading_again()
    kept = dict(store.records)

    def refuse(*_):
        raise _BadRecord(reason)
    monkeypatch.setattr(FakeMover, "decode_into", refuse)
    drive(scheduler, runner, executor, [])
    assert again.output_token_ids == list(reference_outputs([PREFIX + [98]]).values())[0]
    assert scheduler.tiers.stats.load_failures[reason] == 1
    lost = set(kept) - set(store.records)
    assert (len(lost) == 1) == (reason in DAMAGED) and len(lost) <= 1


def test_load_past_its_deadline_counts_as_a_miss():
    scheduler, runner, executor, clock, _, again = loading_again()
    clock.now += 5.0                                      # the store hangs past store_timeout
    for _ in range(50):
        if again.is_finished:
            break
        step(scheduler, runner)
    assert again.is_finished and scheduler.tiers.stats.load_failures["timeout"] == 1
    executor.run_all()                                    # the late answer arrives and is ignored
    step(scheduler, runner)
    assert again.output_token_ids == list(reference_outputs([PREFIX + [98]]).values())[0]


@pytest.mark.parametrize("exit_path", ["abort", "preempt"])
def test_abort_or_preempt_during_a_load_leaves_the_blocks_to_the_transfer(exit_path):
    scheduler, runner, executor, _, _, again = loading_again()
    in_flight = scheduler.tiers.audit()["device"].in_flight
    if exit_path == "abort":
        scheduler.finish("b")
    else:
        assert scheduler.preempt("b")
    counts = scheduler.tiers.audit()["device"]
    assert counts.in_flight == in_flight                 # still owned by the transfer record
    executor.run_next()                                   # the load lands after its request let go
    step(scheduler, runner)
    counts = scheduler.tiers.audit()["device"]
    assert counts.in_flight == 0
    if exit_path == "abort":
        assert counts.used == 0 and counts.cached >= in_flight   # loaded blocks went to the cache
    else:
        drive(scheduler, runner, executor, [])
        assert again.output_token_ids == list(reference_outputs([PREFIX + [98]]).values())[0]


def test_write_through_offloads_blocks_as_soon_as_they_are_full():
    scheduler, runner, executor, _, store = make_tiered_scheduler(num_blocks=16, num_host_blocks=8,
                                                                  write_policy="write_through")
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    assert scheduler.tiers.stats.offloaded_blocks["host"] == 4 and len(store.records) == 4


def test_seed_scenario_with_real_store_hits_is_refused_and_changes_nothing():
    """FastDeploy #7890, end to end: 100 free device blocks, a request needing 64 blocks of which 40
    are store hits, 4 running requests reserving 16 blocks each: refused, nothing touched."""
    scheduler, runner, executor, _, store = make_tiered_scheduler(
        num_blocks=120, num_host_blocks=0, block_size=16, max_num_batched_tokens=4096, max_model_len=4096,
        reserve_ratio_init=1.0)
    tiers = scheduler.tiers
    seed = make_request("seed", list(range(5000, 5000 + 1023)), max_tokens=1, block_size=16)
    for index, block_hash in enumerate(seed.block_hashes[:40]):
        store.records[block_hash] = b"record"            # never read: the plan is refused first
    for i in range(4):
        running = make_request(f"run{i}", [1000 * i + t for t in range(80)], max_tokens=256, block_size=16)
        scheduler.add_request(running)
    executor.run_all()                                    # their store lookups answer (no hits)
    step(scheduler, runner)
    assert tiers.device.num_free == 100 and tiers.reserve_for_running() == 64
    assert tiers.prepare(seed) is False
    executor.run_all()
    assert tiers.prepare(seed)
    before = tiers.snapshot()
    plan = unchecked_plan(tiers, seed)
    assert len(plan.load_store) == 40 and plan.num_new_blocks == 24 and plan.reserve == 64
    assert not tiers.fits(plan) and tiers.plan(seed, 4096) is None
    with pytest.raises(RuntimeError, match="does not fit"):
        tiers.commit(plan)
    assert tiers.snapshot() == before and not executor.jobs   # no load was even started


def test_a_plan_with_zero_new_tokens_is_refused_whole():
    """FastDeploy's fix left `num_new_tokens == 0` open: here such a plan cannot be committed."""
    scheduler, runner, executor, _, store = make_tiered_scheduler(num_blocks=16, num_host_blocks=0)
    request = make_request("z", PREFIX + [7], max_tokens=2)
    for block_hash in request.block_hashes:
        store.records[block_hash] = b"record"
    scheduler.tiers.prepare(request)
    executor.run_all()
    assert scheduler.tiers.prepare(request)
    plan = scheduler.tiers.plan(request, 100)
    assert plan.num_new_tokens == 1                       # the last token is always computed
    before = scheduler.tiers.snapshot()
    with pytest.raises(RuntimeError, match="computes nothing"):
        scheduler.tiers.commit(dataclasses.replace(plan, num_new_tokens=0))
    assert scheduler.tiers.snapshot() == before


def test_exception_after_load_targets_are_allocated_rolls_back_whole(monkeypatch):
    """FastDeploy's other open path: an exception after the load targets are allocated."""
    scheduler, runner, executor, _, store = make_tiered_scheduler(num_blocks=16, num_host_blocks=4)
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    request = make_request("b", PREFIX + [1, 2, 3, 4, 5], max_tokens=2)
    for block_hash in request.block_hashes:
        store.records.setdefault(block_hash, b"record")
    evict_everything(scheduler, runner, executor, "fill")
    scheduler.tiers.prepare(request)
    executor.run_all()
    assert scheduler.tiers.prepare(request)
    plan = scheduler.tiers.plan(request, 100)
    assert plan.num_loads > 0
    before, counts = scheduler.tiers.snapshot(with_order=False), scheduler.tiers.audit()

    def boom(*args):
        raise OSError("injected after the load targets were allocated")
    monkeypatch.setattr(scheduler.tiers.loads, "start", boom)
    with pytest.raises(OSError, match="injected"):
        scheduler.tiers.commit(plan)
    assert scheduler.tiers.snapshot(with_order=False) == before
    assert scheduler.tiers.audit() == counts and not scheduler.tiers.holds("b")


def test_in_flight_blocks_are_never_handed_to_the_runner_as_computed():
    scheduler, runner, executor, _, _, again = loading_again()
    output = scheduler.schedule()
    assert all(chunk.request is not again for chunk in output.chunks)
    assert any(b.state is BlockState.IN_FLIGHT for b in scheduler.tiers.device.blocks)
    scheduler.update(output, runner.execute(output))
    drive(scheduler, runner, executor, [])


def test_blocks_this_engine_wrote_since_the_lookup_count_as_store_hits():
    """The lookup answered before the writes landed: the engine still knows it wrote those blocks,
    so the request loads them (the load runs behind the writes) instead of recomputing them."""
    scheduler, runner, executor, _, store = make_tiered_scheduler(num_blocks=8, num_host_blocks=0)
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    for i in range(4):                                    # fillers push a's blocks out; writes stay queued
        scheduler.add_request(make_request(f"fill{i}", [40 + i] * 15, max_tokens=1))
    while scheduler.requests:
        step(scheduler, runner)
        while executor.run_next(call="exists"):
            pass
    again = make_request("b", PREFIX + [98], max_tokens=5)
    scheduler.add_request(again)
    assert executor.run_next(call="exists") and not store.records    # "nothing there yet"
    assert len(unchecked_plan(scheduler.tiers, again).load_store) == 4
    step(scheduler, runner)
    assert again.status is RequestStatus.LOADING
    drive(scheduler, runner, executor, [])
    assert again.num_cached_tokens == 16 and again.output_token_ids == reference_outputs([PREFIX + [98]])["ref0"]


def test_a_lookup_after_the_write_landed_is_trusted_when_the_store_lost_the_record():
    """The store swept the records (its own capacity) after they landed: the lookup, sent later,
    says so, and the engine does not plan loads that would only miss."""
    scheduler, runner, executor, _, store = make_tiered_scheduler(num_blocks=8, num_host_blocks=0)
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    evict_everything(scheduler, runner, executor, "fill")
    again = make_request("b", PREFIX + [98], max_tokens=5)
    assert all(h in store.records for h in again.block_hashes[:4])
    store.records.clear()
    scheduler.add_request(again)
    executor.run_all()
    assert scheduler.tiers.prepare(again) and not unchecked_plan(scheduler.tiers, again).load_store
