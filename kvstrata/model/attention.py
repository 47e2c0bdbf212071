"""Paged attention in plain torch: write K/V by slot, read by block table, one SDPA per group.

Same code on CPU and CUDA: no host-side loops over tokens, no device syncs per layer. The work
is planned once per forward (`PagedAttention.plan`) and replayed by every layer:

    tokens:   [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]      decodes first, then prefill chunks
    decodes:  one SDPA for all of them; keys gathered block-wise into (B, KVH, ctx, D),
              ctx = longest decode context rounded up to whole blocks, the rest masked out.
    chunk:    one SDPA per chunk; queries are positions seq_len-n .. seq_len-1 and see keys
              0 .. their own position. A chunk that starts a sequence uses its own K/V directly
              (no gather); a later chunk gathers the sequence's blocks.

GQA without copying K/V: a decode's query heads are grouped as (B, KVH, G, D) so each kv head
is attended by G query rows ("heads" = KVH, "queries" = G). PyTorch's CPU `enable_gqa` path
is much slower in bfloat16 than this grouping. Inputs are always 4-D: PyTorch's CPU SDPA takes
its fused (flash) kernel only for 4-D tensors and falls back to unfused math for 3-D ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstrata.model.forward_batch import ForwardBatch


@dataclass
class PrefillChunk:
    start: int                     # first token row of the chunk in the batch
    end: int                       # one past its last row
    rows: torch.Tensor | None      # gather rows (see _gather_rows) of the blocks holding keys 0..seq_len-1;
                                   # None: the chunk is the whole context
    mask: torch.Tensor | None      # (n, nblk * bs) additive: 0 where a query may see a key, -inf elsewhere


@dataclass
class AttentionPlan:
    """What every layer's attention needs for one forward, built once from the ForwardBatch."""

    slot_mapping: torch.Tensor                # (T,)
    num_decodes: int
    decode_rows: torch.Tensor | None          # gather rows of the decodes' blocks, (sequence, block) order
    decode_mask: torch.Tensor | None          # (B, 1, 1, nblk * bs) additive, like PrefillChunk.mask
    prefills: list[PrefillChunk]


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _gather_rows(block_ids: torch.Tensor, planes: int, num_blocks: int) -> torch.Tensor:
    """Rows of a layer viewed as (planes * num_blocks, bs * D), planes = 2 * KVH, for `block_ids`:
    plane-major, then the blocks in order. Selecting whole rows of that 2-D view runs about twice
    as fast on CPU as selecting along the block dimension of the 3-D view."""
    planes_first = torch.arange(planes, device=block_ids.device)[:, None] * num_blocks
    return (planes_first + block_ids[None, :]).reshape(-1)


class PagedAttention:
    """Attention over a `PagedKVCache` layer. Holds a grow-only gather buffer reused by every layer
    and every step, so reading the cache allocates nothing after warm-up."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self._scratch: torch.Tensor | None = None

    def plan(self, batch: ForwardBatch, block_size: int, num_blocks: int, dtype: torch.dtype) -> AttentionPlan:
        """Masks are additive in `dtype` (SDPA would convert a boolean mask in every layer);
        `num_blocks` is the size of the cache the blocks are gathered from."""
        planes = 2 * self.num_kv_heads
        device = batch.input_ids.device
        qsl = batch.query_start_loc
        seq_lens = batch.seq_lens.tolist()      # one host copy per forward (a sync on CUDA)
        nd = batch.num_decodes
        assert qsl[nd] == nd, "decodes must come first, one token each"
        decode_rows = decode_mask = None
        if nd:
            nblk = -(-max(seq_lens[:nd]) // block_size)
            decode_rows = _gather_rows(batch.block_tables[:nd, :nblk].reshape(-1), planes, num_blocks)
            keys = torch.arange(nblk * block_size, device=device)
            decode_mask = _additive(keys[None, :] < batch.seq_lens[:nd, None], dtype).view(nd, 1, 1, -1)
        prefills = []
        for b in range(nd, batch.num_seqs):
            start, end, seq_len = qsl[b], qsl[b + 1], seq_lens[b]
            n = end - start
            assert 0 < n <= seq_len, f"chunk of {n} tokens in a sequence of {seq_len}"
            if n == seq_len:
                prefills.append(PrefillChunk(start, end, None, None))
                continue
            nblk = -(-seq_len // block_size)
            keys = torch.arange(nblk * block_size, device=device)
            last_visible = torch.arange(seq_len - n, seq_len, device=device)
            mask = _additive(keys[None, :] <= last_visible[:, None], dtype)   # (n, nblk * bs)
            prefills.append(PrefillChunk(start, end, _gather_rows(batch.block_tables[b, :nblk], planes, num_blocks),
                                         mask))
        return AttentionPlan(batch.slot_mapping, nd, decode_rows, decode_mask, prefills)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                 plan: AttentionPlan) -> torch.Tensor:
        """q (T, H, D), k / v (T, KVH, D) already written to the cache; kv_layer (2, KVH, N, bs, D).

        Returns (T, H * D).
        """
        t = q.shape[0]
        h, kvh, g, d = self.num_heads, self.num_kv_heads, self.group, self.head_dim
        out = q.new_empty(t, h * d)                               # (T, H * D)
        nd = plan.num_decodes
        if nd:
            keys, values = self._gather(kv_layer, plan.decode_rows, nd)        # (B, KVH, ctx, D)
            qd = q[:nd].view(nd, kvh, g, d)                        # (B, KVH, G, D)
            o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=plan.decode_mask)
            out[:nd] = o.reshape(nd, h * d)
        for chunk in plan.prefills:
            n = chunk.end - chunk.start
            qc = q[chunk.start:chunk.end].transpose(0, 1)[None]          # (1, H, n, D)
            if chunk.rows is None:
                kc = k[chunk.start:chunk.end].transpose(0, 1)[None]      # (1, KVH, n, D)
                vc = v[chunk.start:chunk.end].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=g > 1)
            else:
                kc, vc = self._gather(kv_layer, chunk.rows, 1)          # (1, KVH, ctx, D)
                o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=chunk.mask, enable_gqa=g > 1)
            out[chunk.start:chunk.end] = o[0].transpose(0, 1).reshape(n, h * d)   # (n, H * D)
        return out

    def _gather(self, kv_layer: torch.Tensor, rows: torch.Tensor, num_seqs: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy blocks into the scratch buffer; returns K, V views of shape (S, KVH, ctx, D)."""
        two, kvh, num_blocks, bs, d = kv_layer.shape
        n = rows.shape[0] // (two * kvh)             # blocks, over all sequences
        need = two * kvh * n * bs * d
        scratch = self._scratch
        if scratch is None or scratch.numel() < need or scratch.dtype != kv_layer.dtype \
                or scratch.device != kv_layer.device:
            size = need if scratch is None else max(need, scratch.numel() * 3 // 2)   # grow rarely
            scratch = self._scratch = torch.empty(size, dtype=kv_layer.dtype, device=kv_layer.device)
        buf = scratch[:need].view(two * kvh * n, bs * d)
        torch.index_select(kv_layer.view(two * kvh * num_blocks, bs * d), 0, rows, out=buf)
        kv = buf.view(two, kvh, num_seqs, n // num_seqs * bs, d)   # (2, KVH, S, ctx, D)
        return kv[0].transpose(0, 1), kv[1].transpose(0, 1)
