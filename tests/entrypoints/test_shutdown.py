"""`kvstrata serve` on SIGTERM: stop accepting, let in-flight requests finish within the timeout,
abort the rest, exit 0."""

import json
import signal

import httpx
import pytest

from tests.entrypoints.server_helpers import start_server_process


def stream_then_signal(proc, base, max_tokens):
    """Start a streaming request, SIGTERM the server after its first chunk, return (text, finish, events)."""
    body = {"prompt": "Tell me a long story.", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events, finish = 0, None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            if events == 1:
                proc.send_signal(signal.SIGTERM)
            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    return finish, events


@pytest.mark.parametrize("timeout, max_tokens, finished", [(60, 24, True), (0.5, 1000, False)],
                         ids=["drains", "cuts-at-timeout"])
def test_sigterm_is_graceful(timeout, max_tokens, finished):
    proc, base = start_server_process("--kv-cache-memory", "64MiB", "--shutdown-timeout", str(timeout))
    try:
        try:
            finish, events = stream_then_signal(proc, base, max_tokens)
        except httpx.RemoteProtocolError:       # the server closed the stream at the deadline
            finish, events = None, 0
        if finished:
            assert finish == "length" and events == max_tokens
        else:
            assert finish != "length"
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{base}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
