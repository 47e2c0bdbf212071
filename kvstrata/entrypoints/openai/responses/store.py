"""The responses kept for `previous_response_id` and GET/DELETE /v1/responses/{id}: an LRU in memory.

Only the HTTP server's event loop touches it (one thread, no lock); the engine thread never does. A
server restart forgets every response, as a response pushed out of the LRU is forgotten: a later
`previous_response_id` naming it is a 404, and the client sends the whole conversation instead.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    """A finished response: its body as returned, and the conversation through its reply as chat
    messages (the input after its own previous_response_id, then its output; never its instructions)."""

    body: dict[str, Any]
    messages: tuple[dict[str, Any], ...]


class ResponseStore:
    """The last `capacity` stored responses by id; a read or a write makes one the most recent."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        assert capacity > 0, "a store that keeps nothing"
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, response_id: str, response: StoredResponse) -> None:
        self._responses[response_id] = response
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        response = self._responses.get(response_id)
        if response is not None:
            self._responses.move_to_end(response_id)
        return response

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None
