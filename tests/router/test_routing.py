"""Routing policies over engine views: the simulator's views (read from its schedulers) and the
router's (built from KV events) lead the same policy to the same decisions; KV event log bounds."""

from __future__ import annotations

import pytest

from kvstrata.engine.kv_events import EngineLoad, KVEventLog, KVEventRecorder
from kvstrata.router.event_view import EventView
from kvstrata.router.policies import POLICIES, RoutedPrompt, make_policy
from kvstrata.sim.config import SimConfig
from kvstrata.sim.routing import SchedulerView
from kvstrata.sim.simulator import Simulator
from kvstrata.sim.traces import read_mooncake
from tests.sim.test_simulator import fixed_cost, synthetic_trace


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("capacity", [1 << 16, 16])       # 16: routers fall behind and take snapshots
def test_simulator_and_router_make_the_same_decisions(tmp_path, policy, capacity):
    """One simulation, two deciders per arrival: the simulator's router over its schedulers, and the
    `kvstrata router` side (its own policy object) over EventViews fed by the engines' KV events."""
    trace = read_mooncake(synthetic_trace(tmp_path / "trace.jsonl", sessions=30, gap_ms=20, max_live=16),
                          max_input_tokens=3000, max_output_tokens=8)
    config = SimConfig(block_size=64, device_cache_tokens=4096, host_cache_tokens=4096, store_cache_tokens=0,
                       instances=3, router=policy)
    sim = Simulator(trace, config, fixed_cost(per_prefill_token=2e-5, per_decode=1e-3))
    recorders = [KVEventRecorder([("device", engine.scheduler.tiers.device), ("host", engine.scheduler.tiers.host)])
                 for engine in sim.engines]
    logs = [KVEventLog(64, sim.tokens.hasher.root, recorder.held, capacity) for recorder in recorders]
    loads = [SchedulerView(engine.scheduler) for engine in sim.engines]
    views = [EventView(f"engine-{index}", available=True) for index in range(len(logs))]
    router_policy = make_policy(policy, sim.tokens.per_trace_block)
    simulated_route = sim.router.route
    decisions, predicted, snapshots = [], 0, 0

    def both(request):
        nonlocal predicted, snapshots
        for view, log, recorder, load in zip(views, logs, recorders, loads):
            log.publish(recorder.take(), EngineLoad(load.num_requests(), load.queued_prompt_tokens()))
            reply = log.since(view.seq, view.instance)
            snapshots += reply["snapshot"] is not None and view.instance is not None
            view.apply(reply)
        routed = router_policy.route(RoutedPrompt(request.num_tokens, request.block_hashes, 64), views)
        predicted += routed.predicted_hit_tokens
        decisions.append((simulated_route(request), routed.engine))
        return decisions[-1][0]

    sim.router.route = both
    sim.run()
    assert len(decisions) == len(trace)
    assert [mine for mine, _ in decisions] == [theirs for _, theirs in decisions]
    assert len({mine for mine, _ in decisions}) >= 2                 # a real choice was made
    assert predicted > 0
    assert (snapshots > 0) == (capacity == 16)


def test_event_log_is_bounded_and_falls_back_to_a_snapshot():
    log = KVEventLog(16, b"\0" * 16, {}, capacity=4)
    hashes = [bytes([i]) * 16 for i in range(6)]
    log.publish([("device", True, h) for h in hashes[:3]], EngineLoad(1, 80))
    log.publish([("device", True, h) for h in hashes[3:]] + [("device", False, hashes[0])], EngineLoad(2, 40))
    # events 1..7; the ring keeps 4..7
    behind = log.since(1, log.instance)
    assert sorted(behind["snapshot"]["device"]) == sorted(h.hex() for h in hashes[1:])
    assert behind["snapshot"]["host"] == [] and behind["seq"] == 7 and behind["events"] == []
    recent = log.since(5, log.instance)
    assert recent["snapshot"] is None and recent["seq"] == 7
    assert recent["events"] == [[6, "device", 1, hashes[5].hex()], [7, "device", 0, hashes[0].hex()]]
    assert recent["load"] == {"num_requests": 2, "queued_prompt_tokens": 40}
    assert log.since(7, log.instance)["events"] == []
    assert log.since(5, "another-instance")["snapshot"] is not None     # a restarted engine: start again
    assert log.since(9, log.instance)["snapshot"] is not None           # ahead of the log: the same
    view = EventView("engine")
    view.apply(behind)
    view.apply(log.since(view.seq, view.instance))
    assert view.held["device"] == set(hashes[1:]) and view.num_requests() == 2


def test_a_router_config_refuses_a_negative_local_prefill():
    from kvstrata.router.fleet import RouterConfig

    pd = {"prefill": ("http://127.0.0.1:1",), "decode": ("http://127.0.0.1:2",)}
    assert RouterConfig((), local_prefill_tokens=512, **pd).validate().local_prefill_tokens == 512
    with pytest.raises(ValueError, match="--local-prefill-tokens must be 0"):
        RouterConfig((), local_prefill_tokens=-1, **pd).validate()
    with pytest.raises(ValueError, match="local_prefill_tokens must be 0"):
        SimConfig(local_prefill_tokens=-1).validate()
