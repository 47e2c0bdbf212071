"""The scheduler's books, checked: every request in exactly the queue its status names, the limits kept, and the
blocks held exactly by the requests that run or load (then the tiers' own audit). Tests run it after every step."""

from __future__ import annotations

from collections.abc import Set
from typing import Protocol

from kvstrata.core.config import SchedulerConfig
from kvstrata.core.request import Request, RequestStatus
from kvstrata.kvcache.tiers import TierManager


class Books(Protocol):
    """What the audit reads of a Scheduler (kvstrata.scheduler.scheduler)."""

    config: SchedulerConfig
    tiers: TierManager
    requests: dict[str, Request]
    running: list[Request]
    loading: list[Request]

    @property
    def num_seats(self) -> int: ...

    @property
    def waiting_ids(self) -> Set[str]: ...


def audit_scheduler(scheduler: Books) -> None:
    """Queues agree with statuses, limits hold, and the tiers' own audit passes."""
    waiting = scheduler.waiting_ids
    running_ids = {r.request_id for r in scheduler.running}
    loading_ids = {r.request_id for r in scheduler.loading}
    assert len(running_ids) == len(scheduler.running), "a request is listed twice in running"
    assert len(loading_ids) == len(scheduler.loading), "a request is listed twice in loading"
    assert scheduler.num_seats <= scheduler.config.max_num_seqs, "more than max_num_seqs admitted"
    assert running_ids.isdisjoint(waiting) and loading_ids.isdisjoint(waiting) \
        and running_ids.isdisjoint(loading_ids), "a request is in two queues"
    for request_id, request in scheduler.requests.items():
        assert not request.is_finished, f"finished request {request_id} still tracked"
        running = request.status is RequestStatus.RUNNING
        loading = request.status is RequestStatus.LOADING
        assert running == (request_id in running_ids), f"{request_id} is {request.status.name}"
        assert loading == (request_id in loading_ids) == scheduler.tiers.is_loading(request_id), \
            f"{request_id} is {request.status.name} but its load says otherwise"
        assert (running or loading) == scheduler.tiers.holds(request_id), f"{request_id} blocks disagree with status"
        awaiting = request.status is RequestStatus.AWAITING_FORK
        if awaiting:
            leader = request.family.leader
            assert not request.family.forked and scheduler.requests.get(leader.request_id) is leader, \
                f"{request_id} waits to fork from {leader.request_id}, which is gone or forked"
            assert scheduler.tiers.has_fork(request_id) == scheduler.tiers.holds(leader.request_id), \
                f"{request_id} has a place exactly while its leader {leader.request_id} holds blocks"
        assert running or loading or awaiting or request_id in waiting, f"{request_id} is in no queue"
    assert set(waiting) <= set(scheduler.requests), "an unknown request is waiting"
    scheduler.tiers.audit()
