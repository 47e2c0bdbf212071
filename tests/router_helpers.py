"""Run `kvstrata router` in-process on a free loopback port, over engines started by the tests."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from kvstrata.router import RouterConfig, build_fleet, create_router_app
from server_helpers import free_port


@contextmanager
def running_router(engines: list[str], tokenizer, policy: str = "kv_aware", wait_for: int | None = None,
                   health_interval: float = 0.2):
    """Yield (base_url, fleet) once `wait_for` engines (default: all) are in."""
    fleet = build_fleet(RouterConfig(tuple(engines), policy, health_interval, request_timeout=60), tokenizer)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_router_app(fleet), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wanted = len(engines) if wait_for is None else wait_for
    deadline = time.monotonic() + 30
    while sum(view.available for view in fleet.views) < wanted:
        assert time.monotonic() < deadline, f"engines in: {[(v.url, v.available) for v in fleet.views]}"
        time.sleep(0.05)
    try:
        yield base, fleet
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def chat(base: str, messages: list[dict], max_tokens: int = 4, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=timeout,
                      json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
