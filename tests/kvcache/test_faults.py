"""Each fault site of the tier paths, made to fail where a real failure would: a copy, an encode, a
decode, a store call that raises, hangs or answers with the wrong record. Each costs recomputation
only: outputs equal the cache-off reference, and at rest no block is USED or IN_FLIGHT on any tier.
"""

import pytest

from kvstrata.core.request import RequestStatus
from kvstrata.kvcache.block_pool import BlockState
from kvstrata.kvcache.faults import FaultInjector, InjectedFault
from tests.kvcache.fakes import (
    PREFIX,
    FakeClock,
    at_rest,
    drive,
    evict_everything,
    loading_again,
    make_request,
    make_tiered_scheduler,
    reference_outputs,
    step,
    unchecked_plan,
)

EXPECTED = list(reference_outputs([PREFIX + [98]]).values())[0]


def served_then_evicted(faults, num_host_blocks=16, store=False, write_policy="write_back"):
    """PREFIX served, then pushed off the device (to host, or to the store without a host tier)."""
    scheduler, runner, executor, clock, store_ = make_tiered_scheduler(
        num_blocks=8, num_host_blocks=num_host_blocks, store=store, write_policy=write_policy, faults=faults)
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    evict_everything(scheduler, runner, executor, "fill")
    return scheduler, runner, executor, clock, store_


# ---- copies ---------------------------------------------------------------------------------------
def test_failed_host_hit_copy_unpins_the_host_blocks_and_recomputes():
    """Was: commit() copied host hits after its try, so a raising copy left them USED for good."""
    faults = FaultInjector()
    scheduler, runner, executor, _, _ = served_then_evicted(faults)
    tiers = scheduler.tiers
    again = make_request("b", PREFIX + [98], max_tokens=5)
    scheduler.add_request(again)
    faults.arm("copy", after=1)                 # the admission's offload of evicted blocks goes through
    step(scheduler, runner)
    assert tiers.stats.faults == {"copy": 1} and tiers.host.counts().used == 0
    # the planned chunk (the one token after the hits) now starts at 0: the rest is recomputed next
    assert again.status is RequestStatus.RUNNING and again.num_computed_tokens == 1
    drive(scheduler, runner, executor, [])
    assert again.output_token_ids == EXPECTED and again.num_cached_tokens == 0
    assert tiers.stats.hit_tokens["host"] == 0
    at_rest(scheduler)


def test_failed_host_copy_abandons_the_store_load_queued_behind_it():
    """Host holds the first two blocks of the prefix, the store the last two: with the host copy
    failed, the store blocks would follow blocks that are recomputed, so their load is abandoned."""
    faults = FaultInjector()
    scheduler, runner, executor, _, store = make_tiered_scheduler(
        num_blocks=8, num_host_blocks=8, write_policy="write_through", faults=faults)
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    tiers = scheduler.tiers
    tiers.device.evict(tiers.device.num_cached)     # written through already: host and store hold them
    request = make_request("b", PREFIX + [98], max_tokens=5)
    first, second = (tiers.host.lookup(request.block_hashes[i], PREFIX[4 * i:4 * i + 4]) for i in (0, 1))
    tiers.host.touch([first, second])          # most recently used: the next two host evictions spare them
    tiers.host.free([first, second])
    tiers.host.evict(tiers.host.num_cached - 2)
    assert all(h in store.records for h in request.block_hashes[:4])
    scheduler.add_request(request)
    executor.run_all()                         # the lookup answers: blocks 3 and 4 are in the store
    assert tiers.prepare(request)
    plan = unchecked_plan(tiers, request)
    assert len(plan.load_host) == 2 and len(plan.load_store) == 2
    faults.arm("copy")
    step(scheduler, runner)
    assert request.status is RequestStatus.RUNNING and not tiers.is_loading("b")
    assert tiers.stats.load_failures == {"behind_failed_copy": 1} and tiers.audit()["device"].in_flight == 0
    drive(scheduler, runner, executor, [])
    assert request.output_token_ids == EXPECTED
    at_rest(scheduler)


