"""The front door under hostile input (issue 61): every route but /health keyed, the key checked and
the body size refused before a body is read, a client that stops mid-body answered 408, the expensive
work (tokenizing, templates, grammars, detokenizing) on the intake's workers and never on the event
loop or the engine thread, a text certainly longer than the context refused before it is tokenized,
and the queue limit one reservation: a burst gets exactly --max-queue places. Every probe leaves
nothing held. Timing figures are the benchmark's (benchmarks/front_door.py), not these tests'."""

from __future__ import annotations

import asyncio
import socket
import threading
from urllib.parse import urlparse

import httpx
import pytest

from kvstrata.engine.prompts import PromptEncoder
from tests.entrypoints.server_helpers import blocks_at_rest, running_server, wait_idle

KEY = {"authorization": "Bearer sesame"}


def raw_request(base: str, head: str, body: bytes = b"", timeout: float = 30.0) -> tuple[int, bytes]:
    """Send `head` (request line and headers) and `body` over a socket, as a client no library would
    let misbehave; (status, whole answer)."""
    url = urlparse(base)
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        answer = b""
        while b"\r\n\r\n" not in answer or not _complete(answer):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    length = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    return bool(length) and len(body) >= int(length[0].split(b":")[1])


@pytest.fixture(scope="module")
def keyed(smollm2):
    with running_server(smollm2, api_key="sesame", num_device_blocks=256, block_size=16, max_model_len=2048,
                        server={"max_body_bytes": 1 << 20, "body_timeout": 1.0}) as served:
        yield served


@pytest.mark.parametrize("method,path", [("GET", "/metrics"), ("GET", "/version"), ("GET", "/docs"),
                                         ("GET", "/redoc"), ("GET", "/openapi.json"), ("POST", "/tokenize"),
                                         ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/v1/timelines"),
                                         ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/chat/completions")])
def test_every_route_but_health_needs_the_key(keyed, method, path):
    base, _ = keyed
    refused = httpx.request(method, f"{base}{path}", json={})
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["type"] == "authentication_error"
    assert httpx.request(method, f"{base}{path}", json={}, headers=KEY).status_code != 401
    assert httpx.get(f"{base}/health").status_code == 200


def test_metrics_open_only_by_its_flag(smollm2):
    with running_server(smollm2, api_key="sesame", server={"metrics_without_key": True}) as (base, _):
        assert httpx.get(f"{base}/metrics").status_code == 200
        assert httpx.get(f"{base}/version").status_code == 401


def test_the_key_and_the_size_are_checked_before_the_body_is_read(keyed):
    """A body declared far over the limit, of which nothing is sent: refused at once, 401 without the
    key (the key comes first), 413 with it; a wait for the body would time out instead (408)."""
    base, _ = keyed
    head = "POST /v1/completions HTTP/1.1\nhost: x\ncontent-type: application/json\ncontent-length: 50000000\n"
    status, _ = raw_request(base, head)
    assert status == 401
    status, answer = raw_request(base, head + "authorization: Bearer sesame\n")
    assert status == 413 and b"--max-body-bytes" in answer


def test_a_body_over_the_limit_without_a_length_is_cut_off(keyed):
    base, _ = keyed
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    chunked = hex(len(big))[2:].encode() + b"\r\n" + big + b"\r\n0\r\n\r\n"
    status, _ = raw_request(base, "POST /tokenize HTTP/1.1\nhost: x\ncontent-type: application/json\n"
                                  "transfer-encoding: chunked\nauthorization: Bearer sesame\n", chunked)
    assert status == 413


def test_a_client_that_stops_mid_body_gets_408(keyed):
    base, engine = keyed
    status, _ = raw_request(base, "POST /v1/completions HTTP/1.1\nhost: x\ncontent-type: application/json\n"
                                  "content-length: 400\nauthorization: Bearer sesame\n", b'{"prompt": "Tell me')
    assert status == 408
    wait_idle(engine)
    assert blocks_at_rest(base, KEY)["used"] == 0


class _Calls:
    """Which threads ran the tokenizer's encode and decode."""

    def __init__(self, monkeypatch):
        self.threads: list[str] = []
        for name in ("encode", "decode", "bad_word_sequences"):
            original = getattr(PromptEncoder, name)

            def recorded(encoder, *args, _original=original, **kwargs):
                self.threads.append(threading.current_thread().name)
                return _original(encoder, *args, **kwargs)

            monkeypatch.setattr(PromptEncoder, name, recorded)


def test_the_expensive_work_runs_on_the_intake_workers(keyed, monkeypatch):
    base, engine = keyed
    calls = _Calls(monkeypatch)
    with httpx.Client(base_url=base, headers=KEY, timeout=60) as http:
        assert http.post("/tokenize", json={"prompt": "Once upon a time"}).status_code == 200
        assert http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).status_code == 200
        assert http.post("/detokenize", json={"tokens": [1, 2, 3]}).status_code == 200
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 2, "bad_words": ["Paris", "London"]})
        assert chat.status_code == 200, chat.text
        completion = http.post("/v1/completions", json={"prompt": "Tell me", "max_tokens": 2, "echo": True,
                                                         "prediction": {"type": "content", "content": "a story"}})
        assert completion.status_code == 200, completion.text
        responses = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2})
        assert responses.status_code == 200, responses.text
    assert len(calls.threads) >= 8
    assert all(name.startswith("kvstrata-intake") for name in calls.threads), calls.threads
    wait_idle(engine)


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(keyed, monkeypatch):
    base, _ = keyed
    calls = _Calls(monkeypatch)
    too_long = "x" * (900 << 10)    # under the body limit; no 2,048 tokens of 162 bytes at most cover 900k characters
    with httpx.Client(base_url=base, headers=KEY, timeout=60) as http:
        for path, body in (("/tokenize", {"prompt": too_long}),
                           ("/v1/completions", {"prompt": too_long, "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": too_long}]}),
                           ("/v1/completions", {"prompt": [[5] * 9000], "max_tokens": 2})):
            refused = http.post(path, json=body)
            assert refused.status_code == 400 and "context" in refused.json()["error"]["message"], (path, refused.text)
    assert calls.threads == []
    assert blocks_at_rest(base, KEY)["used"] == 0


