"""Persistence under write-back: blocks that became full reach the store when the engine is idle
(`TierManager.persist`), so a new process on the same store finds them. Fakes check every KV read."""

from kvstrata.kvcache import store_io as store_io_module
from tests.kvcache.fakes import make_request, make_tiered_scheduler, step

PROMPT = list(range(1, 18))                        # 4 full blocks of 4 tokens, and one token more


def serve(scheduler, runner, executor, request):
    scheduler.add_request(request)
    while scheduler.has_work:
        step(scheduler, runner)
        executor.run_all()
    return request


def test_persisted_blocks_are_hit_by_the_next_process():
    scheduler, runner, executor, _, store = make_tiered_scheduler()
    first = serve(scheduler, runner, executor, make_request("a", PROMPT))
    assert store.records == {}                       # write-back: nothing was evicted, nothing written
    tiers = scheduler.tiers
    assert tiers.num_unpersisted == 5                # 4 prompt blocks and one filled while decoding
    assert tiers.persist(limit=2) == 2 and tiers.num_unpersisted == 3
    assert tiers.persist() == 3 and tiers.num_unpersisted == 0
    executor.run_all()
    assert len(store.records) == 5
    tiers.poll_loads()
    assert not tiers.has_transfers

    # A new process: fresh tiers over the same store.
    again, runner2, executor2, _, _ = make_tiered_scheduler(store=store)
    second = serve(again, runner2, executor2, make_request("b", PROMPT))
    assert second.num_cached_tokens == 16            # every full prompt block, from the store
    assert second.output_token_ids == first.output_token_ids
    again.tiers.audit()


def test_nothing_is_remembered_without_persist_or_written_twice():
    scheduler, runner, executor, _, _ = make_tiered_scheduler(persist=False)
    serve(scheduler, runner, executor, make_request("a", PROMPT))
    assert scheduler.tiers.num_unpersisted == 0 and scheduler.tiers.persist() == 0

    scheduler, runner, executor, _, store = make_tiered_scheduler(write_policy="write_through")
    serve(scheduler, runner, executor, make_request("a", PROMPT))
    assert len(store.records) == 5 and scheduler.tiers.num_unpersisted == 0    # already in the store


def test_persist_waits_instead_of_dropping_when_writes_are_queued(monkeypatch):
    scheduler, runner, executor, _, store = make_tiered_scheduler()
    serve(scheduler, runner, executor, make_request("a", PROMPT))
    tiers = scheduler.tiers
    monkeypatch.setattr(store_io_module, "MAX_PENDING_WRITES", 2)
    started = []
    while tiers.num_unpersisted:
        started.append(tiers.persist())
        executor.run_all()
    assert started == [2, 2, 1] and tiers.stats.dropped_writes == 0 and len(store.records) == 5
