"""Continuous batching: which tokens of which requests run in the next step.

One token budget per step, no separate prefill and decode phases:

  1. running requests first, best (priority, arrival) first: each gets its pending tokens
     (a decode token, or the next prefill chunk). If its blocks cannot grow, the worst running
     request is preempted (lowest priority, then latest arrival) until they can; the worst is
     last in the order, so nothing already scheduled this step is ever taken back.
  2. if nobody was preempted, waiting requests are admitted in policy order through
     TierManager.plan / commit, until the budget, `max_num_seqs` or a refusal stops it
     (head of line: a refused request is not overtaken).

Preempted requests keep their full blocks CACHED, so resuming usually re-hits them, and they
resume before any new request. A request that could never fit is refused at `add_request`.

Speculative decoding and families (docs/design/scheduler.md): once running requests have their tokens and waiting
ones are admitted (nobody preempted), speculating decodes get up to `num_lookahead_tokens` drafts in the budget left,
by the same all-or-nothing `grow()` (a draft never preempts); `update` frees rejected drafts' slots. Of a family
(n / best_of > 1) only the leader queues; the step that samples its first token forks the others.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence, Set

from kvstrata.core.config import SchedulerConfig, SpeculativeConfig
from kvstrata.core.errors import RequestRejected
from kvstrata.core.request import Request, RequestStatus
from kvstrata.kvcache.tiers import TierManager
from kvstrata.scheduler.audit import audit_scheduler
from kvstrata.scheduler.drafts import (
    DEFAULT_BREAK_EVEN,
    MAX_BREAK_EVEN,
    DraftProposer,
    judge,
    may_draft,
    worth_drafting,
)
from kvstrata.scheduler.output import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)

LPM_MAX_QUEUE = 128   # beyond this many waiting requests, lpm falls back to fcfs (matching is O(queue))


class Scheduler:
    def __init__(self, config: SchedulerConfig, tiers: TierManager, eos_token_ids: Iterable[int] = (),
                 speculative: SpeculativeConfig | None = None, proposer: DraftProposer | None = None):
        self.config = config
        self.tiers = tiers
        self.eos_token_ids = frozenset(eos_token_ids)
        self.proposer = proposer or DraftProposer.from_config(speculative)
        self.disable_by_batch_size = speculative.disable_by_batch_size if speculative is not None else None
        self.break_even = DEFAULT_BREAK_EVEN     # this step's (see schedule): update judges its drafts by it
        self.requests: dict[str, Request] = {}      # every request not yet finished
        self.running: list[Request] = []
        self.loading: list[Request] = []            # admitted, waiting for store loads to land
        self._waiting: list[tuple] = []             # heap of (key, seq, request); stale entries skipped
        self._waiting_key: dict[str, tuple] = {}    # request id -> its live heap key
        self._seq = itertools.count()
        self._arrival_order: dict[str, int] = {}    # tie-break for equal arrival times
        self.num_preemptions = 0
        self.in_step: list[Request] = []            # requests the last schedule() worked on (for recovery)

    # ---- intake ---------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request (a family: its leader), or raise ValueError if it could never run to completion."""
        samples = self.check(request)
        order = next(self._seq)
        for sample in samples:
            sample.status = RequestStatus.AWAITING_FORK
            self.requests[sample.request_id] = sample
            self._arrival_order[sample.request_id] = order
        request.status = RequestStatus.WAITING
        self._enqueue(request)

    def check(self, request: Request) -> list[Request]:
        """Its samples if `add_request` would take the request; ValueError (nothing changed) if it never could."""
        max_len = self.config.max_model_len
        samples = request.samples
        assert samples[0] is request, "a family is added through its leader"
        for sample in samples:
            if sample.request_id in self.requests:
                raise ValueError(f"request id {sample.request_id!r} is already in use")
        if len(samples) > self.config.max_num_seqs:
            raise RequestRejected(f"{len(samples)} samples of one request cannot run at once: this server runs "
                                  f"at most {self.config.max_num_seqs} sequences; lower n or best_of", "n")
        if request.num_prompt_tokens >= max_len:
            raise RequestRejected(f"the prompt has {request.num_prompt_tokens} tokens, but this server accepts "
                                  f"at most {max_len} tokens per request and at least one must be generated",
                                  "prompt")
        if request.max_total_tokens > max_len:
            raise RequestRejected(f"this server accepts at most {max_len} tokens per request; you asked for "
                                  f"{request.max_total_tokens} ({request.num_prompt_tokens} in the prompt, "
                                  f"{request.sampling.max_tokens} in the completion); lower max_tokens",
                                  "max_tokens")
        # the most it computes in one step: a chunk, or unchunked, its whole sequence once resumed after a preemption
        chunk = self.config.max_num_batched_tokens if self.config.enable_chunked_prefill else request.max_total_tokens
        need = self.tiers.pages_for(request, len(samples), chunk)
        if need > self.tiers.device.num_blocks:
            raise RequestRejected(f"the request may need {need} KV blocks but the device cache holds only "
                                  f"{self.tiers.device.num_blocks}; lower max_tokens (or n) or give the cache "
                                  "more memory", "max_tokens")
        return samples

    def _rank(self, request: Request) -> tuple:
        """Best first: lower priority value (under the priority policy), then earlier arrival; a
        family's samples share everything but their index, so they sit together."""
        priority = request.priority if self.config.policy == "priority" else 0
        return priority, request.arrival_time, self._arrival_order[request.request_id], request.sample_index

    @property
    def num_seats(self) -> int:
        """Sequences counted against max_num_seqs: running, loading, and samples waiting to fork."""
        return len(self.running) + len(self.loading) + self.tiers.num_pending_forks

    def _enqueue(self, request: Request) -> None:
        key = (request.status is not RequestStatus.PREEMPTED, *self._rank(request), next(self._seq))
        self._waiting_key[request.request_id] = key
        heapq.heappush(self._waiting, (key, request))
        self.tiers.prepare(request)                 # start its store lookup now, not at the queue's head

    @property
    def num_waiting(self) -> int:
        return len(self._waiting_key)

    @property
    def waiting_ids(self) -> Set[str]:
        return self._waiting_key.keys()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def has_work(self) -> bool:
        """Requests to serve, or transfers to settle (a load outliving its aborted request)."""
        return bool(self.requests) or self.tiers.has_transfers

    def waiting_requests(self) -> list[Request]:
        """Waiting requests in the order they would be admitted."""
        return [request for key, request in sorted(self._waiting)
                if self._waiting_key.get(request.request_id) == key]

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self, prefill_limit: Callable[[int, int], int] | None = None,
                 break_even: Callable[[int], float | None] | None = None) -> SchedulerOutput:
        """The next step's chunks. If this raises, `in_step` names the requests it was working on.

        `prefill_limit(decodes, waiting)`: most prefill tokens a step with that many decodes may take
        while `waiting` requests wait for their first token and could start in it (the engine's answer
        to a step-time target); prefill chunks then share it, decodes never wait for it.
        `break_even(decodes)`: the acceptance a draft token needs to pay for its row in a step with that
        many decodes (kvstrata.scheduler.drafts; None, or no callable: DEFAULT_BREAK_EVEN).
        """
        self.in_step = []
        for request in self.tiers.poll_loads():
            self.loading.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        for request in self.tiers.take_restarts():     # KV groups: a lower tier failed it; it waits again
            self._preempt(request)
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        self.running.sort(key=self._rank)
        decodes = sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        if prefill_limit is not None and decodes:
            seats_left = max(0, self.config.max_num_seqs - self.num_seats)   # queued past them wait anyway
            waiting = len(self.running) - decodes + len(self.loading) + min(self.num_waiting, seats_left)
            prefill_left = prefill_limit(decodes, waiting)
        else:
            prefill_left = budget
        # With no decodes (a prefill engine, or one between streams), a prompt longer than a step leaves half
        # of each step to the prompts waiting for a seat: a short prompt arriving behind a long one starts at
        # once instead of after all of it (first come, first served put the streams of the P/D benchmark
        # 4.4-5.1 s behind its long prompts on the prefill engine). Prompts of a step or less keep their order.
        yielding = not decodes and self.num_waiting > 0 and self.num_seats < self.config.max_num_seqs
        long_left = max(1, budget // 2) if yielding else budget   # shared by the prompts longer than a step
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            pending = request.num_tokens - request.num_computed_tokens
            assert pending > 0, f"running request {request.request_id} has nothing to compute"
            long = pending > self.config.max_num_batched_tokens
            num_new = min(pending, budget) if pending == 1 else min(pending, budget, prefill_left,
                                                                           long_left if long else pending)
            if num_new == 0:            # a prompt to continue, and no prefill left in this step
                index += 1
                continue
            self.in_step.append(request)
            while not self.tiers.grow(request, num_new):
                for victim in self._victims(index):
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                if request.status is not RequestStatus.RUNNING:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            chunks.append(self._chunk(request, num_new))
            budget -= num_new
            prefill_left -= num_new if pending > 1 else 0
            long_left -= num_new if long else 0
            index += 1
        measured = break_even(decodes) if break_even is not None else None
        self.break_even = DEFAULT_BREAK_EVEN if measured is None else measured
        if not preempted:
            running = len(chunks)                  # the running requests' chunks; admitted ones follow
            allowed = min(budget, prefill_left)
            budget -= allowed - self._admit(allowed, chunks)
            prefilling = any(not chunk.sample or chunk.num_tokens > 1 for chunk in chunks)
            if not prefilling and (self.disable_by_batch_size is None or len(self.running) < self.disable_by_batch_size):
                self._add_drafts(chunks[:running], budget, chunks)
        self.tiers.on_step(nonempty=bool(chunks))
        return SchedulerOutput(chunks, preempted)

    def _add_drafts(self, running: list[ScheduledChunk], budget: int, chunks: list[ScheduledChunk]) -> None:
        """Give the decodes among the `running` chunks (the head of `chunks`) of requests that speculate
        draft tokens to verify, best ranked first, while the budget lasts. Each takes its draft slots in
        one all-or-nothing grow or goes without: drafts come after every running request's own token
        and every prompt admitted, and never preempt. Called only for steps without a prompt chunk: a
        draft row would lengthen the step that computes someone's first token, and while prompts are
        being computed the engine is busy anyway (at batch 32 the drafts of the ramp, where the break-even
        of a few decodes is low, were most of speculation's loss)."""
        for index, chunk in enumerate(running):
            request = chunk.request
            if budget <= 0:
                break
            break_even = self._break_even_of(request)
            if not request.num_lookahead_tokens or chunk.num_tokens != 1 or not chunk.sample or chunk.forks \
                    or not may_draft(request) or (break_even > MAX_BREAK_EVEN and not request.prediction_token_ids):
                continue
            room = min(worth_drafting(request, break_even, request.num_lookahead_tokens), budget,   # and never
                       request.sampling.max_tokens - request.num_output_tokens - 1,   # more than it may still sample
                       self.config.max_model_len - request.num_tokens - 1)            # after the token it samples anyway
            drafts = self.proposer.propose(request, room) if room > 0 else []
            if drafts and self.tiers.grow(request, 1, len(drafts)):
                chunks[index] = self._chunk(request, 1, drafts)
                budget -= len(drafts)

    def _break_even_of(self, request: Request) -> float:
        """The step's break-even, or the fixed default for a seeded request: its drafts decide how its
        random draws are spent, so they must not follow the host's timing for its tokens to repeat."""
        return DEFAULT_BREAK_EVEN if request.sampling.seed is not None else self.break_even

    def _victims(self, index: int) -> list[Request]:
        """The worst running request, with its family's samples not scheduled in this step (from `index` on),
        last first."""
        worst, family = self.running[-1], self.running[-1].family
        return [r for r in reversed(self.running[index:]) if r is worst or (family is not None and r.family is family)]

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        deferred: list[Request] = []        # waiting for blocks another request is computing now
        try:
            return self._admit_in_order(budget, chunks, deferred)
        finally:                            # even if a commit raised: the passed-over requests still wait
            for request in deferred:
                self._enqueue(request)

    def _admit_in_order(self, budget: int, chunks: list[ScheduledChunk], deferred: list[Request]) -> int:
        whole = not self.config.enable_chunked_prefill
        for request in self._admission_order():
            seats = 1 + (len(request.family.pending) if request.family is not None else 0)
            if budget <= 0 or self.num_seats + seats > self.config.max_num_seqs:
                break
            if not self.tiers.prepare(request):
                break                               # its store lookup has not answered yet
            plan = self.tiers.plan(request, budget, whole=whole)
            if plan is None:
                if not self.tiers.waits_for_computing(request):
                    break                           # head of line: refused for space, not overtaken
                deferred.append(request)            # it will hit blocks being computed now: others pass
                del self._waiting_key[request.request_id]
                continue
            self.in_step.append(request)
            self.tiers.commit(plan)                 # all or nothing: on an exception the request still waits
            del self._waiting_key[request.request_id]
            if self.tiers.is_loading(request.request_id):     # computes once its loads land (poll_loads)
                request.status = RequestStatus.LOADING
                self.loading.append(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append(self._chunk(request, plan.num_new_tokens))
            budget -= plan.num_new_tokens
        return budget

    def _admission_order(self) -> Iterable[Request]:
        """Waiting requests in policy order: resumed first; then fcfs, priority, or longest cached prefix."""
        if self.config.policy == "lpm" and self.num_waiting <= LPM_MAX_QUEUE:
            waiting = self.waiting_requests()
            cached = {r.request_id: self.tiers.cached_prefix_tokens(r) for r in waiting}
            return sorted(waiting, key=lambda r: (r.status is not RequestStatus.PREEMPTED,
                                                  -cached[r.request_id], *self._rank(r)))
        return self._heap_order()

    def _heap_order(self) -> Iterable[Request]:
        """The live head of the waiting heap, again and again; stale entries are dropped on the way.

        The consumer must admit (retire) each request it is given or stop iterating.
        """
        while self._waiting:
            key, request = self._waiting[0]
            if self._waiting_key.get(request.request_id) != key:
                heapq.heappop(self._waiting)
                continue
            yield request
            assert self._waiting_key.get(request.request_id) != key, "heap head neither admitted nor refused"

    def _chunk(self, request: Request, num_new: int, drafts: Sequence[int] = ()) -> ScheduledChunk:
        start = request.num_computed_tokens
        sample = start + num_new == request.num_tokens
        forks = tuple(request.family.pending) if sample and request.family is not None else ()
        return ScheduledChunk(request, start, request.token_ids[start:start + num_new] + list(drafts),
                              self.tiers.block_ids(request.request_id), sample=sample, forks=forks,
                              draft_token_ids=tuple(drafts),
                              group_block_ids=self.tiers.group_block_ids(request.request_id))

    # ---- after the step -------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: Mapping[str, int],
               accepted: Mapping[str, int] | None = None) -> list[Request]:
        """Record what the step computed and sampled (after `accepted[id]` of a request's drafts, if it
        had any); return the requests that finished."""
        finished = []
        for chunk in output.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:     # aborted or preempted after it was scheduled
                continue
            num_drafts = len(chunk.draft_token_ids)
            request.num_computed_tokens += chunk.num_tokens - num_drafts
            if chunk.sample:
                num_accepted = (accepted or {}).get(request.request_id, 0)
                assert num_accepted <= num_drafts, f"{request.request_id}: more drafts accepted than proposed"
                request.num_draft_tokens += num_drafts
                request.num_accepted_tokens += num_accepted
                if num_drafts:
                    judge(request, num_drafts, num_accepted, self._break_even_of(request))
                self._append(request, chunk.draft_token_ids[:num_accepted], sampled[request.request_id])
            if num_drafts:
                self.tiers.settle_drafts(request)
            self.tiers.cache_full_blocks(request)   # after the ledger: its copies fail without raising
            samples = [request] + self._fork(chunk, sampled)
            for sample in samples if chunk.sample else ():
                status = self._stop_status(sample)
                if status is not None:
                    self._finish(sample, status)
                    finished.append(sample)
        return finished

    def _append(self, request: Request, drafts: Sequence[int], token: int) -> None:
        """Take the accepted drafts (their KV is computed) and the token sampled after them into the
        ledger, stopping at the first token that ends the request: later ones were never generated."""
        for draft in drafts:
            request.append_output(draft)
            request.num_computed_tokens += 1
            if self._stop_status(request) is not None:
                return
        request.append_output(token)

    def _fork(self, chunk: ScheduledChunk, sampled: Mapping[str, int]) -> list[Request]:
        """After the leader's last prompt token: its waiting samples take the prompt's blocks and
        their own first token, and run."""
        forked = [sample for sample in chunk.forks if not sample.is_finished]
        for sample in forked:
            self.tiers.fork(chunk.request, sample)
            sample.num_cached_tokens = chunk.request.num_cached_tokens
            sample.append_output(sampled[sample.request_id])
            sample.status = RequestStatus.RUNNING
            self.running.append(sample)
        if chunk.forks:          # last: if a fork raised, ending the leader still ends every sample
            chunk.request.family.forked = True
        return forked

    def _stop_status(self, request: Request) -> RequestStatus | None:
        params = request.sampling
        token = request.token_ids[-1]
        if request.num_output_tokens >= params.min_tokens and (
                token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos)):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- other transitions ----------------------------------------------------------------------
    def finish(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        """End a request in any state (abort, or a stop string the engine found); release its blocks."""
        assert status.is_finished, f"{status.name} is not a final status"
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, status)
        return request

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.family is not None and request is request.family.leader:
            for sample in request.family.pending:       # before the fork, the leader's end is theirs
                self._finish(sample, status)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.LOADING:
            self.loading.remove(request)
        self._waiting_key.pop(request.request_id, None)
        self.tiers.release(request)
        request.status = status
        del self.requests[request.request_id]
        del self._arrival_order[request.request_id]

    def preempt(self, request_id: str) -> bool:
        """Preempt a running or loading request now, with the samples of its family (operators and
        tests); False if it is neither running nor loading."""
        request = self.requests.get(request_id)
        active = (RequestStatus.RUNNING, RequestStatus.LOADING)
        if request is None or request.status not in active:
            return False
        for sample in request.samples:
            if sample.status in active:
                self._preempt(sample)
        return True

    def _preempt(self, request: Request) -> None:
        """Release the request's blocks (full ones stay CACHED) and queue it to resume first."""
        logger.info("preempting %s: %d tokens computed, %d full blocks stay cached",
                    request.request_id, request.num_computed_tokens,
                    request.num_computed_tokens // self.tiers.block_size)
        (self.running if request.status is RequestStatus.RUNNING else self.loading).remove(request)
        self.tiers.release(request)
        self.tiers.reservation.on_preemption()
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self._enqueue(request)

    def set_priority(self, request_id: str, priority: int) -> None:
        """Change a request's priority (a family's: all its samples', so they keep ranking together)."""
        request = self.requests[request_id]
        for sample in request.samples:
            sample.priority = priority
            if sample.request_id in self._waiting_key:
                self._enqueue(sample)     # the old heap entry goes stale
        if len(self._waiting) > 2 * len(self._waiting_key) + 64:
            self._waiting = [(k, r) for k, r in self._waiting if self._waiting_key.get(r.request_id) == k]
            heapq.heapify(self._waiting)

    def audit(self) -> None:
        """Queues agree with statuses, limits hold, and the tiers' own audit passes (kvstrata.scheduler.audit)."""
        audit_scheduler(self)
