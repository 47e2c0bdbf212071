"""`ModelRunner`: SchedulerOutput -> ForwardBatch -> logits -> sampled tokens.

The runner owns the device tier's physical KV (`PagedKVCache`) and sizes it from the
`kv_cache_memory` budget; that capacity is returned as a value (`num_device_blocks`) for the
tier manager to build its pool from, never written back into config.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import torch

from kvstrata.core.config import CacheConfig
from kvstrata.core.outputs import TokenLogprob
from kvstrata.kvcache.buffers import KVCacheSpec, PagedKVCache
from kvstrata.kvcache.kv_groups import cache_fingerprint, kv_groups_for
from kvstrata.kvcache.mover import TierBuffers, host_cache
from kvstrata.kvcache.prefix_groups import group_cost_tokens, group_decodes
from kvstrata.model.adapters.lora import LoRAWeights, group_rows
from kvstrata.model.loader import LoadedModel
from kvstrata.model.network.forward_batch import DecodeGroup, ForwardBatch
from kvstrata.scheduler.output import ScheduledChunk, SchedulerOutput
from kvstrata.structured.grammar import GrammarMasker
from kvstrata.worker.logprobs import token_logprobs
from kvstrata.worker.sampler import Sampler
from kvstrata.worker.speculative import verify

logger = logging.getLogger(__name__)

EMPTY: Mapping = MappingProxyType({})


def device_blocks_for(config: CacheConfig, spec: KVCacheSpec) -> int:
    """Blocks of the device tier: the exact override, or as many as fit in `kv_cache_memory`."""
    if config.num_device_blocks is not None:
        return config.num_device_blocks
    blocks = PagedKVCache.blocks_for_budget(spec, config.kv_cache_memory)
    if blocks < 1:
        raise ValueError(f"kv_cache_memory of {config.kv_cache_memory} bytes holds no block; one block of "
                         f"{config.block_size} tokens takes {spec.bytes_per_block} bytes")
    return blocks


def host_blocks_for(config: CacheConfig, spec: KVCacheSpec) -> int:
    """Blocks of the host tier (0: none): the exact override, or what fits in `host_cache_memory`."""
    if config.num_host_blocks is not None:
        return config.num_host_blocks
    return PagedKVCache.blocks_for_budget(spec, config.host_cache_memory)


@dataclass
class StepResult:
    """What the model produced in one step, keyed by request id (only chunks that sample, and for
    `prompt_logprobs`, chunks of a prompt that asked: (index of the first prompt token scored, entries)).
    A chunk with drafts: `accepted` of them came first, then `token_ids`; `logprobs` holds one entry
    per token taken, in order (the accepted drafts', then the sampled token's)."""

    token_ids: dict[str, int]
    logprobs: dict[str, list[TokenLogprob]]
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)


def _table(chunks: list[ScheduledChunk], table_of, seq_lens: np.ndarray, width: int, seq_of_token: np.ndarray,
           positions: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """One KV group's block tables (B, width), padded with 0, and the slots its tokens' K/V go to. A page a
    sliding group let go (-1) reads as block 0: its window's start keeps every query off it."""
    tables = np.zeros((len(chunks), width), dtype=np.int64)
    for row, chunk in enumerate(chunks):
        used = -(-int(seq_lens[row]) // size)
        tables[row, :used] = table_of(chunk)[:used]
    slots = tables[seq_of_token, positions // size] * size + positions % size
    assert slots.min(initial=0) >= 0, "a token's K/V would go to a page its group let go"
    return np.maximum(tables, 0, out=tables), slots


def prompt_logprob_positions(chunk: ScheduledChunk) -> range:
    """Positions of `chunk` whose logits score the prompt's next token (a prompt of n tokens has
    n - 1 of them: nothing predicts its first token, and its last position predicts the output)."""
    request = chunk.request
    if not request.wants_prompt_logprobs:
        return range(0)
    return range(chunk.start, min(chunk.start + chunk.num_tokens, request.num_prompt_tokens - 1))


def _adapter_key(chunk: ScheduledChunk) -> str:
    return chunk.request.adapter.digest if chunk.request.adapter is not None else ""


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: CacheConfig, seed: int | None = None):
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = config.block_size
        self.kv_groups = kv_groups_for(loaded.arch.windows or [None] * loaded.arch.num_layers, swa_full=config.swa_full)
        self.fingerprint = cache_fingerprint(loaded.fingerprint, self.kv_groups)      # what keys blocks and records
        self.spec = KVCacheSpec.for_model(loaded.arch, config.block_size, loaded.kv_dtype, self.kv_groups)
        self.num_device_blocks = device_blocks_for(config, self.spec)
        self.kv = PagedKVCache(self.spec, self.num_device_blocks, self.device)
        self.num_host_blocks = host_blocks_for(config, self.spec)
        self.buffers = TierBuffers(self.kv, host_cache(self.kv, self.num_host_blocks), self.fingerprint)
        grammars = (GrammarMasker(loaded.tokenizer, loaded.arch.vocab_size, loaded.eos_token_ids)
                    if loaded.tokenizer is not None else None)
        self.sampler = Sampler(loaded.eos_token_ids, seed=seed, grammars=grammars)
        # whether decodes read their own blocks in place (the paged kernel) or gather them: the
        # simulator's cost model counts a step's work one way or the other
        self.decodes_in_place = self.model.attn.reads_in_place(self.block_size, loaded.dtype, self.device)
        logger.info("decode attention: %s", "the paged kernel, blocks read in place" if self.decodes_in_place
                    else "blocks gathered, then torch's SDPA")
        if self.kv_groups.num_groups > 1:
            logger.info("KV cache groups: %d of %d layers, a sliding group keeps its last %d tokens on the device",
                        self.kv_groups.num_groups, self.kv_groups.layers_per_page, loaded.arch.sliding_window)
        elif config.swa_full and loaded.arch.sliding_window is not None:
            logger.info("KV cache: every layer at full length (--swa-full)")
        logger.info("KV cache: %d device blocks of %d tokens (%.1f MiB), %d host blocks (%.1f MiB)",
                    self.num_device_blocks, self.block_size, self.kv.nbytes / 2**20, self.num_host_blocks,
                    self.num_host_blocks * self.spec.bytes_per_block / 2**20)

    def execute(self, output: SchedulerOutput, adapters: Mapping[str, LoRAWeights] = EMPTY) -> StepResult:
        """Run a step: `adapters` are the resident LoRA weights by digest (the engine's `Adapters` owns them; a
        chunk's request names its adapter by digest)."""
        if output.is_empty:
            return StepResult({}, {})
        decodes = [c for c in output.chunks if c.num_tokens == 1]
        others = [c for c in output.chunks if c.num_tokens != 1]
        if adapters:    # each adapter's rows side by side (a stable sort), so its updates read a slice
            decodes, others = sorted(decodes, key=_adapter_key), sorted(others, key=_adapter_key)
        order, groups = group_decodes([c.block_ids for c in decodes], [c.start + 1 for c in decodes],
                                      self.block_size, group_cost_tokens(self.decodes_in_place))
        chunks = [decodes[i] for i in order] + others
        batch = self.build_batch(chunks, groups, adapters)
        with torch.inference_mode():
            logits = self.model(batch, self.kv)                              # (S + D + P, V) float32
        sampled = [c for c in chunks if c.sample and not c.draft_token_ids]
        drafted = [c for c in chunks if c.draft_token_ids]
        num_drafted = sum(c.num_tokens for c in drafted)
        prompt_logprobs = self._prompt_logprobs(chunks, logits[len(sampled) + num_drafted:])
        verdicts = verify(self.sampler, logits[len(sampled):len(sampled) + num_drafted],
                          [c.request for c in drafted], [c.draft_token_ids for c in drafted]) if drafted else []
        logits = logits[:len(sampled)]
        sampling = [c.request for c in sampled]
        forks = [(row, sample) for row, c in enumerate(sampled) for sample in c.forks]
        if forks:       # a family's other samples draw their first token from the leader's logits
            logits = torch.cat([logits, logits[[row for row, _ in forks]]])                 # (S + F, V)
            sampling += [sample for _, sample in forks]
        result = self.sampler(logits, sampling)
        ids = [r.request_id for r in sampling]
        token_ids = dict(zip(ids, result.token_ids))
        token_ids.update((c.request.request_id, v.token_id) for c, v in zip(drafted, verdicts))
        logprobs = {rid: [lp] for rid, lp in zip(ids, result.logprobs) if lp is not None}
        logprobs.update((c.request.request_id, list(v.logprobs)) for c, v in zip(drafted, verdicts) if v.logprobs)
        return StepResult(token_ids, logprobs,
                          prompt_logprobs, {c.request.request_id: v.num_accepted for c, v in zip(drafted, verdicts)})

    @staticmethod
    def _prompt_logprobs(chunks: list[ScheduledChunk], logits: torch.Tensor
                         ) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """Score each asking chunk's next prompt tokens from its rows of `logits` (P, V), in chunk order."""
        scored, row = {}, 0
        for chunk in chunks:
            positions = prompt_logprob_positions(chunk)
            if not positions:
                continue
            request = chunk.request
            targets = request.token_ids[positions.start + 1:positions.stop + 1]
            entries = token_logprobs(logits[row:row + len(positions)], targets,
                                     [request.sampling.prompt_logprobs] * len(positions))
            scored[request.request_id] = (positions.start + 1, entries)
            row += len(positions)
        assert row == logits.shape[0], "every prompt-logprob row belongs to a chunk"
        return scored

    def build_batch(self, chunks: list[ScheduledChunk], groups: list[DecodeGroup] | None = None,
                    adapters: Mapping[str, LoRAWeights] = EMPTY) -> ForwardBatch:
        """Flatten chunks (decodes first, `groups` of them sharing a prefix at the front) into
        token-axis tensors; see ForwardBatch for the layout."""
        size = self.block_size
        lengths = np.array([c.num_tokens for c in chunks], dtype=np.int64)
        starts = np.array([c.start for c in chunks], dtype=np.int64)
        query_start = np.concatenate(([0], np.cumsum(lengths)))
        positions = np.concatenate([np.arange(c.start, c.start + c.num_tokens) for c in chunks])
        seq_lens = starts + lengths
        width = int(-(-seq_lens.max() // size))
        seq_of_token = np.repeat(np.arange(len(chunks)), lengths)
        tables, slots = _table(chunks, lambda c: c.block_ids, seq_lens, width, seq_of_token, positions, size)
        group_tables = [_table(chunks, lambda c, k=k: c.group_block_ids[k], seq_lens, width, seq_of_token, positions,
                               size) for k in range(len(chunks[0].group_block_ids))]
        input_ids = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=int(lengths.sum()))
        # Rows whose logits come back: chunks that sample (their last row), then chunks with drafts
        # (every row), then prompt logprobs.
        logits_rows = [int(query_start[i + 1]) - 1 for i, c in enumerate(chunks) if c.sample and not c.draft_token_ids]
        logits_rows += [row for i, c in enumerate(chunks) if c.draft_token_ids
                        for row in range(int(query_start[i]), int(query_start[i + 1]))]
        logits_rows += [int(query_start[i]) + p - c.start for i, c in enumerate(chunks)
                        for p in prompt_logprob_positions(c)]
        to = lambda a: torch.from_numpy(a).to(self.device)                 # noqa: E731
        refs = [c.request.adapter for c in chunks]
        lora = group_rows([None if a is None else adapters[a.digest] for a in refs], lengths.tolist(),
                          self.device) if any(refs) else None
        return ForwardBatch(
            group_tables=[(to(t), to(s)) for t, s in group_tables],
            input_ids=to(input_ids), positions=to(positions), slot_mapping=to(slots),
            block_tables=to(tables), seq_lens=to(seq_lens), query_start_loc=query_start.tolist(),
            num_decodes=int((lengths == 1).sum()),
            logits_indices=to(np.array(logits_rows, dtype=np.int64)), decode_groups=list(groups or ()), lora=lora)
