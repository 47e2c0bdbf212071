"""Fakes for scheduler and cache tests, and the scenarios several test files drive over them.

`FakeRunner` stores each token id itself as its "KV", written by slot and read back
through the block table, and checks that every position a chunk attends to holds the
request's real token. A block served from cache with the wrong content, or overwritten
while still in use, fails the step. The next token is a hash of the whole context, so
any difference in what the model "saw" changes the output. A chunk with draft tokens is verified
greedily, as the real sampler does: the drafts up to the first the "model" disagrees with are
accepted (`accepted`), then comes the token it would have picked.

`FakeMover`, `FakeStore`, `ManualExecutor` and `FakeClock` stand in for the lower tiers: a store
call answers only when a test says so, and may fail, hang or answer with the wrong record. `drive`
steps a scheduler until nothing is left; the scenarios build the states the tier tests start from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np
import xxhash

from kvstrata.core.config import CacheConfig, SchedulerConfig
from kvstrata.core.hashing import BlockHasher
from kvstrata.core.request import Request, RequestStatus, SampleFamily
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.kvcache.block_pool import BlockState
from kvstrata.kvcache.faults import FaultInjector, FaultyMover
from kvstrata.kvcache.kv_groups import KVGroups
from kvstrata.kvcache.tiers import TierManager
from kvstrata.scheduler.output import SchedulerOutput
from kvstrata.scheduler.scheduler import Scheduler

VOCAB = 50
EOS = VOCAB  # outside the fake vocabulary: generation ends by length unless a test says otherwise


class FakeRunner:
    """With KV groups, `windows` holds each group's window: a group's pages are checked over what its rows read."""

    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int | None] = (None,)):
        self.block_size = block_size
        self.windows = windows
        self.kv = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.num_steps = 0
        self.accepted: dict[str, int] = {}      # the last step's accepted drafts, by request

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        self.accepted = {}
        size = self.block_size
        for chunk in output.chunks:
            assert len(chunk.group_block_ids) == len(self.windows) - 1, "a block table for every KV group"
            new_pos = np.arange(chunk.start, chunk.start + chunk.num_tokens)
            context_pos = np.arange(chunk.start + chunk.num_tokens)
            expected = np.asarray((chunk.request.token_ids + list(chunk.draft_token_ids))[:len(context_pos)])
            for ids, window in zip([chunk.block_ids, *chunk.group_block_ids], self.windows):
                table = np.asarray(ids, dtype=np.int64)
                assert len(table) * size >= new_pos[-1] + 1, "block table too short for the chunk"
                read = context_pos[max(0, chunk.start - window + 1):] if window else context_pos
                assert not window or (table[read // size] >= 0).all(), \
                    f"{chunk.request.request_id} reads a page it let go"
                self.kv[table[new_pos // size], new_pos % size] = chunk.token_ids
                seen = self.kv[table[read // size], read % size]
                bad = np.nonzero(seen != (expected[read] if window else expected))[0]
                assert not len(bad), (f"{chunk.request.request_id}: KV at positions {read[bad[:8]].tolist()} "
                                      f"holds {seen[bad[:8]].tolist()}, expected {expected[read][bad[:8]].tolist()}")
            seen = expected
            if chunk.sample:
                drafts = chunk.draft_token_ids
                known = len(seen) - len(drafts)
                accepted = next((i for i, d in enumerate(drafts) if next_token(seen[:known + i]) != d), len(drafts))
                sampled[chunk.request.request_id] = next_token(seen[:known + accepted])
                if drafts:
                    self.accepted[chunk.request.request_id] = accepted
                for sample in chunk.forks:       # each sample of a family draws its own first token
                    sampled[sample.request_id] = (next_token(seen) + sample.sample_index) % VOCAB
        self.num_steps += 1
        return sampled


def next_token(context: np.ndarray) -> int:
    weights = np.arange(1, len(context) + 1, dtype=np.int64)
    return int((int(np.dot(context, weights)) * 2654435761 + len(context)) % VOCAB)


class OracleProposer:
    """Drafts for the fake model that are right up to a chosen point: the FakeRunner's own greedy
    continuation, with the token at `wrong_at(request, k)` changed (None: all right), so a test
    decides how many drafts each step accepts. Records each request's last proposal."""

    def __init__(self, wrong_at: Callable[[Request, int], int | None]):
        self.wrong_at = wrong_at
        self.proposed: dict[str, list[int]] = {}

    def propose(self, request: Request, k: int) -> list[int]:
        context = list(request.token_ids)
        for _ in range(k):
            context.append(next_token(np.asarray(context)))
        draft = context[request.num_tokens:]
        wrong = self.wrong_at(request, k)
        if wrong is not None and wrong < k:
            draft[wrong] = (draft[wrong] + 1) % VOCAB
        self.proposed[request.request_id] = draft
        return draft


