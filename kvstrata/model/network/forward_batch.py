"""`ForwardBatch`: one step's work for the model, as tensors.

The runner flattens every scheduled chunk (decodes and prefill pieces) into one
token axis. Decodes come first, one query token each, so attention can batch
them; prefill chunks follow, each a run of consecutive positions.

    sequence:      d0   d1   p0 ............ p1 .......
    input_ids:    [a ] [b ] [c  c  c  c  c ] [e  e  e ]      T tokens
    query_start:   0    1    2               7          10
    seq_lens:      ctx of each sequence after this step (positions already in KV + new)

K/V of token i is written to flat slot `slot_mapping[i] = block_id * block_size + offset`;
attention reads a sequence's keys 0..seq_len-1 through its row of `block_tables`.

Decodes whose block tables start with the same block ids may form a `DecodeGroup` (rows next to
each other, groups back to back from row 0, ungrouped decodes after them): attention reads their
shared prefix once for the whole group (see kvstrata.model.network.attention). Groups are optional: with
none, every decode reads its own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstrata.kvcache.prefix_groups import DecodeGroup  # re-exported: it lives where torch is not needed
from kvstrata.model.adapters.lora import LoRABatch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # (T,) int64
    positions: torch.Tensor        # (T,) int64, position of each token in its sequence
    slot_mapping: torch.Tensor     # (T,) int64, flat KV slot each token's K/V is written to
    block_tables: torch.Tensor     # (B, max_blocks) int64, padded with 0
    seq_lens: torch.Tensor         # (B,) int64, tokens in KV for each sequence after this step
    query_start_loc: list[int]     # B + 1 ints: sequence b's tokens are [qsl[b], qsl[b + 1])
    num_decodes: int               # sequences [0, num_decodes) have exactly one query token
    logits_indices: torch.Tensor   # (S,) int64, token rows whose logits are returned, in order
    decode_groups: list[DecodeGroup] = field(default_factory=list)   # back to back from row 0
    lora: LoRABatch | None = None  # the rows that run under an adapter (kvstrata.model.adapters); None: all base
    # With KV groups (kvstrata.kvcache.kv_groups), groups 1..'s block tables and slot mappings, shaped as above
    group_tables: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_start_loc) - 1
