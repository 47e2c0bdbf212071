"""Scenarios over the fake tiers that several test files drive: run to completion, push blocks
down, bring a prefix back from the store, and the cache-off reference outputs."""

from kvstrata.core.request import RequestStatus
from tests.kvcache.fakes import (
    FakeRunner,
    make_request,
    make_scheduler,
    make_tiered_scheduler,
    run_all,
    step,
)

PREFIX = list(range(1, 17))                        # 4 full blocks of 4 tokens


def drive(scheduler, runner, executor, requests, fault=None, corrupt=False, max_steps=500):
    """Run requests to completion, letting each queued store call finish after every step."""
    for request in requests:
        scheduler.add_request(request)
    for _ in range(max_steps):
        if not scheduler.has_work:
            break
        step(scheduler, runner)
        while executor.run_next(fault=fault, corrupt=corrupt):
            pass
    assert not scheduler.has_work
    return {r.request_id: r.output_token_ids for r in requests}


def evict_everything(scheduler, runner, executor, tag):
    """Push all cached device blocks out with unrelated prompts."""
    fillers = [make_request(f"{tag}{i}", [40 + i] * 15, max_tokens=1) for i in range(4)]
    drive(scheduler, runner, executor, fillers)


def loading_again():
    """PREFIX served, evicted to the store, then asked for again: the new request is LOADING.

    Returns (scheduler, runner, executor, clock, store, request).
    """
    scheduler, runner, executor, clock, store = make_tiered_scheduler(num_blocks=8, num_host_blocks=0)
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    evict_everything(scheduler, runner, executor, "fill")
    assert store.records
    again = make_request("b", PREFIX + [98], max_tokens=5)
    scheduler.add_request(again)
    executor.run_all()                                    # the lookup finds the records
    step(scheduler, runner)
    assert again.status is RequestStatus.LOADING
    return scheduler, runner, executor, clock, store, again


def reference_outputs(prompts):
    """Each prompt's outputs (5 tokens) with every cache feature off."""
    scheduler = make_scheduler(num_blocks=64, prefix_caching=False)
    return run_all(scheduler, FakeRunner(64, 4), [make_request(f"ref{i}", p, max_tokens=5) for i, p in enumerate(prompts)])