HASHER = BlockHasher.create(4, "fake-model")


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, priority: int = 0,
                 arrival: float = 0.0, block_size: int = 4, **sampling) -> Request:
    hasher = HASHER if block_size == HASHER.block_size else BlockHasher.create(block_size, "fake-model")
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling).validate(),
                   hasher, arrival_time=arrival, priority=priority)


def make_family(family_id: str, prompt: list[int], n: int, max_tokens: int = 4, priority: int = 0,
                arrival: float = 0.0, block_size: int = 4) -> Request:
    """The leader of n samples `{family_id}/{index}` (as the engine builds them); add it to the scheduler."""
    samples = [make_request(f"{family_id}/{index}", prompt, max_tokens, priority, arrival, block_size)
               for index in range(n)]
    family = SampleFamily(family_id, samples)
    for index, sample in enumerate(samples):
        sample.family, sample.sample_index = family, index
    return samples[0]


def make_scheduler(num_blocks: int = 32, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 16, max_model_len: int = 64, policy: str = "fcfs",
                   prefix_caching: bool = True, chunked: bool = True, mover=None, groups=None, **cache) -> Scheduler:
    cache_config = CacheConfig(block_size=block_size, num_device_blocks=num_blocks,
                               enable_prefix_caching=prefix_caching, **cache)
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=max_model_len, policy=policy,
                                       enable_chunked_prefill=chunked)
    cache_config.validate()
    scheduler_config.validate()
    return Scheduler(scheduler_config, TierManager(cache_config, num_blocks, mover=mover, groups=groups,
                                                   max_chunk_tokens=max_num_batched_tokens if chunked else None),
                     eos_token_ids=[EOS])


def step(scheduler: Scheduler, runner: FakeRunner,
         prefill_limit: Callable[[int, int], int] | None = None) -> SchedulerOutput:
    """One engine step with the fake model, audited."""
    output = scheduler.schedule(prefill_limit)
    assert output.num_tokens <= scheduler.config.max_num_batched_tokens
    scheduler.update(output, runner.execute(output), runner.accepted)
    scheduler.audit()
    return output


def drive(scheduler: Scheduler, runner: FakeRunner, executor: ManualExecutor | None = None,
          requests: Sequence[Request] = (), clock: FakeClock | None = None) -> dict[str, list[int]]:
    """Add the requests and step until nothing is left: no request, no load, no store write.

    After each step every queued store call answers and, with a clock, time passes for calls that
    hang. Returns each request's output tokens. A live scheduler computes at least one token a
    step, so the default bound is four steps per token still to compute (room for preemptions'
    recomputation): a fixed 2,000 failed a long run that had queued ~200 requests behind a budget
    of 2 tokens.
    """
    for request in requests:
        scheduler.add_request(request)
    max_steps = 100 + 4 * sum(r.num_prompt_tokens + r.sampling.max_tokens for r in scheduler.requests.values())
    for _ in range(max_steps):
        if not scheduler.has_work:
            break
        step(scheduler, runner)
        if executor is not None:
            executor.run_all()
        if clock is not None:
            clock.now += 0.25
    assert not scheduler.has_work, "the scheduler stopped making progress"
    return {request.request_id: request.output_token_ids for request in requests}


