"""The engine thread is the only owner of the engine's state: the HTTP side reads what it publishes.

16 streams run while other clients hammer /metrics, /v1/models and /v1/kv_events. Every method of
the scheduler, the tier manager and the pools is wrapped to note the thread that calls it: none but
the engine thread may, and audit() runs after every step. Each scrape must balance its books
(free + cached + used + in_flight == total), which a half-updated read could not promise.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx

from kvstrata.core.config import EngineConfig
from kvstrata.engine.async_engine import AsyncLLMEngine
from kvstrata.engine.kv_events import EVENT_LOG_CAPACITY
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.entrypoints.openai.api_server import create_app
from tests.entrypoints.server_helpers import MODEL, serving

STREAMS = 16
ENGINE_THREAD = "kvstrata-engine"


class ThreadWatch:
    """Wraps every method of some objects to note calls from threads other than the engine's."""

    def __init__(self) -> None:
        self.calls = 0
        self.foreign: list[str] = []
        self.on = True

    def guard(self, obj: object) -> None:
        for name, member in vars(type(obj)).items():
            if callable(member) and not name.startswith("__"):
                setattr(obj, name, self._wrapped(type(obj).__name__, name, getattr(obj, name)))

    def _wrapped(self, owner: str, name: str, method):
        def call(*args, **kwargs):
            if self.on:
                self.calls += 1
                thread = threading.current_thread().name
                if thread != ENGINE_THREAD:
                    self.foreign.append(f"{owner}.{name} from {thread}")
            return method(*args, **kwargs)
        return call


def books_balance(text: str) -> dict[str, float]:
    """The device tier's blocks by state from one scrape, asserting they add up to the pool."""
    states = {}
    for line in text.splitlines():
        if line.startswith('kvstrata_kv_blocks{') and 'tier="device"' in line:
            state = line.split('state="')[1].split('"')[0]
            states[state] = float(line.rsplit(" ", 1)[1])
    assert set(states) == {"free", "cached", "used", "in_flight"}, states
    return states


async def stream_one(client: httpx.AsyncClient, index: int) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to twenty, take {index}."}],
            "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "error" not in json.loads(line[6:]), line
                chunks += 1
    return chunks


async def hammer(client: httpx.AsyncClient, done: asyncio.Event, seen: dict[str, int], totals: set[float]) -> None:
    seq, instance = 0, None
    while not done.is_set():
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200
        totals.add(sum(books_balance(metrics.text).values()))
        assert (await client.get("/v1/models")).status_code == 200
        params = {"since": seq, **({"instance": instance} if instance else {})}
        events = await client.get("/v1/kv_events", params=params)
        assert events.status_code == 200
        reply = events.json()
        seen["events"] += len(reply["events"]) + len((reply["snapshot"] or {}).get("device", []))
        seq, instance = reply["seq"], reply["instance"]
        seen["rounds"] += 1


def test_http_reads_only_what_the_engine_thread_publishes(smollm2):
    engine = LLMEngine(EngineConfig.from_options(audit_every_step=True, num_device_blocks=256, block_size=16,
                                                 max_num_seqs=16), loaded=smollm2)
    watch = ThreadWatch()
    for part in (engine.scheduler, engine.tiers, engine.tiers.device):
        watch.guard(part)
    engine.tiers.counts()                       # the watch sees a call from this thread...
    assert watch.foreign == ["TierManager.counts from MainThread", "BlockPool.counts from MainThread"]
    watch.foreign.clear()                       # ...and from here on, none may come
    async_engine = AsyncLLMEngine(engine, kv_events_kept=EVENT_LOG_CAPACITY).start()

    async def traffic(base: str) -> tuple[list[int], dict[str, int], set[float]]:
        seen, totals, done = {"events": 0, "rounds": 0}, set(), asyncio.Event()
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            hammers = [asyncio.create_task(hammer(client, done, seen, totals)) for _ in range(3)]
            try:
                chunks = await asyncio.gather(*(stream_one(client, i) for i in range(STREAMS)))
            finally:
                done.set()
            await asyncio.gather(*hammers)
        return chunks, seen, totals

    try:
        with serving(create_app(async_engine, MODEL)) as base:
            chunks, seen, totals = asyncio.run(traffic(base))
            final = httpx.get(f"{base}/metrics").text
    finally:
        watch.on = False
        async_engine.shutdown()
    assert all(count >= 24 for count in chunks), chunks        # every stream ran to its end
    assert seen["rounds"] >= 10 and seen["events"] > 0, seen   # the hammers ran beside the streams
    assert totals == {256.0}, totals                           # every scrape's books balanced
    assert watch.calls > 1000 and watch.foreign == [], watch.foreign[:10]
    assert "kvstrata_audit_failures_total 0.0" in final and engine.stats.audit_failures == 0
    assert engine.stats.steps > 0 and books_balance(final)["used"] == 0
