"""Request traces: the Mooncake FAST'25 format, and the token ids and block hashes that replay it.

A Mooncake line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`
with one id per 512-token block of the input; equal ids mean equal content *and* equal prefix.
`TraceTokens` turns ids into token ids (a counter-based hash of (id, position), so equal ids give
equal tokens) and into the engine's chained block hashes at any block size dividing 512:

    trace blocks:   [ id 7 ............. 512 ][ id 9 ............. 512 ][ id 12 .. 300 ]
    engine blocks:  [h0 ][h1 ][h2 ][h3 ]       [h4 ][h5 ][h6 ][h7 ]     [h8 ][h9 ]       (block_size 128)

The hashes of one trace block depend only on its parent hash and its id, so they are cached per
(parent hash, id): a trace of 145M tokens hashes each unique block once.

`shrink` keeps a trace's ids and order but gives each id fewer tokens (`tokens_per_id`, 32: a
27k-token prompt becomes 1.7k), so a small machine replays the same prefix structure; replay such
requests with `TraceTokens(hasher, tokens_per_id)`. Nothing here depends on
the simulator or on torch (the benchmark reuses it to drive a real server).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvstrata.core.hashing import BlockHash, BlockHasher

TRACE_BLOCK = 512            # tokens per hash id in Mooncake traces
_SEED = np.uint64(0x6B7673747261)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival: float               # seconds from the start of the trace (after slicing and scaling)
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]    # one per TRACE_BLOCK tokens of the input, the last one maybe partial
    adapter: str = ""            # the LoRA adapter it runs under (its digest, or a label standing for one); "": base


def read_mooncake(path: str | Path, max_requests: int | None = None, skip: int = 0, time_scale: float = 1.0,
                  max_input_tokens: int | None = None, max_output_tokens: int | None = None) -> list[TraceRequest]:
    """Read a slice of a Mooncake trace: `skip` requests, then at most `max_requests`.

    Arrival times start at 0 and are multiplied by `time_scale` (2.0: half the request rate).
    A capped input keeps its leading blocks, so prefix sharing survives the cut.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be positive, not {time_scale}")
    if any(cap is not None and cap < 1 for cap in (max_input_tokens, max_output_tokens)):
        raise ValueError("length caps must be at least 1")
    requests: list[TraceRequest] = []
    start = None
    with open(path) as lines:
        for number, line in enumerate(lines):
            if number < skip or not line.strip():
                continue
            if max_requests is not None and len(requests) >= max_requests:
                break
            record = json.loads(line)
            length, ids = int(record["input_length"]), tuple(int(i) for i in record["hash_ids"])
            if len(ids) != math.ceil(length / TRACE_BLOCK):
                raise ValueError(f"{path}:{number + 1}: {len(ids)} hash_ids for {length} input tokens "
                                 f"(expected ceil({length}/{TRACE_BLOCK}))")
            if max_input_tokens is not None and length > max_input_tokens:
                length = max_input_tokens
                ids = ids[:math.ceil(length / TRACE_BLOCK)]
            output = max(1, int(record["output_length"]))
            if max_output_tokens is not None:
                output = min(output, max_output_tokens)
            stamp = float(record["timestamp"]) / 1000.0
            start = stamp if start is None else start
            requests.append(TraceRequest((stamp - start) * time_scale, length, output, ids,
                                         str(record.get("adapter") or "")))
    if not requests:
        raise ValueError(f"{path}: no requests in the slice")
    return requests


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a counter-based generator, the same on every machine."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class TraceTokens:
    """Token ids and chained block hashes of trace requests, for one block size and hash root.

    Token ids are bytes (0..255, valid ids in any real vocabulary): CPython shares small ints, so
    materializing 145M prompt tokens is fast and a cached block costs one pointer per token, and
    512 tokens drawn from 256 ids never collide in practice.
    """

    def __init__(self, hasher: BlockHasher, tokens_per_id: int = TRACE_BLOCK):
        check_tokens_per_id(tokens_per_id, hasher.block_size)
        self.hasher = hasher
        self.tokens_per_id = tokens_per_id
        self.per_trace_block = tokens_per_id // hasher.block_size
        self._words = np.arange(tokens_per_id // 8, dtype=np.uint64)
        self._hashes: dict[tuple[BlockHash, int], tuple[BlockHash, ...]] = {}

    def block_tokens(self, ids: Sequence[int]) -> np.ndarray:
        """(len(ids), tokens_per_id) uint8 token ids: each 64-bit draw of (trace id, word) gives 8 tokens."""
        ids = np.asarray(ids, dtype=np.uint64)
        with np.errstate(over="ignore"):
            words = _mix((ids[:, None] << np.uint64(16)) + self._words[None, :] + _SEED)
        return words.astype("<u8").view(np.uint8)

    def prompt(self, request: TraceRequest) -> list[int]:
        return list(self.block_tokens(request.hash_ids).tobytes()[:request.input_length])

    def hasher_for(self, request: TraceRequest) -> BlockHasher:
        """The hasher of the request's blocks: the base model's, or its adapter's (kvstrata.core.hashing)."""
        return self.hasher.for_adapter(request.adapter) if request.adapter else self.hasher

    def block_hashes(self, request: TraceRequest) -> list[BlockHash]:
        """Hashes of the prompt's full engine blocks, exactly as `BlockHasher` chains them (from the
        root of the request's adapter, if it names one)."""
        hashes: list[BlockHash] = []
        parent, ids = self.hasher_for(request).root, request.hash_ids
        for index, trace_id in enumerate(ids):
            block = self._hashes.get((parent, trace_id))
            if block is None:
                self._hash_from(parent, ids[index:], hashes)
                break
            hashes.extend(block)
            parent = block[-1]
        del hashes[request.input_length // self.hasher.block_size:]
        return hashes

    def _hash_from(self, parent: BlockHash, ids: Sequence[int], out: list[BlockHash]) -> None:
        """Hash trace blocks `ids` chained from `parent` (tokens drawn once for all), caching each."""
        size = self.hasher.block_size * 4                     # bytes of one engine block as uint32
        encoded = self.block_tokens(ids).astype("<u4")        # the canonical encoding of kvstrata.core.hashing
        for trace_id, row in zip(ids, encoded):
            data, block = row.tobytes(), []
            key = (parent, trace_id)
            for start in range(0, len(data), size):
                parent = xxhash.xxh3_128_digest(parent + data[start:start + size])
                block.append(parent)
            self._hashes[key] = tuple(block)
            out.extend(block)


def check_tokens_per_id(tokens_per_id: int, block_size: int) -> None:
    if tokens_per_id < 8 or tokens_per_id % 8 or tokens_per_id > TRACE_BLOCK or tokens_per_id % block_size:
        raise ValueError(f"tokens per trace id must be a multiple of 8 up to {TRACE_BLOCK} and of the block size "
                         f"{block_size}, not {tokens_per_id}")


def shrink(requests: Iterable[TraceRequest], tokens_per_id: int) -> list[TraceRequest]:
    """The same requests with `tokens_per_id` tokens per hash id instead of 512: ids, order, arrivals
    and outputs kept, inputs scaled (a partial last block stays partial)."""
    if not 8 <= tokens_per_id <= TRACE_BLOCK:
        raise ValueError(f"tokens_per_id must be in [8, {TRACE_BLOCK}], not {tokens_per_id}")
    return [TraceRequest(r.arrival, max(1, math.ceil(r.input_length * tokens_per_id / TRACE_BLOCK)),
                         r.output_length, r.hash_ids) for r in requests]


def num_prompt_blocks(requests: Iterable[TraceRequest], block_size: int) -> int:
    return sum(math.ceil(r.input_length / block_size) for r in requests)


def ideal_hit_rate(requests: Iterable[TraceRequest], tokens: TraceTokens) -> float:
    """Share of prompt blocks an infinite cache serves, replaying requests one at a time in order.

    The engine's rules apply: only full blocks are cached, and the block holding the last prompt
    token is always computed (its logits pick the first output token).
    """
    requests = list(requests)
    total = num_prompt_blocks(requests, tokens.hasher.block_size)
    return sum(ideal_hits(requests, tokens)) / total if total else 0.0


def ideal_hits(requests: Iterable[TraceRequest], tokens: TraceTokens) -> list[int]:
    """Prompt blocks of each request an infinite cache serves (see ideal_hit_rate)."""
    size = tokens.hasher.block_size
    seen: set[BlockHash] = set()
    hits = []
    for request in requests:
        hashes = tokens.block_hashes(request)
        limit = (request.input_length - 1) // size
        matched = 0
        while matched < limit and hashes[matched] in seen:
            matched += 1
        hits.append(matched)
        seen.update(hashes)
    return hits
