"""The embedded default (`make serve`: write-back over host memory and a disk store) keeps its
cache across a restart: after SIGTERM, and after kill -9 of a server that had been idle a second."""

import signal
import time

import httpx
import pytest

from tests.entrypoints.server_helpers import start_server_process

MAKE_SERVE_FLAGS = ("--host-cache-memory", "1GiB", "--store", "disk")
PROMPT = "The history of the river towns, told one year at a time. " * 80      # about 1,100 tokens


def cached_tokens(base: str) -> tuple[int, int]:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    usage = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("stop", [pytest.param("sigterm", marks=pytest.mark.slow), "kill"])   # 22 s each
def test_cache_survives_restart(tmp_path, stop):
    flags = (*MAKE_SERVE_FLAGS, "--store-path", str(tmp_path / "store"))
    proc, base = start_server_process(*flags)
    try:
        prompt_tokens, cached = cached_tokens(base)
        assert prompt_tokens > 1000 and cached == 0
        if stop == "sigterm":
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        else:
            time.sleep(1.0)                     # the README promises what an idle second has written
            proc.kill()
            proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    proc, base = start_server_process(*flags)
    try:
        _, cached = cached_tokens(base)
        assert cached >= prompt_tokens - 32, f"{cached} of {prompt_tokens} prompt tokens came from the store"
    finally:
        proc.kill()
        proc.wait(timeout=60)