def drain(scheduler: Scheduler, runner: FakeRunner, executor: ManualExecutor | None = None,
          clock: FakeClock | None = None) -> None:
    """Drive what is left to the end; then nothing may be held."""
    drive(scheduler, runner, executor, clock=clock)
    at_rest(scheduler)


def at_rest(scheduler: Scheduler) -> None:
    """Nothing held anywhere: the audit passes and every block of every tier is FREE or CACHED."""
    tiers = scheduler.tiers
    tiers.audit()
    for pool in filter(None, (tiers.device, tiers.host)):
        assert all(b.state in (BlockState.FREE, BlockState.CACHED) and b.ref_cnt == 0 for b in pool.blocks), \
            f"{pool.tier}: {pool.counts()}"


# ---- lower tiers ----------------------------------------------------------------------------------


class FakeStoreError(Exception):
    def __init__(self, kind: str):
        super().__init__(f"injected store fault: {kind}")
        self.kind = kind


class FakeMover:
    """Copies the fake runner's token "KV" between device and host; records carry a checksum."""

    def __init__(self, runner: FakeRunner, num_host_blocks: int):
        self.arrays = {"device": runner.kv, "host": np.full((max(num_host_blocks, 1), runner.block_size), -1,
                                                           dtype=np.int64)}

    def copy(self, src_tier, dst_tier, pairs):
        for src, dst in pairs:
            self.arrays[dst_tier][dst] = self.arrays[src_tier][src]

    def encode(self, tier, block_id, block_hash, token_ids):
        body = block_hash + self.arrays[tier][block_id].tobytes()
        return body + xxhash.xxh3_64_digest(body)

    def decode_into(self, tier, block_id, record, block_hash, token_ids):
        body, checksum = record[:-8], record[-8:]
        if xxhash.xxh3_64_digest(body) != checksum:
            raise _BadRecord("checksum")
        if body[:16] != block_hash:
            raise _BadRecord("hash")
        row = np.frombuffer(body[16:], dtype=np.int64)
        if list(row) != list(token_ids):
            raise _BadRecord("tokens")
        self.arrays[tier][block_id] = row


class _BadRecord(ValueError):
    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


class FakeStore:
    """An in-memory store; tests corrupt records and inject faults through the executor."""

    def __init__(self):
        self.records: dict[bytes, bytes] = {}

    def exists(self, keys):
        return [k in self.records for k in keys]

    def get(self, keys):
        return [self.records.get(k) for k in keys]

    def put(self, items):
        self.records.update(items)

    def delete(self, keys):
        for k in keys:
            self.records.pop(k, None)


