"""Two `kvstrata serve` processes share one store; a Redis that dies mid-run costs recomputation only."""

import signal
import subprocess
import time

import httpx
import pytest

from tests.entrypoints.server_helpers import start_server_process
from tests.kvcache.stores.store_helpers import redis_server  # noqa: F401  (fixture)

PROMPT = "Shared context: " + "the quick brown fox jumps over the lazy dog. " * 12 + "Now answer:"


def start(store: str, path: str | None = None):
    flags = ["--kv-cache-memory", "64MiB", "--store", store, "--write-policy", "write_through",
             "--host-cache-memory", "16MiB"]
    return start_server_process(*flags, *(["--store-path", path] if path else []))


def complete(base: str) -> dict:
    response = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0},
                          timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


def shared_store_test(store: str, path: str | None) -> None:
    first, base1 = start(store, path)
    try:
        computed = complete(base1)
        time.sleep(0.5)                       # write-through records reach the store off the step loop
        second, base2 = start(store, path)
        try:
            reused = complete(base2)
            assert reused["choices"][0]["text"] == computed["choices"][0]["text"]
            assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
            assert metric(base2, 'kvstrata_prompt_tokens_total{source="store"}') >= 64
        finally:
            stop(second)
    finally:
        stop(first)


@pytest.mark.slow     # 17 s; sharing through Redis stays in the fast suite
def test_two_servers_share_a_disk_store(tmp_path):
    shared_store_test("disk", str(tmp_path))


def test_two_servers_share_redis(redis_server):  # noqa: F811
    shared_store_test(redis_server.url, None)


def test_redis_dying_mid_run_costs_only_recomputation(redis_server):  # noqa: F811
    proc, base = start(redis_server.url)
    try:
        expected = complete(base)["choices"][0]["text"]
        redis_server.kill()
        assert complete(base)["choices"][0]["text"] == expected           # from device memory
        for i in range(3):                                                # new prompts: lookups and writes fail
            fresh = httpx.post(f"{base}/v1/completions", json={"prompt": f"Story {i}: " + PROMPT, "max_tokens": 4,
                                                                  "ignore_eos": True},
                               timeout=120)
            assert fresh.status_code == 200 and fresh.json()["usage"]["completion_tokens"] == 4
        errors = sum(float(line.split()[1]) for line in httpx.get(f"{base}/metrics").text.splitlines()
                     if line.startswith("kvstrata_store_errors_total"))
        assert errors >= 1
        redis_server.start()                                              # Redis comes back, empty
        time.sleep(1.5)                                                   # past the circuit breaker
        client = redis_server.client()
        deadline = time.monotonic() + 30
        while client.dbsize() == 0 and time.monotonic() < deadline:       # new blocks are written again
            httpx.post(f"{base}/v1/completions", json={"prompt": f"Fresh text {time.monotonic()} " * 20,
                                                       "max_tokens": 1}, timeout=120)
        assert client.dbsize() > 0
        assert httpx.get(f"{base}/health").status_code == 200
    finally:
        stop(proc)
