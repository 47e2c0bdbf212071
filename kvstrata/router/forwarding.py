"""Sending one request body to an engine of a group and relaying its answer, with failover: an engine
that does not answer or answers 503 is taken out and the next choice gets the request; a stream that
breaks after it started ends with an OpenAI error event and [DONE] (its tokens cannot be taken back).
A client that leaves while the router waits closes the engine's connection, which aborts the request
there (`ClientGone`)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvstrata.core.disconnects import ClientGone, unless_disconnected
from kvstrata.router.event_view import EventView
from kvstrata.router.fleet import EngineGroup, Fleet
from kvstrata.router.policies import NoEngineAvailable, RoutedPrompt

ENGINE_HEADER = "x-kvstrata-engine"      # on every routed reply: the engine that served it
CLIENT_GONE = 499                        # the status logged for a client that left (nginx's)


def error(status: int, message: str, code: str) -> JSONResponse:
    kind = "overloaded_error" if status == 503 else "internal_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status)


def error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "internal_error", "param": None, "code": "engine_failed"}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def read_body(request: Request) -> tuple[bytes, Any]:
    """The client's body as it came (forwarded byte for byte) and parsed (None if it is not JSON: the
    engine answers that with its own error)."""
    raw = await request.body()
    try:
        return raw, json.loads(raw)
    except ValueError:
        return raw, None


async def forward(fleet: Fleet, request: Request, path: str, raw: bytes, prompt: RoutedPrompt,
                  group: EngineGroup) -> Response:
    """Send `raw` to the group's policy's engine; if that one is down or refuses, to the next choice.
    ClientGone if the client leaves before the answer (or the stream) starts."""
    for _ in group.views:
        try:
            view, decision = fleet.choose(prompt, group)
        except NoEngineAvailable:
            break
        sent_tokens = prompt.num_tokens - decision.predicted_hit_tokens
        view.sent_requests += 1
        view.sent_tokens += sent_tokens

        def settle(outcome: str, view: EventView = view, sent_tokens: int = sent_tokens) -> None:
            view.sent_requests -= 1
            view.sent_tokens -= sent_tokens
            fleet.metrics.requests.labels(view.url, outcome).inc()

        try:
            upstream = await unless_disconnected(request.is_disconnected, fleet.client.send(
                fleet.client.build_request("POST", f"{view.url}{path}", content=raw,
                                           headers=fleet.headers_for_engine(request.headers)), stream=True))
        except ClientGone:
            settle("client_gone")
            raise
        except httpx.TransportError as exc:
            settle("retried")
            fleet.take_out(view, f"{type(exc).__name__}: {exc}")
            continue
        if upstream.status_code == 503:
            await upstream.aclose()
            settle("retried")
            fleet.take_out(view, "it answered 503")
            continue
        media_type = upstream.headers.get("content-type", "")
        if media_type.startswith("text/event-stream"):
            # Started here, so that its `finally` (settle, close the upstream) runs even if the client
            # leaves before the reply begins: the event loop's async-generator hook closes it then.
            relay = _relay(fleet, view, upstream, settle)
            first = await anext(relay, b"")
            return StreamingResponse(_chain(first, relay), upstream.status_code, media_type=media_type,
                                     headers={ENGINE_HEADER: view.url})
        try:
            content = await unless_disconnected(request.is_disconnected, upstream.aread())
        except ClientGone:
            settle("client_gone")
            raise
        except httpx.TransportError as exc:        # it died before the answer was complete: ask another
            settle("retried")
            fleet.take_out(view, f"{type(exc).__name__}: {exc}")
            continue
        finally:
            await upstream.aclose()
        settle("ok" if upstream.status_code < 500 else "error")
        return Response(content, upstream.status_code, media_type=media_type or None,
                        headers={ENGINE_HEADER: view.url})
    return error(503, "no engine is available; retry later", "no_engine_available")


async def _chain(first: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()


async def _relay(fleet: Fleet, view: EventView, upstream: httpx.Response, settle) -> AsyncIterator[bytes]:
    """The engine's stream, byte for byte; if the engine fails mid-stream, an error event ends it."""
    outcome = "ok"
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        outcome = "error"
        fleet.take_out(view, f"its stream broke: {type(exc).__name__}: {exc}")
        yield error_event(f"the engine serving this stream failed ({type(exc).__name__}); retry the request")
    finally:
        await upstream.aclose()
        settle(outcome)
