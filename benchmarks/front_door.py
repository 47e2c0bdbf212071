"""Ordinary clients beside an abusive one (issue 61): their TTFT p99 alone and with one bad request a
second beside them, in one run against one `kvstrata serve` (the default model, `--enable-lora`,
`--max-queue 32`, no key: anyone may send anything), then each probe alone beside one ordinary chat.

    .venv/bin/python benchmarks/front_door.py                    # 30 s a phase
    .venv/bin/python benchmarks/front_door.py --seconds 60 --clients 4

The abusive client sends, in turns, one a second: a 12 MB body, a text to /tokenize just under what
the context could hold (it is tokenized), a 30 MB /tokenize, a burst of 40 streams, a runtime adapter
from /etc, 10,000 bad_words, a 5 MB prediction, a nested regex, and a body that never comes. Prints
the ordinary clients' TTFT p50/p99 in each phase and their ratio (the issue's bar: p99 within 1.5x),
then each probe's status and seconds and the chat's seconds beside it (bar: both under 2 s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.servers import kvstrata  # noqa: E402
from kvstrata.core.machine import machine  # noqa: E402

PORT = 8731
ORDINARY = " ".join(f"The river number {k} runs to the sea past the mill." for k in range(16))


def _probes(max_model_len: int) -> list[tuple[str, str, dict | None, bytes | None]]:
    """(name, path, json body, raw body) of each bad request."""
    near = "a " * (max_model_len * 60)       # ~120 characters a token at most here: tokenized, then refused
    return [
        ("12 MB body", "/v1/chat/completions", None, b'{"messages": "' + b"x" * (12 << 20) + b'"}'),
        ("long text to /tokenize", "/tokenize", {"prompt": near}, None),
        ("30 MB /tokenize", "/tokenize", None, b'{"prompt": "' + b"y" * (30 << 20) + b'"}'),
        ("burst of 40 streams", "burst", None, None),
        ("adapter from /etc", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, None),
        ("10,000 bad_words", "/v1/completions", {"prompt": "Hi", "max_tokens": 4,
                                                  "bad_words": [f"w{k}" for k in range(10000)]}, None),
        ("5 MB prediction", "/v1/completions", {"prompt": "Hi", "max_tokens": 4,
                                                 "prediction": {"type": "content", "content": "z" * (5 << 20)}}, None),
        ("nested regex", "/v1/completions", {"prompt": "Hi", "max_tokens": 4,
                                              "structured_outputs": {"regex": "((a|b|c)*(d|e)+){1,40}" * 8}}, None),
        ("a body that never comes", "stall", None, None),
    ]


async def _probe(http: httpx.AsyncClient, path: str, body: dict | None, raw: bytes | None) -> str:
    if path == "burst":
        stream = {"prompt": "Tell me a story", "max_tokens": 16, "stream": True}
        answers = await asyncio.gather(*(http.post("/v1/completions", json=stream) for _ in range(40)))
        return "/".join(f"{sum(a.status_code == s for a in answers)}x{s}" for s in (200, 503))
    if path == "stall":
        return str(await asyncio.to_thread(_raw, http.base_url.port, "/v1/completions", 1000, b'{"prompt": '))
    if raw is not None:         # sent as a client would until the server answers (it refuses without reading)
        return str(await asyncio.to_thread(_raw, http.base_url.port, path, len(raw), raw[:1 << 16]))
    reply = await http.post(path, json=body)
    return str(reply.status_code)


def _raw(port: int, path: str, length: int, start: bytes) -> int:
    """The status a server answers to a body of `length` bytes of which only `start` is sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     f"content-length: {length}\r\n\r\n".encode() + start)
        return int(sock.recv(4096).split(b" ", 2)[1])


async def _ordinary(http: httpx.AsyncClient, stop: float, ttfts: list[float]) -> None:
    body = {"prompt": ORDINARY, "max_tokens": 32, "stream": True, "temperature": 0}
    while time.monotonic() < stop:
        start = time.perf_counter()
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                ttfts.append(float("inf"))
                await reply.aread()
                continue
            first = None
            async for line in reply.aiter_lines():
                if first is None and line.startswith("data:") and '"text"' in line:
                    first = time.perf_counter() - start
        ttfts.append(first if first is not None else float("inf"))


