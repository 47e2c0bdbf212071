"""The checks every HTTP request passes before a handler sees it, in the server and the router alike:
the API key on every route but the open ones, then the body read whole under a size limit and a read
timeout. Plain ASGI (no framework), so that a refusal costs no parsing: the key is checked before a
byte of the body is read, an oversized body is refused from its Content-Length before it is read
(or as soon as it passes the limit), and a client that stops sending mid-body is answered 408
instead of holding its connection forever.

The body is replayed to the handler as one message; after it the handler's `receive` is the
client's own again, so a handler still sees a disconnect (which aborts a request waiting for its
first token)."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Refused = Callable[[str, int, str], None]       # (path, status, message): for the caller's metrics and log

MIB = 1 << 20
BODY_IDLE_TIMEOUT = 10.0      # seconds a client may send nothing mid-body


@dataclass(frozen=True)
class DoorRules:
    """`api_key`: None leaves every route open; else every path but `open_paths` needs
    'Authorization: Bearer KEY'. `max_body_bytes`: 413 beyond it. `body_idle_timeout`: seconds a
    client may send nothing mid-body; `body_timeout`: seconds for the whole body (408 past either)."""

    api_key: str | None = None
    open_paths: frozenset[str] = frozenset({"/health"})
    max_body_bytes: int = 8 * MIB
    body_idle_timeout: float = 10.0
    body_timeout: float = 60.0

    def __post_init__(self) -> None:
        assert self.max_body_bytes >= 1 and 0 < self.body_idle_timeout <= self.body_timeout

    @classmethod
    def of(cls, api_key: str | None, metrics_without_key: bool, max_body_bytes: int, body_timeout: float) -> DoorRules:
        """The rules from the server's and the router's flags."""
        open_paths = {"/health", "/metrics"} if metrics_without_key else {"/health"}
        return cls(api_key, frozenset(open_paths), max_body_bytes, min(BODY_IDLE_TIMEOUT, body_timeout), body_timeout)


class FrontDoor:
    """ASGI middleware applying `DoorRules` to every HTTP request (the innermost of the server's
    middlewares but above the app, so CORS preflights are answered before the key is asked for)."""

    def __init__(self, app: ASGIApp, rules: DoorRules, refused: Refused | None = None):
        self.app, self.rules, self.refused = app, rules, refused
        self.expected = f"Bearer {rules.api_key}".encode() if rules.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path = scope["path"]
        if self.expected is not None and path not in self.rules.open_paths and \
                not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            await self._refuse(send, path, 401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                               "invalid_api_key")
            return
        outcome = await self._read_body(headers, receive)
        if isinstance(outcome, tuple):
            await self._refuse(send, path, *outcome)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": outcome, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes | tuple[int, str, str]:
        """The whole body, or why not: (status, message, code)."""
        limit = self.rules.max_body_bytes
        declared = headers.get(b"content-length")
        too_big = (413, f"the request body is over the limit of {limit} bytes (--max-body-bytes)",
                   "request_too_large")
        if declared is not None:
            if not declared.isdigit():
                return 400, "the Content-Length header is not a number", "bad_request"
            if int(declared) > limit:
                return too_big
        chunks, size = [], 0
        deadline = time.monotonic() + self.rules.body_timeout
        while True:
            wait = min(self.rules.body_idle_timeout, deadline - time.monotonic())
            try:
                message = await asyncio.wait_for(receive(), max(wait, 0.0))
            except TimeoutError:
                return 408, "the request body did not arrive in time", "request_timeout"
            if message["type"] == "http.disconnect":
                return 499, "the client left while sending its request", "client_gone"
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return too_big
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, send: Send, path: str, status: int, message: str, code: str) -> None:
        if self.refused is not None:
            self.refused(path, status, message)
        if status == 499:       # nobody to answer
            return
        kind = "authentication_error" if status == 401 else "invalid_request_error"
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if status in (408, 413):     # the rest of the body was not read: the connection cannot be reused
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
