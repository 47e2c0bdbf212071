"""Waiting on behalf of an HTTP client that may leave: the server's and the router's handlers stop
(and so abort what they started) as soon as it does, instead of when their next bytes fail to send."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
POLL_SECONDS = 0.25        # between looks at whether the client is still there


class ClientGone(Exception):
    """The client disconnected while its handler waited."""


async def unless_disconnected(is_disconnected: Callable[[], Awaitable[bool]], awaitable: Awaitable[T]) -> T:
    """Await `awaitable`; if `is_disconnected()` says the client left first, cancel it (its `finally`
    and cancellation handlers run before this returns) and raise ClientGone."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_SECONDS)
            if done:
                return task.result()
            if await is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