@pytest.mark.parametrize("path", ["admission", "growth"])
def test_failed_offload_copy_frees_the_host_slots(path):
    """Was: _offload_evicted took host slots, then a raising copy left them USED (from commit and grow)."""
    faults = FaultInjector()
    scheduler, runner, executor, _, _ = make_tiered_scheduler(num_blocks=8, num_host_blocks=16, store=False,
                                                              faults=faults)
    tiers = scheduler.tiers
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    faults.arm("copy")
    if path == "admission":
        evict_everything(scheduler, runner, executor, "fill")
    else:                                      # one request grows into the cached blocks, evicting them
        drive(scheduler, runner, executor, [make_request("long", [45] * 3, max_tokens=26)])
    assert tiers.stats.faults == {"copy": 1} and tiers.host.counts().used == 0
    again = make_request("b", PREFIX + [98], max_tokens=5)
    drive(scheduler, runner, executor, [again])
    assert again.output_token_ids == EXPECTED
    at_rest(scheduler)


@pytest.mark.parametrize("site, num_host_blocks", [("copy", 8), ("encode", 0)])
def test_failed_write_through_does_not_stall_the_request(site, num_host_blocks):
    """Was: update() advanced the ledger, then a raising write-through left the request with
    nothing to compute, and every later step failed."""
    faults = FaultInjector()
    scheduler, runner, executor, _, store = make_tiered_scheduler(
        num_blocks=16, num_host_blocks=num_host_blocks, write_policy="write_through", faults=faults)
    faults.arm(site)
    request = make_request("b", PREFIX + [98], max_tokens=5)
    drive(scheduler, runner, executor, [request])
    assert request.output_token_ids == EXPECTED and scheduler.tiers.stats.faults == {site: 1}
    assert len(store.records) == 4               # 5 full blocks; the failed one never reached the store
    at_rest(scheduler)


# ---- store writes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("failure", ["put_raises", "encode_raises", "put_hangs"])
def test_a_write_that_failed_is_written_again_on_a_later_eviction(failure):
    """Was: a failed write marked the hash as stored for good. A put that hangs has a deadline:
    the engine stops waiting for it, instead of staying busy forever."""
    faults = FaultInjector()
    scheduler, runner, executor, clock, store = make_tiered_scheduler(num_blocks=8, num_host_blocks=0,
                                                                      faults=faults)
    tiers = scheduler.tiers
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    if failure == "encode_raises":
        faults.arm("encode", 4)
    evict_everything(scheduler, runner, executor, "fill") if failure == "encode_raises" else None
    if failure != "encode_raises":
        for i in range(4):
            scheduler.add_request(make_request(f"fill{i}", [40 + i] * 15, max_tokens=1))
        while scheduler.requests:
            step(scheduler, runner)
            while executor.run_next(call="exists"):
                pass
            while executor.run_next(fault="io", call="put") if failure == "put_raises" \
                    else executor.hang_next():
                pass
        if failure == "put_hangs":
            assert scheduler.has_work            # the writes are out...
            clock.now += 5.0
            step(scheduler, runner)
            assert not scheduler.has_work        # ...and past their deadline nobody waits for them
            assert tiers.stats.store_errors["timeout"] >= 4
    assert not any(h in store.records for h in make_request("x", PREFIX).block_hashes)
    drive(scheduler, runner, executor, [make_request("a2", PREFIX + [99], max_tokens=2)])
    evict_everything(scheduler, runner, executor, "more")
    assert all(h in store.records for h in make_request("x", PREFIX).block_hashes)
    at_rest(scheduler)


# ---- store loads and lookups ----------------------------------------------------------------------
def test_a_load_past_its_deadline_is_counted_once():
    """Was: a timed-out load counted as both `timeout` and `missing`."""
    scheduler, runner, executor, clock, _, again = loading_again()
    clock.now += 5.0
    drive(scheduler, runner, executor, [])
    assert scheduler.tiers.stats.load_failures == {"timeout": 1}
    assert again.output_token_ids == EXPECTED


def test_a_store_answering_with_another_keys_record_is_a_miss():
    scheduler, runner, executor, _, store, again = loading_again()
    assert executor.run_next(swap=True, call="get")
    drive(scheduler, runner, executor, [])
    assert scheduler.tiers.stats.load_failures == {"hash": 1}
    assert again.output_token_ids == EXPECTED
    at_rest(scheduler)


def test_a_decode_that_raises_keeps_the_record_and_recomputes():
    """A failure writing a good record into a block is not the record's fault: it is kept."""
    faults = FaultInjector()
    scheduler, runner, executor, _, store = make_tiered_scheduler(num_blocks=8, num_host_blocks=0, faults=faults)
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    evict_everything(scheduler, runner, executor, "fill")
    again = make_request("b", PREFIX + [98], max_tokens=5)
    scheduler.add_request(again)
    executor.run_all()
    step(scheduler, runner)
    assert again.status is RequestStatus.LOADING
    records = dict(store.records)
    faults.arm("decode")
    drive(scheduler, runner, executor, [])
    stats = scheduler.tiers.stats
    assert stats.load_failures == {"decode": 1} and stats.faults == {"decode": 1}
    assert store.records.keys() >= records.keys() and again.output_token_ids == EXPECTED
    at_rest(scheduler)


