"""The stand-ins' fidelity to the engine: store records cost the step that encodes or decodes them,
and store calls leave, and lookups are waited for, as the engine's step does."""

from concurrent.futures import Future

import pytest

from kvstrata.kvcache.tiers import PROBE_WAIT_S
from kvstrata.sim.config import SimConfig
from kvstrata.sim.cost_model import CostModel, Link
from kvstrata.sim.simulator import Simulator
from kvstrata.sim.stand_ins import NullMover, SimStore, VirtualClock, VirtualExecutor
from kvstrata.sim.traces import TraceRequest


# ---- store records cost engine time -------------------------------------------------------------
def test_records_encoded_and_decoded_accrue_to_the_step():
    mover = NullMover(Link(0.0, 1e12), block_bytes=100, record_seconds=0.25, decode_seconds=0.5)
    record = mover.encode("device", 0, b"h" * 16, [1])
    mover.decode_into("device", 1, record, b"h" * 16, [1])
    assert mover.take_seconds() == 0.75 and mover.take_seconds() == 0.0
    same = NullMover(Link(0.0, 1e12), block_bytes=100, record_seconds=0.25)
    same.decode_into("device", 1, record, b"h" * 16, [1])
    assert same.take_seconds() == 0.25



def test_a_profile_decodes_records_at_its_decode_link_or_else_its_record_link(tmp_path):
    base = CostModel(source="t", kv_bytes_per_token=10, host_link=Link(0.0, 1e9), store_link=Link(0.0, 1e9),
                     compute=(0.0,) * 12, record_link=Link(1e-3, 160e3))
    assert base.record_seconds(16) == base.record_seconds(16, decode=True) == pytest.approx(2e-3)
    split = CostModel(**{**base.__dict__, "decode_link": Link(0.0, 40e3)})
    split.save(tmp_path / "p.json")
    loaded = CostModel.load(tmp_path / "p.json")
    assert loaded == split and loaded.record_seconds(16) == pytest.approx(2e-3)
    assert loaded.record_seconds(16, decode=True) == pytest.approx(4e-3)



def test_a_store_hit_pays_for_decoding_its_records():
    """As test_simulator.py's store-hit case: C evicts A's 4 blocks to the store, B loads them back.
    Each record costs 1 ms of B's first step per block B loads (or any block its admission evicts)."""
    trace = [TraceRequest(0.0, 1024, 1, (1, 2)), TraceRequest(10.0, 1536, 1, (7, 8, 9)),
             TraceRequest(20.0, 1536, 1, (1, 2, 3))]
    config = SimConfig(block_size=256, device_cache_tokens=1536, store_cache_tokens=None)

    def run(record_link):
        cost = CostModel(source="t", kv_bytes_per_token=1, host_link=Link(0.0, 1e12), store_link=Link(0.5, 1e12),
                         compute=(0.01, 0.001, 0.002, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), record_link=record_link)
        return Simulator(trace, config, cost).run()

    free, paid = run(None), run(Link(1e-3, 1e30))
    extra = paid.records[2].ttft - free.records[2].ttft
    assert paid.to_json()["transfers"]["loaded_blocks"]["store"] == 4
    assert extra >= 4e-3 - 1e-12 and extra == pytest.approx(round(extra / 1e-3) * 1e-3, abs=1e-12)


# ---- store lookups the engine waits for ---------------------------------------------------------
def test_a_lookup_within_the_engines_wait_is_answered_in_the_step_and_charged_to_it():
    """The engine's plan() waits up to PROBE_WAIT_S for a store lookup, so a fast store answers in
    the same step; a slower one defers the request. Loads and deletes are never waited for."""
    clock, posted = VirtualClock(), []
    clock.now = 7.0
    store = SimStore()
    store.put([(b"a", b"a")])

    def run(latency: float) -> tuple[Future, float]:
        executor = VirtualExecutor(clock, Link(latency, 1e9), 100, lambda at, done: posted.append((at, done)),
                                   PROBE_WAIT_S)
        return executor.submit(store.exists, [b"a", b"b"]), executor.take_waited()

    fast, waited = run(1e-3)
    assert fast.done() and fast.result() == [True, False] and waited == pytest.approx(1e-3) and not posted
    slow, waited = run(PROBE_WAIT_S * 2)
    assert not slow.done() and waited == 0.0 and posted[0][0] == pytest.approx(7.0 + PROBE_WAIT_S * 2)
    executor = VirtualExecutor(clock, Link(1e-4, 1e9), 100, lambda at, done: posted.append((at, done)), PROBE_WAIT_S)
    assert not executor.submit(store.get, [b"a"]).done() and not executor.submit(store.delete, [b"a"]).done()
    assert executor.take_waited() == 0.0



def test_a_store_call_is_sent_after_the_engine_threads_work_so_far_in_the_step():
    """schedule() copies host hits and encodes evicted records between one admission's store load and
    the next: a call goes out when the engine thread gets to it, and a lookup's wait counts from then."""
    clock, posted, busy = VirtualClock(), [], [0.0]
    clock.now = 3.0
    store = SimStore()
    executor = VirtualExecutor(clock, Link(1e-3, 1e9), 100, lambda at, done: posted.append((at, done)),
                               PROBE_WAIT_S, busy=lambda: busy[0])
    executor.submit(store.get, [b"a"])
    busy[0] = 0.25
    executor.submit(store.get, [b"b"])
    assert [at for at, _ in posted] == pytest.approx([3.0 + 1e-3 + 1e-7, 3.25 + 1e-3 + 1e-7])
    assert executor.submit(store.exists, [b"a"]).done() and executor.take_waited() == pytest.approx(1e-3 + 1e-7)



def test_a_step_that_only_starts_a_load_keeps_the_engine_busy_while_it_encodes():
    """C's admission loads A's evicted blocks and evicts B's, whose records the engine thread encodes
    (0.1 s each) before it steps again: D, arriving meanwhile, joins C's first step as in the engine,
    rather than running alone in an engine the simulator thought idle."""
    trace = [TraceRequest(0.0, 1024, 1, (1, 2)), TraceRequest(10.0, 1536, 1, (7, 8, 9)),
             TraceRequest(20.0, 1536, 1, (1, 2, 3)), TraceRequest(20.06, 256, 1, (11,))]
    config = SimConfig(block_size=256, device_cache_tokens=2048, store_cache_tokens=None)
    cost = CostModel(source="t", kv_bytes_per_token=1, host_link=Link(0.0, 1e12), store_link=Link(0.05, 1e12),
                     compute=(0.01, 0.001, 0.002, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), record_link=Link(0.1, 1e30))
    result = Simulator(trace, config, cost).run()
    a, b, c, d = result.records
    assert c.cached_tokens == 1024 and result.to_json()["transfers"]["loaded_blocks"]["store"] > 0
    assert d.first_token == c.first_token and d.ttft > 0.3
