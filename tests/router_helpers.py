"""Run `kvstrata router` in-process on a free loopback port, over engines started by the tests."""

from __future__ import annotations

import time
from contextlib import contextmanager

import httpx
from server_helpers import serving

from kvstrata.router import RouterConfig, build_fleet, create_router_app


@contextmanager
def running_router(engines: list[str], tokenizer, policy: str = "kv_aware", wait_for: int | None = None,
                   health_interval: float = 0.2, engine_api_key: str | None = None):
    """Yield (base_url, fleet) once `wait_for` engines (default: all) are in."""
    config = RouterConfig(tuple(engines), policy, health_interval, request_timeout=60, engine_api_key=engine_api_key)
    fleet = build_fleet(config, tokenizer)
    with serving(create_router_app(fleet), ready="/metrics") as base:
        wanted = len(engines) if wait_for is None else wait_for
        deadline = time.monotonic() + 30
        while sum(view.available for view in fleet.views) < wanted:
            assert time.monotonic() < deadline, f"engines in: {[(v.url, v.available) for v in fleet.views]}"
            time.sleep(0.05)
        yield base, fleet


def chat(base: str, messages: list[dict], max_tokens: int = 4, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=timeout,
                      json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
