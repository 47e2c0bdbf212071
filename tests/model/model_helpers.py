"""Test helpers: build `ForwardBatch`es by hand (the runner's job in the engine) and tiny HF models."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvstrata.core.machine import machine
from kvstrata.kvcache.buffers import KVCacheSpec, PagedKVCache
from kvstrata.model.forward_batch import DecodeGroup, ForwardBatch
from kvstrata.model.loader import LoadedModel


def slow_without_native_bf16(test):
    """For a test that runs SmolLM2 in bf16: where the CPU has no AVX512-BF16 / AMX, oneDNN emulates
    bf16 several times slower than fp32, so there the test runs with `-m slow` (`.ci/run` runs both)."""
    return test if machine().native_bf16 else pytest.mark.slow(test)


def cuda_only(test):
    """For a test of the CUDA paths: skipped without a CUDA device (CI has none);
    `benchmarks/device_check.py` runs them on a GPU machine with `-m cuda`."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


@dataclass
class Seq:
    """One sequence's tokens and the (deliberately arbitrary) blocks holding its KV."""

    tokens: list[int]
    blocks: list[int]
    computed: int = 0                 # tokens whose K/V are already in the cache
    logits: list[torch.Tensor] = field(default_factory=list)   # one row per computed token


def make_batch(work: list[tuple[Seq, int]], block_size: int, groups: list[DecodeGroup] = ()) -> ForwardBatch:
    """Compute the next `n` tokens of each `seq`; items with n == 1 must come first (decodes), those
    of `groups` (decodes sharing their leading blocks) at the front."""
    ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
    num_decodes = 0
    while num_decodes < len(work) and work[num_decodes][1] == 1:
        num_decodes += 1
    assert all(n > 1 for _, n in work[num_decodes:]), "decodes (one token) must come first"
    width = max(len(seq.blocks) for seq, _ in work)
    tables = torch.zeros(len(work), width, dtype=torch.int64)
    for row, (seq, n) in enumerate(work):
        for pos in range(seq.computed, seq.computed + n):
            ids.append(seq.tokens[pos])
            positions.append(pos)
            slots.append(seq.blocks[pos // block_size] * block_size + pos % block_size)
        tables[row, :len(seq.blocks)] = torch.tensor(seq.blocks)
        qsl.append(qsl[-1] + n)
        seq_lens.append(seq.computed + n)
    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots), block_tables=tables, seq_lens=torch.tensor(seq_lens),
        query_start_loc=qsl, num_decodes=num_decodes, logits_indices=torch.arange(len(ids)),
        decode_groups=list(groups))


def run_step(model, kv: PagedKVCache, work: list[tuple[Seq, int]], groups: list[DecodeGroup] = ()) -> torch.Tensor:
    """One forward over `work`; appends each computed token's logits to its Seq and advances it.
    Returns the logits, one row per computed token."""
    logits = model(make_batch(work, kv.block_size, groups), kv)
    row = 0
    for seq, n in work:
        seq.logits.extend(logits[row:row + n])
        seq.computed += n
        row += n
    return logits


def new_cache(loaded: LoadedModel, num_blocks: int, block_size: int = 16) -> PagedKVCache:
    return PagedKVCache(KVCacheSpec.for_model(loaded.arch, block_size, loaded.dtype), num_blocks)


def save_tiny_hf_model(folder: Path, config, seed: int = 0, tokenizer=None):
    """Random HF model with weights large enough that attention is far from uniform; returns it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return model


def greedy_chat(loaded: LoadedModel, prompt: str, max_new_tokens: int = 24) -> str:
    """Greedy decode straight on the model and a PagedKVCache (the engine lives elsewhere)."""
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True, tokenize=False)
    tokens = loaded.tokenizer(ids, add_special_tokens=False)["input_ids"]
    block_size = 16
    need = -(-(len(tokens) + max_new_tokens) // block_size)
    kv = new_cache(loaded, need + 3, block_size)
    seq = Seq(list(tokens), blocks=list(range(need + 2, 2, -1))[:need])   # reversed, not from 0
    run_step(loaded.model, kv, [(seq, len(tokens))])
    out = []
    for _ in range(max_new_tokens):
        token = int(seq.logits[-1].argmax())
        if token in loaded.eos_token_ids:
            break
        out.append(token)
        seq.tokens.append(token)
        run_step(loaded.model, kv, [(seq, 1)])
    return loaded.tokenizer.decode(out)
