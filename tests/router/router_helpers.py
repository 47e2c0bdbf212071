"""Run `kvstrata router` in-process on a free loopback port, over engines started by the tests."""

from __future__ import annotations

import time
from contextlib import contextmanager

import httpx

from kvstrata.core.front_door import DoorRules
from kvstrata.router.fleet import RouterConfig, build_fleet
from kvstrata.router.proxy import create_router_app
from tests.entrypoints.server_helpers import serving


@contextmanager
def running_router(engines: list[str], tokenizer, policy: str = "kv_aware", wait_for: int | None = None,
                   health_interval: float = 0.2, engine_api_key: str | None = None, api_key: str | None = None,
                   door: DoorRules | None = None, **disaggregated):
    """Yield (base_url, fleet) once `wait_for` engines (default: all) are in. `disaggregated`: the
    RouterConfig's prefill and decode engines (and handoff_timeout), with `engines` empty."""
    config = RouterConfig(tuple(engines), policy, health_interval, request_timeout=60, engine_api_key=engine_api_key,
                          api_key=api_key, **disaggregated)
    fleet = build_fleet(config, tokenizer)
    with serving(create_router_app(fleet, door), ready="/metrics") as base:
        wanted = len(config.all_engines) if wait_for is None else wait_for
        deadline = time.monotonic() + 30
        while sum(view.available for view in fleet.views) < wanted:
            assert time.monotonic() < deadline, f"engines in: {[(v.url, v.available) for v in fleet.views]}"
            time.sleep(0.05)
        yield base, fleet


def chat(base: str, messages: list[dict], max_tokens: int = 4, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=timeout,
                      json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})


def fake_engine(behaviour: str):
    """An engine's HTTP surface without a model, for failures a real one will not produce on cue.

    behaviour: "refuse" answers every generation with 503; "break" starts a stream, then drops the
    connection and stays dead (its /health answers 503 after that, or the router's watcher would rightly
    bring it back in); "ok" streams one chunk and [DONE]. Its KV events always say it holds nothing.
    """
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    died = []

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "dead"}, status_code=503) if died else {"status": "ok"}

    @app.get("/v1/kv_events")
    async def kv_events(timeout: float = 0.0):
        await asyncio.sleep(min(timeout, 0.2))
        return {"instance": "fake", "seq": 0, "block_size": 16, "hash_root": "00" * 16, "events": [],
                "snapshot": {"device": [], "host": []}, "load": {"num_requests": 0, "queued_prompt_tokens": 0}}

    @app.post("/v1/chat/completions")
    async def chat():
        if behaviour == "refuse":
            return JSONResponse({"error": {"message": "at capacity"}}, status_code=503)

        async def chunks():
            yield b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'
            if behaviour == "break":
                died.append(True)
                raise RuntimeError("the engine died mid-stream")
            yield b"data: [DONE]\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app
