"""Run a kvstrata server in-process on a free loopback port, for tests."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import IO

import httpx
import pytest
import uvicorn

from kvstrata.core.config import EngineConfig, ServerConfig
from kvstrata.engine.async_engine import AsyncLLMEngine
from kvstrata.engine.kv_events import EVENT_LOG_CAPACITY
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.entrypoints.openai.api_server import create_app

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(app, ready: str = "/health"):
    """Serve an ASGI app on a free loopback port in a thread; yield its base url once `ready` answers
    (or after 10 s); stop it on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{base}{ready}", timeout=1).status_code < 500:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def running_server(loaded, api_key: str | None = None, max_queue: int = 256, faults=None, allowed_origins=(),
                   tracing=None, disaggregation_mode: str = "both", timelines_kept: int = 4096,
                   kv_events_kept: int = EVENT_LOG_CAPACITY, server: dict | None = None, **options):
    """Yield (base_url, engine); on exit, stop the server and the engine thread. `server`: more of
    ServerConfig's options."""
    options.setdefault("kv_cache_memory", "64MiB")
    engine = LLMEngine(EngineConfig.from_options(audit_every_step=True, **options), loaded=loaded, faults=faults)
    async_engine = AsyncLLMEngine(engine, kv_events_kept=kv_events_kept).start()
    try:
        config = ServerConfig(api_key=api_key, max_queue=max_queue, allowed_origins=",".join(allowed_origins) or None,
                              disaggregation_mode=disaggregation_mode, timelines_kept=timelines_kept,
                              **(server or {}))
        with serving(create_app(async_engine, MODEL, config, tracing)) as base:
            yield base, engine
    finally:
        async_engine.shutdown()


def start_server_process(*flags: str, env: dict[str, str] | None = None,
                         log: IO[str] | None = None, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """`kvstrata serve` in a child process on `port` (default: a free one), once /health answers:
    (process, base url).

    Its output goes to a pipe, or to `log` (a file) for a server that logs more than a pipe holds.
    """
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata", "serve", "--port", str(port), *flags],
                            stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if log is None else "the server exited; see its log"
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    pytest.fail("server did not start")


def scrape(base: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (`headers`: the key of a server with one)."""
    values = {}
    for line in httpx.get(f"{base}/metrics", headers=headers).text.splitlines():
        match = re.match(r"^(kvstrata_\S+) (\S+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def wait_idle(engine: LLMEngine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.has_unfinished, "requests still in the engine"


def blocks_at_rest(base: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    metrics = scrape(base, headers)
    return {state: metrics[f'kvstrata_kv_blocks{{state="{state}",tier="device"}}']
            for state in ("free", "cached", "used", "in_flight")}