def test_a_hung_lookup_is_waited_for_once_then_refreshed_in_the_background():
    """Was: every step re-asked a hung store and waited a full store_timeout for each answer."""
    scheduler, runner, executor, clock, _ = served_then_evicted(None, num_host_blocks=0, store=True)
    tiers = scheduler.tiers
    request = make_request("b", PREFIX + [98], max_tokens=5)
    scheduler.add_request(request)                # its first lookup goes out...
    assert executor.hang_next() and not tiers.prepare(request)
    clock.now += 1.5                              # ...and never answers: past store_timeout, "no hits"
    assert tiers.prepare(request) and tiers.stats.store_errors == {"timeout": 1}
    for _ in range(3):                            # later steps refresh in the background, never waiting
        tiers.on_step(nonempty=False)
        tiers.on_step(nonempty=False)
        assert tiers.prepare(request)
        executor.hang_next()
    assert tiers.stats.store_errors == {"timeout": 1}
    drive(scheduler, runner, executor, [], )
    assert request.output_token_ids == EXPECTED


# ---- the transaction and its callers --------------------------------------------------------------
def test_commit_refuses_a_plan_whose_request_was_aborted_meanwhile():
    scheduler, runner, executor, _, _ = served_then_evicted(None)
    request = make_request("b", PREFIX + [98], max_tokens=5)
    scheduler.add_request(request)
    plan = scheduler.tiers.plan(request, 100)
    scheduler.finish("b")
    before = scheduler.tiers.snapshot()
    with pytest.raises(RuntimeError, match="not waiting"):
        scheduler.tiers.commit(plan)
    assert scheduler.tiers.snapshot() == before and not scheduler.tiers.holds("b")


def test_an_exception_inside_commit_leaves_scheduler_and_tiers_in_step(monkeypatch):
    """Was: the scheduler marked a request admitted only after commit() returned, so an exception
    after blocks were taken left it WAITING while the tiers held them."""
    scheduler, runner, executor, _, _ = served_then_evicted(None, num_host_blocks=0, store=True)
    tiers = scheduler.tiers
    request = make_request("b", PREFIX + [98], max_tokens=5)
    scheduler.add_request(request)
    executor.run_all()

    def boom(*args):
        raise InjectedFault("executor", 1)
    monkeypatch.setattr(tiers.loads, "start", boom)
    with pytest.raises(InjectedFault):
        scheduler.schedule()
    assert scheduler.in_step == [request] and request.status is RequestStatus.WAITING
    assert not tiers.holds("b")
    scheduler.audit()
    monkeypatch.undo()
    drive(scheduler, runner, executor, [])
    assert request.output_token_ids == EXPECTED
    at_rest(scheduler)


def test_fault_specs_are_parsed_and_checked():
    faults = FaultInjector.parse("copy=3, execute=2")
    assert faults.every == {"copy": 3, "execute": 2}
    outcomes = []
    for _ in range(6):
        try:
            faults.check("copy")
            outcomes.append(True)
        except InjectedFault:
            outcomes.append(False)
    assert outcomes == [True, True, False, True, True, False] and faults.raised["copy"] == 2
    assert FaultInjector.from_env({}) is None
    for bad in ("copy", "copy=x", "disk=3", "copy=0"):
        with pytest.raises(ValueError):
            FaultInjector.parse(bad)


def test_hung_futures_never_leave_blocks_in_flight():
    """Executor futures that never finish: a load and an orphaned load settle at their deadline."""
    scheduler, runner, executor, clock, _, again = loading_again()
    assert executor.hang_next()                   # the load's get never answers
    scheduler.finish("b")                         # and its request lets go: an orphaned load
    assert scheduler.tiers.audit()["device"].in_flight > 0 and scheduler.has_work
    clock.now += 5.0
    step(scheduler, runner)
    assert not scheduler.has_work and scheduler.tiers.stats.load_failures == {"timeout": 1}
    at_rest(scheduler)
    assert all(b.state in (BlockState.FREE, BlockState.CACHED) for b in scheduler.tiers.device.blocks)
    assert isinstance(clock, FakeClock)