async def _abuser(http: httpx.AsyncClient, stop: float, probes: list, outcomes: dict[str, set]) -> None:
    turn = 0
    tasks = []
    while time.monotonic() < stop:
        name, path, body, raw = probes[turn % len(probes)]
        turn += 1

        async def one(name=name, path=path, body=body, raw=raw) -> None:
            with contextlib.suppress(httpx.HTTPError):
                outcomes.setdefault(name, set()).add(await _probe(http, path, body, raw))

        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(1.0)
    await asyncio.gather(*tasks)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _phase(base: str, seconds: float, clients: int, probes: list | None) -> tuple[list[float], dict]:
    ttfts: list[float] = []
    outcomes: dict[str, set] = {}
    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
        stop = time.monotonic() + seconds
        work = [_ordinary(http, stop, ttfts) for _ in range(clients)]
        if probes is not None:
            work.append(_abuser(http, stop, probes, outcomes))
        await asyncio.gather(*work)
    return ttfts, outcomes


async def _each_probe(base: str, probes: list) -> list[tuple[str, str, float, float]]:
    rows = []
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=200)) as http:
        chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}
        for name, path, body, raw in probes:
            async def timed(coroutine):
                start = time.perf_counter()
                result = await coroutine
                return result, time.perf_counter() - start

            (status, probe_s), (reply, chat_s) = await asyncio.gather(
                timed(_probe(http, path, body, raw)), timed(http.post("/v1/chat/completions", json=chat)))
            rows.append((name, status, probe_s, chat_s if reply.status_code == 200 else float("inf")))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    parser.add_argument("--clients", type=int, default=4, help="ordinary clients, each one request at a time")
    parser.add_argument("--skip", nargs="*", default=[], help="probes to leave out (words of their names)")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    server = kvstrata("kvstrata", PORT, "--enable-lora", "--max-queue", "32")
    with tempfile.TemporaryDirectory() as logs:
        server.start(Path(logs) / "server.log")
        try:
            server.wait_ready()
            base = server.url
            max_model_len = httpx.get(f"{base}/v1/models").json()["data"][0]["max_model_len"]
            probes = [p for p in _probes(max_model_len) if not any(word in p[0] for word in args.skip)]
            asyncio.run(_phase(base, 5, args.clients, None))         # warm-up
            alone, _ = asyncio.run(_phase(base, args.seconds, args.clients, None))
            beside, outcomes = asyncio.run(_phase(base, args.seconds, args.clients, probes))
            rows = asyncio.run(_each_probe(base, probes))
        finally:
            server.stop()
    print(f"\nordinary clients ({args.clients}, 32 tokens each, {args.seconds:.0f} s a phase): TTFT")
    print(f"{'phase':<28}{'requests':>9}{'failed':>8}{'p50 ms':>9}{'p99 ms':>9}")
    for label, ttfts in (("alone", alone), ("beside the abusive client", beside)):
        done = [t for t in ttfts if t != float("inf")]
        print(f"{label:<28}{len(ttfts):>9}{len(ttfts) - len(done):>8}{_quantile(done, 0.5) * 1e3:>9.1f}"
              f"{_quantile(done, 0.99) * 1e3:>9.1f}")
    ratio = _quantile(beside, 0.99) / _quantile(alone, 0.99)
    print(f"p99 beside / alone: {ratio:.2f}x (bar: 1.5x)")
    print("the abusive client's answers: " + "; ".join(f"{name}: {'/'.join(sorted(seen))}"
                                                       for name, seen in outcomes.items()))
    print(f"\n{'probe':<26}{'answer':>12}{'probe s':>9}{'chat s':>8}")
    for name, status, probe_s, chat_s in rows:
        print(f"{name:<26}{status:>12}{probe_s:>9.2f}{chat_s:>8.2f}")


if __name__ == "__main__":
    main()
