"""The timelines of the last requests served (kvstrata.core.timeline), for `GET /v1/timelines?id=...`:
`kvstrata bench` fetches those of its slowest requests and prints where their time went. Kept by the
HTTP event loop only, bounded."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvstrata.core.config import ServerConfig
from kvstrata.core.timeline import RequestTimeline

TIMELINES_KEPT = ServerConfig().timelines_kept       # `--timelines-kept`


class TimelineStore:
    def __init__(self, capacity: int = TIMELINES_KEPT):
        self.capacity = capacity
        self._kept: OrderedDict[str, RequestTimeline] = OrderedDict()

    def add(self, request_id: str, timeline: RequestTimeline) -> None:
        self._kept[request_id] = timeline
        self._kept.move_to_end(request_id)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, request_ids: Iterable[str]) -> dict[str, dict]:
        """The kept timelines among `request_ids`, as dicts (unknown or forgotten ids are left out)."""
        return {rid: self._kept[rid].as_dict() for rid in request_ids if rid in self._kept}
