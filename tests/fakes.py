"""A model stand-in for scheduler and cache tests.

`FakeRunner` stores each token id itself as its "KV", written by slot and read back
through the block table, and checks that every position a chunk attends to holds the
request's real token. A block served from cache with the wrong content, or overwritten
while still in use, fails the step. The next token is a hash of the whole context, so
any difference in what the model "saw" changes the output.
"""

from __future__ import annotations

import numpy as np

from kvstrata.config import CacheConfig, SchedulerConfig
from kvstrata.kvcache.hashing import BlockHasher
from kvstrata.kvcache.tiers import TierManager
from kvstrata.request import Request, SamplingParams
from kvstrata.scheduler import Scheduler, SchedulerOutput

VOCAB = 50
EOS = VOCAB  # outside the fake vocabulary: generation ends by length unless a test says otherwise


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.kv = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.num_steps = 0

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        size = self.block_size
        for chunk in output.chunks:
            table = np.asarray(chunk.block_ids, dtype=np.int64)
            new_pos = np.arange(chunk.start, chunk.start + chunk.num_tokens)
            assert len(table) * size >= new_pos[-1] + 1, "block table too short for the chunk"
            self.kv[table[new_pos // size], new_pos % size] = chunk.token_ids
            context_pos = np.arange(chunk.start + chunk.num_tokens)
            seen = self.kv[table[context_pos // size], context_pos % size]
            expected = np.asarray(chunk.request.token_ids[:len(context_pos)])
            bad = np.nonzero(seen != expected)[0]
            assert not len(bad), (f"{chunk.request.request_id}: KV at positions {bad[:8].tolist()} "
                                  f"holds {seen[bad[:8]].tolist()}, expected {expected[bad[:8]].tolist()}")
            if chunk.sample:
                sampled[chunk.request.request_id] = next_token(seen)
        self.num_steps += 1
        return sampled


def next_token(context: np.ndarray) -> int:
    weights = np.arange(1, len(context) + 1, dtype=np.int64)
    return int((int(np.dot(context, weights)) * 2654435761 + len(context)) % VOCAB)


HASHER = BlockHasher.create(4, "fake-model")


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, priority: int = 0,
                 arrival: float = 0.0, block_size: int = 4, **sampling) -> Request:
    hasher = HASHER if block_size == HASHER.block_size else BlockHasher.create(block_size, "fake-model")
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling).validate(),
                   hasher, arrival_time=arrival, priority=priority)


def make_scheduler(num_blocks: int = 32, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 16, max_model_len: int = 64, policy: str = "fcfs",
                   prefix_caching: bool = True, chunked: bool = True, **cache) -> Scheduler:
    cache_config = CacheConfig(block_size=block_size, num_device_blocks=num_blocks,
                               enable_prefix_caching=prefix_caching, **cache)
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=max_model_len, policy=policy,
                                       enable_chunked_prefill=chunked)
    cache_config.validate()
    scheduler_config.validate()
    return Scheduler(scheduler_config, TierManager(cache_config, num_blocks), eos_token_ids=[EOS])


def step(scheduler: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    """One engine step with the fake model, audited."""
    output = scheduler.schedule()
    assert output.num_tokens <= scheduler.config.max_num_batched_tokens
    scheduler.update(output, runner.execute(output))
    scheduler.audit()
    return output


def run_all(scheduler: Scheduler, runner: FakeRunner, requests: list[Request],
            max_steps: int = 10_000) -> dict[str, list[int]]:
    """Add the requests, step until all finish, and return each one's output tokens."""
    for request in requests:
        scheduler.add_request(request)
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            break
        step(scheduler, runner)
    assert not scheduler.has_unfinished, "requests did not finish: the scheduler is stuck"
    return {request.request_id: request.output_token_ids for request in requests}
