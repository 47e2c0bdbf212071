"""One streamed completion against an OpenAI-compatible server, timed from the SSE chunks.

The prompt goes to `/v1/completions` as token ids (or as text, for servers that only take
strings), with `stream_options.include_usage` so the server reports prompt, completion and cached
tokens. Servers that send no usage still get measured: output tokens then count the chunks that
carried text, and the cached fraction is unknown. The response's `id` is kept: a kvstrata server
answers `/v1/timelines` by it (tails.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from kvstrata.bench.metrics import RequestResult


@dataclass(frozen=True)
class Target:
    """A server under test."""

    label: str
    base_url: str                  # http://host:port (with or without /v1)
    model: str | None = None       # None: the first model /v1/models lists

    @property
    def api(self) -> str:
        base = self.base_url.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"


@dataclass(frozen=True)
class RequestOptions:
    """Sampling is greedy and the output length fixed (ignore_eos), so every server does the same work."""

    ignore_eos: bool = True
    include_usage: bool = True
    decode: Callable[[Sequence[int]], str] | None = None    # set: send text instead of token ids
    timeout: float = 600.0


async def resolve_model(client: httpx.AsyncClient, target: Target) -> str:
    if target.model:
        return target.model
    response = await client.get(f"{target.api}/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def request_body(model: str, prompt: Sequence[int], max_tokens: int, options: RequestOptions) -> dict:
    body = {"model": model, "prompt": options.decode(prompt) if options.decode else list(prompt),
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict, prompt_len: int, started_at: float) -> RequestResult:
    """POST and read the stream; never raises for what the server or network does (the result says).
    `prompt_len` counts the prompt's tokens until the server's usage says otherwise."""
    result = RequestResult(ok=False, prompt_tokens=prompt_len, start=started_at)
    chunks_with_text = 0
    start = time.perf_counter()
    last: float | None = None                # when the previous chunk with a choice arrived
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if error := chunk.get("error"):
                    result.error = str(error)[:300]
                    return result
                result.request_id = result.request_id or chunk.get("id")
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks_with_text += bool(chunk["choices"][0].get("text"))
                if usage := chunk.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    if last is None:
        result.error = "the stream ended without a token"
        return result
    result.e2el = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks_with_text
    result.ok = True
    return result
