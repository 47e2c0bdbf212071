"""Reading a Redis value no further than the record it declares: the get of both Redis stores.

A get is two pipelined round trips where an MGET was one. The first asks each key's length (STRLEN)
and its first HEADER.size bytes (GETRANGE); the second reads a value only if it is a record of its own
length (`base.refusal`), and then with GETRANGE 0..length-1, so a value swapped for a longer one
between the trips is still read no further. Anything else under one of our keys (another type, a
foreign or torn value) is a miss, counted as refused, logged by key (never its bytes) and deleted in
the second trip, as the engine deletes a record that fails its checks. The cost is one more round
trip per batch, a fraction of a millisecond on a LAN, next to a record's own transfer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvstrata.kvcache.stores.base import refusal
from kvstrata.kvcache.stores.records import HEADER

logger = logging.getLogger(__name__)

Command = tuple[Any, ...]


class Read(NamedTuple):
    """The second trip for one key: its `commands` (a GETRANGE of `length` bytes, a DEL, or none)."""

    commands: list[Command]
    length: int
    refused: bool


def probe(name: str) -> list[Command]:
    """The first trip's commands for one key: its length and its header, nothing more of it."""
    return [("STRLEN", name), ("GETRANGE", name, 0, HEADER.size - 1)]


def plan(name: str, replies: Sequence[Any]) -> Read:
    """The second trip for one key, from its probe's replies."""
    length, head = replies
    if isinstance(length, Exception):
        reason: str | None = "not a string"
    elif not length:
        return Read([], 0, False)
    else:
        reason = refusal(head, length)
    if reason is None:
        return Read([("GETRANGE", name, 0, length - 1)], length, False)
    logger.warning("redis store: refused %s (%s), a miss", name, reason)
    return Read([("DEL", name)], 0, True)


def value(read: Read, replies: Sequence[Any] | None) -> bytes | None:
    """One key's record from its second trip's replies; None for a miss (none, refused, changed meanwhile)."""
    record = replies[0] if read.length and replies else None
    return record if isinstance(record, bytes) and len(record) == read.length else None


def checked(replies: list[Any]) -> list[Any]:
    """A pipeline's replies (run with raise_on_error=False), raising its first error but the WRONGTYPE
    of another type under one of our keys: that reply stays, for `plan` to refuse the key alone."""
    for reply in replies:
        if isinstance(reply, Exception) and not str(reply).startswith("WRONGTYPE"):
            raise reply
    return replies


def grouped(replies: list[Any], commands: Sequence[Sequence[Command]]) -> list[list[Any]]:
    """A pipeline's flat replies split back into each key's, as `commands` were sent."""
    flat = iter(replies)
    return [[next(flat) for _ in each] for each in commands]