def test_bad_words_are_bounded(keyed):
    base, _ = keyed
    refused = httpx.post(f"{base}/v1/completions", headers=KEY,
                         json={"prompt": "Tell me", "max_tokens": 2, "bad_words": ["w"] * 5000})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words"


def test_a_burst_gets_exactly_the_queue_and_503_for_the_rest(smollm2):
    """40 streams at once with --max-queue 8: 8 accepted, 32 answered 503 with Retry-After; a batched
    completion reserves a place for each prompt; nothing is held afterwards."""
    with running_server(smollm2, max_queue=8, num_device_blocks=1024, block_size=16) as (base, engine):
        async def burst():
            async with httpx.AsyncClient(base_url=base, timeout=120) as http:
                # the 8 fit the device cache together, and run for seconds after the burst is answered
                body = {"prompt": "Tell me a story", "max_tokens": 1000, "ignore_eos": True, "stream": True}
                opened = [http.stream("POST", "/v1/completions", json=body) for _ in range(40)]
                answers = await asyncio.gather(*(stream.__aenter__() for stream in opened))
                statuses = [answer.status_code for answer in answers]
                retry = {answer.headers.get("retry-after") for answer in answers if answer.status_code == 503}
                batched = await http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
                for stream in opened:
                    await stream.__aexit__(None, None, None)
                return statuses, retry, batched

        statuses, retry, batched = asyncio.run(burst())
        assert statuses.count(200) == 8 and statuses.count(503) == 32, statuses
        assert retry == {"1"}
        assert batched.status_code == 503       # two places asked for while all 8 are held
        wait_idle(engine)
        at_rest = blocks_at_rest(base)
        assert at_rest["used"] == 0 and at_rest["in_flight"] == 0
        again = httpx.post(f"{base}/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2}, timeout=60)
        assert again.status_code == 200 and len(again.json()["choices"]) == 2
