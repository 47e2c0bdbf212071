"""The slowest requests, and where their time went by the server's own record of them.

A kvstrata server keeps the timeline (kvstrata.core.timeline) of each of the last 4,096 requests it
served and answers `GET /v1/timelines?id=A&id=B` with them, by the response's `id`. After each run the
load generator asks for every request of the run, 100 ids a GET (a few GETs, outside the timed run).
A peer answers 404: it keeps no timelines, and the report says so.

The slowest requests are the slowest 1% by end-to-end latency (at least one), and as many by TTFT
(a request in both lists appears once). Each gets its breakdown, beside the breakdown summed over
every request whose timeline came back, which says what is usual:

    e2e (client) = outside + before_engine + queued + load + preempted + prefill + decode
                   + decode_behind_prefill + between_steps + after_engine

`outside` is what the server's clock cannot see: connecting, the network, the client's event loop
(on a shared machine, the client waiting for a core the server holds). The terms after it are
`RequestTimeline.breakdown()`'s, from when the HTTP side received the request to its last byte.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from kvstrata.bench.metrics import RequestResult
from kvstrata.core.timeline import RequestTimeline

logger = logging.getLogger(__name__)

BREAKDOWN = tuple(RequestTimeline(0.0).breakdown())     # before_engine, queued, ..., after_engine, in order
COLUMNS = ("outside", *BREAKDOWN)
SLOWEST_SHARE = 0.01
IDS_PER_GET = 100


async def fetch(client: httpx.AsyncClient, api: str, request_ids: Sequence[str]) -> dict[str, dict] | None:
    """{id: RequestTimeline.as_dict()} for the ids the server still keeps; None if it keeps no timelines.
    A request's timeline is filed when its response has ended, which can be a moment after the client
    read its last chunk: ids missing from the first answer are asked for once more."""
    wanted, found = list(dict.fromkeys(request_ids)), {}
    for attempt in range(2):
        for begin in range(0, len(wanted), IDS_PER_GET):
            try:
                batch = [("id", i) for i in wanted[begin:begin + IDS_PER_GET]]
                response = await client.get(f"{api}/timelines", params=batch)
                if response.status_code != 200:
                    logger.info("%s/timelines: HTTP %d: the server keeps no timelines", api, response.status_code)
                    return None
                found.update(response.json()["timelines"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                logger.warning("%s/timelines: %s: no timelines", api, exc)
                return None
        wanted = [i for i in wanted if i not in found]
        if not wanted or not found or attempt:
            break
        await asyncio.sleep(0.2)
    return found


def slowest(results: Sequence[RequestResult], share: float = SLOWEST_SHARE) -> list[tuple[RequestResult, str]]:
    """(result, 'e2e' or 'ttft'): the slowest `share` of the completed requests by end-to-end latency (at
    least one), then as many by TTFT that are not among them."""
    done = [r for r in results if r.ok]
    count = max(1, math.ceil(share * len(done))) if done else 0
    by_e2e = sorted(done, key=lambda r: r.e2el, reverse=True)[:count]
    chosen = {id(r) for r in by_e2e}
    by_ttft = [r for r in sorted(done, key=lambda r: r.ttft, reverse=True)[:count] if id(r) not in chosen]
    return [(r, "e2e") for r in by_e2e] + [(r, "ttft") for r in by_ttft]


@dataclass(frozen=True)
class SlowRequest:
    request_id: str | None
    slowest_by: str                  # "e2e" or "ttft"
    e2el: float                      # seconds, as the client saw them
    ttft: float
    timeline: dict | None            # RequestTimeline.as_dict() as the server sent it; None: not kept

    @property
    def breakdown(self) -> dict[str, float] | None:
        return None if self.timeline is None else with_outside(self.e2el, self.timeline)


def with_outside(e2el: float, timeline: dict) -> dict[str, float]:
    """The timeline's breakdown, with `outside` first: the client's e2e the server's account leaves."""
    parts = RequestTimeline.from_dict(timeline).breakdown()
    return {"outside": e2el - sum(parts.values()), **parts}


@dataclass(frozen=True)
class Tails:
    """One server's slowest requests and the breakdown over all its requests with a timeline."""

    label: str
    completed: int
    slow: list[SlowRequest]
    timelines: int | None            # timelines the server returned; None: it keeps none
    total: dict[str, float]          # COLUMNS -> seconds summed over those requests
    total_e2el: float
    total_ttft: float

    @classmethod
    def of(cls, label: str, results: Sequence[RequestResult], timelines: dict[str, dict] | None) -> Tails:
        kept = timelines or {}
        slow = [SlowRequest(r.request_id, by, r.e2el, r.ttft, kept.get(r.request_id or ""))
                for r, by in slowest(results)]
        with_timeline = [r for r in results if r.ok and r.request_id in kept]
        total = dict.fromkeys(COLUMNS, 0.0)
        for r in with_timeline:
            for key, seconds in with_outside(r.e2el, kept[r.request_id]).items():
                total[key] += seconds
        return cls(label, sum(r.ok for r in results), slow, None if timelines is None else len(with_timeline),
                   total, sum(r.e2el for r in with_timeline), sum(r.ttft for r in with_timeline))

    def as_dict(self) -> dict:
        return {"completed": self.completed, "timelines": self.timelines,
                "slowest": [{"request_id": s.request_id, "slowest_by": s.slowest_by, "e2el": s.e2el, "ttft": s.ttft,
                             "breakdown": s.breakdown, "timeline": s.timeline} for s in self.slow],
                "all": {"requests": self.timelines, "e2el": self.total_e2el, "ttft": self.total_ttft,
                        "breakdown": self.total if self.timelines else None}}

    def table(self) -> str:
        """Seconds per slow request, then the mean and the sum over every request with a timeline."""
        if self.timelines is None:
            return f"{self.label}: the server keeps no timelines (no breakdown of its slowest requests)"
        by_e2e = sum(s.slowest_by == "e2e" for s in self.slow)
        title = (f"{self.label}: where the time went (s), the slowest {by_e2e} of {self.completed} by e2e latency and "
                 f"{len(self.slow) - by_e2e} more by TTFT; timelines of {self.timelines} requests")
        header = ["request", "slowest by", "e2e", "TTFT", *COLUMNS]
        rows = []
        for s in self.slow:
            parts = s.breakdown
            cells = [_s(parts[k]) for k in COLUMNS] if parts else ["not kept", *[""] * (len(COLUMNS) - 1)]
            rows.append([_short(s.request_id), s.slowest_by, _s(s.e2el), _s(s.ttft), *cells])
        if self.timelines:
            n = self.timelines
            rows.append([f"all {n}, mean", "", _s(self.total_e2el / n), _s(self.total_ttft / n),
                         *(_s(self.total[k] / n) for k in COLUMNS)])
            rows.append([f"all {n}, sum", "", _s(self.total_e2el), _s(self.total_ttft),
                         *(_s(self.total[k]) for k in COLUMNS)])
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                 for row in [header, *rows]]
        return "\n".join([title, *lines])


def _s(seconds: float) -> str:
    return f"{round(seconds, 3) + 0.0:.3f}"         # + 0.0: -0.0 (a rounding's sign) prints as 0.000


def _short(request_id: str | None) -> str:
    """cmpl-0123456789abcdef... -> cmpl-01234567 (the JSON keeps the whole id)."""
    if not request_id:
        return "-"
    head, _, tail = request_id.rpartition("-")
    return f"{head}-{tail[:8]}" if head else request_id[:13]