class ManualExecutor:
    """Runs submitted store calls only when a test says so: in order, failed, wrong, or never (a hang)."""

    def __init__(self):
        self.jobs: list[tuple] = []
        self.hung: list[Future] = []          # futures that will never finish

    def submit(self, fn, *args):
        future = Future()
        self.jobs.append((fn, args, future))
        return future

    def run_next(self, fault: str | None = None, corrupt: bool = False, swap: bool = False,
                 call: str | None = None) -> bool:
        """Run the oldest call (of the store method named `call`, if given): raise `fault`, or flip a
        byte of the first record (`corrupt`), or swap the first and last records, so a key gets another
        key's record (`swap`). False if there was no such call."""
        at = next((i for i, job in enumerate(self.jobs) if call in (None, job[0].__name__)), None)
        if at is None:
            return False
        fn, args, future = self.jobs.pop(at)
        if fault is not None:
            future.set_exception(FakeStoreError(fault))
            return True
        result = fn(*args)
        records = [i for i, r in enumerate(result) if isinstance(r, bytes)] if isinstance(result, list) else []
        if corrupt and records:
            flipped = bytearray(result[records[0]])
            flipped[len(flipped) // 2] ^= 0xFF
            result[records[0]] = bytes(flipped)
        if swap and len(records) >= 2:
            result[records[0]], result[records[-1]] = result[records[-1]], result[records[0]]
        future.set_result(result)
        return True

    def hang_next(self) -> bool:
        """The oldest call never answers (its future stays pending for good)."""
        if not self.jobs:
            return False
        self.hung.append(self.jobs.pop(0)[2])
        return True

    def run_all(self) -> None:
        while self.run_next():
            pass


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_tiered_scheduler(num_blocks=16, num_host_blocks=8, block_size=4, store=True, write_policy="write_back",
                          max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64,
                          faults: FaultInjector | None = None, groups: KVGroups | None = None, **cache):
    """A scheduler over device + host + store tiers with fakes, and the fakes to drive them.

    `store` is True (a new FakeStore), False (none) or a FakeStore to share with another scheduler.
    With `faults`, the mover's copies, encodes and decodes raise when the injector says so. With `groups`, the
    pages are KV groups' (the runner checks each group's window).
    """
    cache_config = CacheConfig(block_size=block_size, num_device_blocks=num_blocks, num_host_blocks=num_host_blocks,
                               store="disk" if store else "none", write_policy=write_policy, store_timeout=1.0,
                               **cache)
    cache_config.validate()
    runner = FakeRunner(num_blocks, block_size, groups.windows if groups is not None else (None,))
    fake_store = store if isinstance(store, FakeStore) else FakeStore() if store else None
    executor, clock = ManualExecutor(), FakeClock()
    mover = FakeMover(runner, num_host_blocks)
    tiers = TierManager(cache_config, num_blocks, num_host_blocks, store=fake_store,
                        mover=mover if faults is None else FaultyMover(mover, faults), executor=executor,
                        clock=clock, probe_wait=0, groups=groups, max_chunk_tokens=max_num_batched_tokens)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                          max_model_len=max_model_len), tiers, eos_token_ids=[EOS])
    return scheduler, runner, executor, clock, fake_store


def unchecked_plan(tiers: TierManager, request, max_new_tokens: int = 4096):
    """A plan as plan() computes it, before its fits() verdict (for building refused scenarios)."""
    return tiers.admission.draft(request, max_new_tokens)


# ---- scenarios ------------------------------------------------------------------------------------
PREFIX = list(range(1, 17))                        # 4 full blocks of 4 tokens


def evict_everything(scheduler, runner, executor, tag):
    """Push all cached device blocks out with unrelated prompts."""
    fillers = [make_request(f"{tag}{i}", [40 + i] * 15, max_tokens=1) for i in range(4)]
    drive(scheduler, runner, executor, fillers)


def loading_again():
    """PREFIX served, evicted to the store, then asked for again: the new request is LOADING.

    Returns (scheduler, runner, executor, clock, store, request).
    """
    scheduler, runner, executor, clock, store = make_tiered_scheduler(num_blocks=8, num_host_blocks=0)
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    evict_everything(scheduler, runner, executor, "fill")
    assert store.records
    again = make_request("b", PREFIX + [98], max_tokens=5)
    scheduler.add_request(again)
    executor.run_all()                                    # the lookup finds the records
    step(scheduler, runner)
    assert again.status is RequestStatus.LOADING
    return scheduler, runner, executor, clock, store, again


def reference_outputs(prompts):
    """Each prompt's outputs (5 tokens) with every cache feature off."""
    scheduler = make_scheduler(num_blocks=64, prefix_caching=False)
    return drive(scheduler, FakeRunner(64, 4), requests=[make_request(f"ref{i}", p, max_tokens=5)
                                                         for i, p in enumerate(prompts)])
