"""Paged attention in plain torch: write K/V by slot, read by block table, shared prefixes once.

Same code on CPU and CUDA: no host-side loops over tokens, no device syncs per layer. The work
is planned once per forward (`PagedAttention.plan`) and replayed by every layer:

    tokens:   [d0 d1 d2 d3 | p0 p0 p0 p0 | p1 p1]      decodes first, then prefill chunks
    decodes:  the paged kernel (kvstrata.model.kernels.paged) reads each decode's blocks where they
              lie, all decodes in one call per layer. Without it (no C++ compiler, a shape it
              cannot read) one gather per layer copies every block the decodes read into one
              buffer, then batched attention per segment (below).
    chunks:   queries are positions seq_len-n .. seq_len-1 and see keys 0 .. their own
              position. The kernel's many-rows path reads every chunk's blocks in place, all
              chunks in one call per layer (`KernelRows`). Without it, one SDPA per chunk: a
              chunk that starts a sequence uses its own K/V directly (no gather); a later chunk
              gathers the sequence's blocks and masks them.

Why the kernel: decode attention costs what it reads, and gathering copied every block before
attending it (a bf16 decode step of 32 x 600 tokens, 2 threads: 76.9-85.1 ms gathering, 54.8-56.5
ms in place). Where it cannot run, attention gathers, and nothing else changes.

Cascade (shared-prefix) attention. Decodes whose block tables start with the same blocks come
as a `DecodeGroup` (the runner finds them, kvstrata.kvcache.prefix_groups). A group's shared blocks
are read once by all of its queries together; each decode then attends to its own blocks after the
prefix, and the two partial results merge exactly by their log-sum-exp (LSE):

    keys of d0:   [ shared prefix P blocks | own blocks ]      same P blocks for d0, d1, d2
    o = o_own + sigmoid(lse_pre - lse_own) * (o_pre - o_own)   (softmax over the union of keys)

    decode segments:   own    rows [0, grouped)      each from its group's prefix end, batched
                       prefix rows of one group      its shared blocks, once for the group
                       own    rows [grouped, nd)     whole contexts, batched

With the kernel, each decode's own part comes from the kernel with its LSE, and only the groups'
prefixes are gathered and attended by `attend`. Without it, grouped rows need the LSE, which SDPA
does not return, so their softmax is written out (`attend`); ungrouped rows keep one SDPA call, and
their results stay bit for bit what they were. Each batched segment pads its sequences to its
longest, so grouped decodes (short own parts) are never padded to an ungrouped one's length. Where
it loses: a group costs an extra pass and a merge per layer, so small groups do not pay, and the
runner forms one only above `group_cost_tokens` saved (far more with the kernel reading in place).

Exact attention (`compute_dtype=torch.float64`: int8 models, 16-bit ones under --batch-invariant).
Each path sums in an order set by the call's shapes, so a row's last bits depend on its batch,
chunk and cache path, which int8 rounding (or a bf16 near-tie) turns into another greedy token.
With the paged kernel every row, prefill rows too, attends its whole context in the kernel, whose
order of sums is the row's own (its decode and many-rows paths sum alike), so exact sums ignore
decode groups there; without it, attention sums in float64 and rounds to float32.

GQA without copying K/V: a decode's query heads are grouped as (.., KVH, G, D) so each kv head
is attended by G query rows. Prefill inputs to SDPA are 4-D: PyTorch's CPU SDPA takes its fused
(flash) kernel only for 4-D tensors and falls back to unfused math for 3-D ones.

The measurements behind each of these choices: docs/design/model.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstrata.model.kernels import PagedDecode
from kvstrata.model.network.forward_batch import DecodeGroup, ForwardBatch


@dataclass
class PrefillChunk:
    start: int                     # first token row of the chunk in the batch
    end: int                       # one past its last row
    rows: torch.Tensor | None      # gather rows (see _gather_rows) of the blocks holding keys 0..seq_len-1 (a
                                   # sliding layer's: from its window's first block); None: the whole context
    mask: torch.Tensor | None      # (n, keys gathered) additive: 0 where a query may see a key, -inf elsewhere


@dataclass
class DecodeSegment:
    """Decodes [start, end) attend to `blocks` blocks each (in `AttentionPlan.prefixes`: one run of
    blocks shared by all of them), read from the decode gather buffer from block `offset` on."""

    start: int
    end: int
    offset: int                    # first block of this segment in the gather buffer
    blocks: int                    # blocks per sequence (a prefix: for the whole segment)
    mask: torch.Tensor | None      # additive, (1, n, 1, blocks * bs) for grouped decodes, else (n, 1, 1, ...);
                                   # None: every key is visible


@dataclass
class KernelCall:
    """Decode rows [start, end) through the paged kernel: row i attends keys [first[i], lens[i]) of the
    blocks tables[i]."""

    start: int
    end: int
    tables: torch.Tensor           # (n, max_blocks) int64
    first: torch.Tensor            # (n,) int64
    lens: torch.Tensor             # (n,) int64


@dataclass
class KernelRows:
    """Prefill rows [start, end) through the kernel's many-rows path, one segment per chunk: segment s
    is rows start + starts[s] .. start + starts[s + 1] - 1 and reads the blocks tables[s]; its last
    position sees keys [0, lens[s]), each earlier one a key less (a sliding layer's: the last `window` of them)."""

    start: int
    end: int
    tables: torch.Tensor           # (S, max_blocks) int64
    starts: torch.Tensor           # (S + 1,) int64
    lens: torch.Tensor             # (S,) int64
    window: int = 0                # 0: every key


@dataclass
class AttentionPlan:
    """What every layer's attention needs for one forward, built once from the ForwardBatch."""

    slot_mapping: torch.Tensor                # (T,)
    num_decodes: int
    decode_rows: torch.Tensor | None          # gather rows of every decode segment, segment after segment
    grouped: int                              # decodes [0, grouped) are in groups
    own: list[DecodeSegment]                  # each decode in exactly one; grouped rows first
    prefixes: list[DecodeSegment]             # one per DecodeGroup, shared
    prefills: list[PrefillChunk]              # chunks attended in torch (no kernel)
    in_place: KernelCall | None               # decodes through the kernel (their own part, after any
                                              # group's prefix); they leave `own` empty
    rows: KernelRows | None                   # every prefill chunk, when the kernel reads this cache

    @property
    def kernel_only(self) -> bool:
        """Whether the paged kernel attends every row, with no prefix to merge: its float32 queries are all
        attention needs (`PagedAttention.attend_rotated`)."""
        return not (self.grouped or self.prefills or (self.num_decodes and self.in_place is None))


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _visible(keys: torch.Tensor, query: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys a query at position `query` sees (broadcast): every key up to its own, or with a sliding
    window the last `window` of them (transformers' `kv_idx > q_idx - window`)."""
    seen = keys <= query
    return seen if window is None else seen & (keys > query - window)


def _gather_rows(block_ids: torch.Tensor, planes: int, num_blocks: int) -> torch.Tensor:
    """Rows of a layer viewed as (planes * num_blocks, bs * D), planes = 2 * KVH, for `block_ids`:
    plane-major, then the blocks in order. Selecting whole rows of that 2-D view runs about twice
    as fast on CPU as selecting along the block dimension of the 3-D view."""
    planes_first = torch.arange(planes, device=block_ids.device)[:, None] * num_blocks
    return (planes_first + block_ids[None, :]).reshape(-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T + mask) v and each query's log-sum-exp of scores (float32, trailing dim 1).

    q (..., Lq, D) already scaled, k / v (..., Lk, D); every query must see at least one key.
    Scores and their sums are at least float32 whatever the model dtype (as SDPA accumulates)."""
    s = torch.matmul(q, k.transpose(-1, -2))                       # (..., Lq, Lk)
    if s.dtype.itemsize < 4:
        s = s.float()
    if mask is not None:
        s.add_(mask)
    top = s.amax(-1, keepdim=True)
    p = s.sub_(top).exp_()
    total = p.sum(-1, keepdim=True)
    o = torch.matmul(p if v.dtype == p.dtype else p.to(v.dtype), v)   # (..., Lq, D)
    o.div_(total if o.dtype == total.dtype else total.to(o.dtype))
    return o, total.log_().add_(top)


class PagedAttention:
    """Attention over a `PagedKVCache` layer. Holds a grow-only gather buffer reused by every layer
    and every step, so reading the cache allocates nothing after warm-up."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kernel: PagedDecode | None,
                 compute_dtype: torch.dtype | None = None, scale: float | None = None) -> None:
        self.scale = head_dim ** -0.5 if scale is None else scale     # of q k^T (Gemma: query_pre_attn_scalar's)
        self.sdpa_scale = scale                   # None: SDPA's own 1 / sqrt(D), the same value, its bits as ever
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.compute_dtype = compute_dtype        # None: the KV cache's dtype; see "Exact attention"
        self.kernel = kernel                      # None: decodes gather their blocks
        self._scratch: list[torch.Tensor | None] = [None, None]

    def reads_in_place(self, block_size: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether decodes go through the paged kernel (a cache of `dtype` on `device`)."""
        return self.kernel is not None and self.kernel.supports(dtype, self.group, self.head_dim, block_size, device)

    def plan(self, batch: ForwardBatch, block_size: int, num_blocks: int, dtype: torch.dtype,
             window: int | None = None) -> AttentionPlan:
        """Masks are additive in `dtype` (SDPA would convert a boolean mask in every layer);
        `num_blocks` is the size of the cache the blocks are gathered from. `window`: the plan of a sliding layer,
        whose query at position p sees keys (p - window, p] only: decodes read from their window's start, no
        group shares a prefix (it may lie outside a window), and prefill chunks read from their windows' start
        (through the kernel, or masked in torch)."""
        planes = 2 * self.num_kv_heads
        device = batch.input_ids.device
        qsl = batch.query_start_loc
        seq_lens = batch.seq_lens.tolist()      # one host copy per forward (a sync on CUDA)
        nd = batch.num_decodes
        assert qsl[nd] == nd, "decodes must come first, one token each"
        kernel = self.reads_in_place(block_size, dtype, device)
        assert not kernel or max(seq_lens) <= batch.block_tables.shape[1] * block_size, \
            "the kernel reads raw memory: every key must lie in its table"
        # Exact sums with the kernel: every row, decode or prefill, attends its whole context in the
        # kernel, whose order of sums is the row's own: its bits depend on no path, batch or group.
        every_row = kernel and self.compute_dtype is not None
        dtype = self.compute_dtype or dtype
        groups = [] if every_row or window is not None else batch.decode_groups
        decode_rows, grouped, own, prefixes = self._plan_decodes(batch, groups, seq_lens, block_size, num_blocks,
                                                                 dtype, kernel, window) if nd else (None, 0, [], [])
        in_place = None
        if nd and kernel:
            first = torch.zeros(nd, dtype=torch.int64, device=device)
            for group in groups:
                first[group.start:group.end] = group.prefix_blocks * block_size
            if window is not None:
                first = (batch.seq_lens[:nd] - window).clamp_(min=0)
            in_place = KernelCall(0, nd, batch.block_tables[:nd], first, batch.seq_lens[:nd])
        prefills, rows = [], None
        if kernel and batch.num_seqs > nd:
            starts = torch.tensor(qsl[nd:], dtype=torch.int64, device=device) - qsl[nd]
            rows = KernelRows(qsl[nd], qsl[-1], batch.block_tables[nd:], starts, batch.seq_lens[nd:], window or 0)
        for b in range(nd, batch.num_seqs):
            start, end, seq_len = qsl[b], qsl[b + 1], seq_lens[b]
            n = end - start
            assert 0 < n <= seq_len, f"chunk of {n} tokens in a sequence of {seq_len}"
            if rows is not None:                  # the kernel attends every chunk
                continue
            if n == seq_len:
                own_mask = None
                if window is not None and n > window:
                    pos = torch.arange(n, device=device)
                    own_mask = _additive(_visible(pos[None, :], pos[:, None], window), dtype)      # (n, n)
                prefills.append(PrefillChunk(start, end, None, own_mask))
                continue
            nblk = -(-seq_len // block_size)
            lo = 0 if window is None else max(0, seq_len - n - window + 1) // block_size   # the window's first block
            keys = torch.arange(lo * block_size, nblk * block_size, device=device)
            last_visible = torch.arange(seq_len - n, seq_len, device=device)
            mask = _additive(_visible(keys[None, :], last_visible[:, None], window), dtype)   # (n, keys)
            prefills.append(PrefillChunk(start, end, _gather_rows(batch.block_tables[b, lo:nblk], planes, num_blocks),
                                         mask))
        return AttentionPlan(batch.slot_mapping, nd, decode_rows, grouped, own, prefixes, prefills, in_place, rows)

    def _plan_decodes(self, batch: ForwardBatch, groups: list[DecodeGroup], seq_lens: list[int], block_size: int,
                      num_blocks: int, dtype: torch.dtype, in_place: bool, window: int | None
                      ) -> tuple[torch.Tensor | None, int, list[DecodeSegment], list[DecodeSegment]]:
        """The gather rows of every decode segment (one tensor; None if there are none), the number of
        grouped decodes, the own segments and the prefix segments. `in_place`: the kernel reads the
        decodes' own blocks, so there are no own segments and only the prefixes are gathered."""
        nd, tables = batch.num_decodes, batch.block_tables
        device = tables.device
        grouped = groups[-1].end if groups else 0
        first_own = [0] * nd                   # each decode's first block after its group's prefix
        expected = 0
        for group in groups:
            assert group.start == expected and group.end > group.start, "groups tile the first decode rows"
            assert 0 < group.prefix_blocks and all(group.prefix_blocks * block_size < n
                                                   for n in seq_lens[group.start:group.end]), \
                "a group's prefix is whole blocks before each member's own token"
            first_own[group.start:group.end] = [group.prefix_blocks] * (group.end - group.start)
            expected = group.end
        assert grouped <= nd, "groups hold decodes only"
        planes = 2 * self.num_kv_heads
        rows, own, prefixes, offset = [], [], [], 0
        for start, end in ((0, grouped), (grouped, nd)):
            if start == end or in_place:
                continue
            blocks = max(-(-seq_lens[b] // block_size) - first_own[b] for b in range(start, end))
            first = torch.tensor(first_own[start:end], device=device)[:, None]
            cols = first + torch.arange(blocks, device=device)                      # (n, blocks)
            ids = tables[start:end].gather(1, cols.clamp(max=tables.shape[1] - 1))  # past the table: masked
            keys = (cols[:, :, None] * block_size + torch.arange(block_size, device=device)).view(end - start, -1)
            mask = _additive(_visible(keys, batch.seq_lens[start:end, None] - 1, window), dtype)   # (n, blocks * bs)
            shape = (1, end - start, 1, -1) if start < grouped else (end - start, 1, 1, -1)   # see _decodes
            own.append(DecodeSegment(start, end, offset, blocks, mask.view(shape)))
            rows.append(_gather_rows(ids.reshape(-1), planes, num_blocks))
            offset += (end - start) * blocks
        for group in groups:
            ids = tables[group.start, :group.prefix_blocks]
            prefixes.append(DecodeSegment(group.start, group.end, offset, group.prefix_blocks, None))
            rows.append(_gather_rows(ids, planes, num_blocks))
            offset += group.prefix_blocks
        return (torch.cat(rows) if rows else None), grouped, own, prefixes

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                 plan: AttentionPlan) -> torch.Tensor:
        """q (T, H, D), k / v (T, KVH, D) already written to the cache; kv_layer (2, KVH, N, bs, D).

        Returns (T, H * D).
        """
        t = q.shape[0]
        h, kvh, g, d = self.num_heads, self.num_kv_heads, self.group, self.head_dim
        out = q.new_empty(t, h * d)                               # (T, H * D), in the model's dtype
        if plan.in_place is not None:
            self._in_place(q, kv_layer, plan.in_place, plan, out)
        if plan.rows is not None:
            self._rows(q, kv_layer, plan.rows, out)
        gathered_decodes = plan.num_decodes > 0 and plan.in_place is None
        if not (gathered_decodes or plan.prefills):
            return out
        if self.compute_dtype is not None:
            q, k, v = q.to(self.compute_dtype), k.to(self.compute_dtype), v.to(self.compute_dtype)
        if gathered_decodes:
            self._decodes(q, kv_layer, plan, out)
        for chunk in plan.prefills:
            n = chunk.end - chunk.start
            qc = q[chunk.start:chunk.end].transpose(0, 1)[None]          # (1, H, n, D)
            if chunk.rows is None:
                kc = k[chunk.start:chunk.end].transpose(0, 1)[None]      # (1, KVH, n, D)
                vc = v[chunk.start:chunk.end].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                                   enable_gqa=g > 1, scale=self.sdpa_scale)
            else:
                kv = self._blocks(self._gather(kv_layer, chunk.rows), 0, chunk.rows.shape[0] // (2 * kvh))
                o = F.scaled_dot_product_attention(qc, kv[0][None], kv[1][None], attn_mask=chunk.mask,
                                                   enable_gqa=g > 1, scale=self.sdpa_scale)
            out[chunk.start:chunk.end] = o[0].transpose(0, 1).reshape(n, h * d)   # (n, H * D)
        return out

    def attend_rotated(self, qf: torch.Tensor, kv_layer: torch.Tensor, plan: AttentionPlan, o: torch.Tensor,
                       lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`__call__` for a `kernel_only` plan whose queries came rotated and widened, qf (T, KVH, G, D) float32,
        their K/V already in the cache (`NormAct.rope_store`): (T, H * D) in `dtype`, the same bits. o like
        qf and lse (T, KVH, G) are the kernels' outputs, reused by every layer of a step."""
        assert plan.kernel_only and qf.shape == o.shape and qf.shape[:3] == lse.shape
        t, scale = qf.shape[0], self.scale
        rows = lambda x, start, end: x if (start, end) == (0, t) else x[start:end]   # noqa: E731 (no op for a whole step)
        if plan.in_place is not None:
            c = plan.in_place
            self.kernel(rows(qf, c.start, c.end), kv_layer, c.tables, c.first, c.lens, scale, rows(o, c.start, c.end),
                        rows(lse, c.start, c.end))
        if plan.rows is not None:
            r = plan.rows
            self.kernel.rows(rows(qf, r.start, r.end), kv_layer, r.tables, r.starts, r.lens, scale,
                             rows(o, r.start, r.end), rows(lse, r.start, r.end), r.window)
        return o.view(t, -1).to(dtype)

    def _decodes(self, q: torch.Tensor, kv_layer: torch.Tensor, plan: AttentionPlan, out: torch.Tensor) -> None:
        """Attention of the decode rows of q (T, H, D) into out (T, H * D): grouped rows by hand (own
        part, then each group's prefix merged in), the others by one SDPA."""
        h, kvh, g, d = self.num_heads, self.num_kv_heads, self.group, self.head_dim
        buf = self._gather(kv_layer, plan.decode_rows)
        for seg in plan.own:
            n = seg.end - seg.start
            keys = self._blocks(buf, seg.offset, n * seg.blocks).unflatten(2, (n, -1))   # (2, KVH, n, L, D)
            if seg.start < plan.grouped:
                out[seg.start:seg.end] = self._grouped(q[seg.start:seg.end], keys, seg.mask, buf, plan.prefixes)
            else:
                qs = q[seg.start:seg.end].view(n, kvh, g, d)                          # (n, KVH, G, D)
                o = F.scaled_dot_product_attention(qs, keys[0].transpose(0, 1), keys[1].transpose(0, 1),
                                                   attn_mask=seg.mask, scale=self.sdpa_scale)   # (n, KVH, G, D)
                out[seg.start:seg.end] = o.reshape(n, h * d)

    def _grouped(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, buf: torch.Tensor,
                 prefixes: list[DecodeSegment]) -> torch.Tensor:
        """Grouped decodes, q (n, H, D) and their own keys (2, KVH, n, L, D) -> (n, H * D)."""
        n = q.shape[0]
        kvh, g, d = self.num_kv_heads, self.group, self.head_dim
        qd = q.view(n, kvh, g, d).transpose(0, 1).contiguous().mul_(self.scale)   # (KVH, n, G, D)
        o, lse = attend(qd, keys[0], keys[1], mask)                                  # (KVH, n, G, D)
        self._merge_prefixes(qd, o, lse, buf, prefixes)
        return o.transpose(0, 1).reshape(n, kvh * g * d)

    def _merge_prefixes(self, qd: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, buf: torch.Tensor,
                        prefixes: list[DecodeSegment]) -> None:
        """Attend each group's queries (rows of qd (KVH, n, G, D), scaled) to its shared prefix in the
        gather buffer, once for the group, and merge that into o (KVH, n, G, D) by the log-sum-exps
        lse (KVH, n, G, 1) of o's keys."""
        kvh, g, d = self.num_kv_heads, self.group, self.head_dim
        for seg in prefixes:
            m = seg.end - seg.start
            shared = self._blocks(buf, seg.offset, seg.blocks)                       # (2, KVH, P * bs, D)
            o_pre, lse_pre = attend(qd[:, seg.start:seg.end].reshape(kvh, m * g, d), shared[0], shared[1], None)
            weight = torch.sigmoid(lse_pre.view(kvh, m, g, 1) - lse[:, seg.start:seg.end])
            o[:, seg.start:seg.end].lerp_(o_pre.view(kvh, m, g, d).to(o.dtype), weight.to(o.dtype))

    def _in_place(self, q: torch.Tensor, kv_layer: torch.Tensor, call: KernelCall, plan: AttentionPlan,
                  out: torch.Tensor) -> None:
        """Decode rows [call.start, call.end) of q (T, H, D) through the paged kernel (their blocks read
        in place, in float32) into out (T, H * D); grouped decodes get their group's prefix merged in."""
        n, grouped = call.end - call.start, plan.grouped
        qf, o, lse = self._kernel_buffers(q, call.start, call.end)
        kvh, g, d = self.num_kv_heads, self.group, self.head_dim
        self.kernel(qf, kv_layer, call.tables, call.first, call.lens, self.scale, o, lse)
        if grouped:
            qd = q[:grouped].view(grouped, kvh, g, d).transpose(0, 1).contiguous().mul_(self.scale)
            self._merge_prefixes(qd, o[:grouped].transpose(0, 1), lse[:grouped].transpose(0, 1).unsqueeze(-1),
                                 self._gather(kv_layer, plan.decode_rows), plan.prefixes)
        out[call.start:call.end] = o.view(n, kvh * g * d)

    def _rows(self, q: torch.Tensor, kv_layer: torch.Tensor, rows: KernelRows, out: torch.Tensor) -> None:
        """Prefill rows [rows.start, rows.end) of q (T, H, D) through the kernel into out (T, H * D)."""
        qf, o, lse = self._kernel_buffers(q, rows.start, rows.end)
        self.kernel.rows(qf, kv_layer, rows.tables, rows.starts, rows.lens, self.scale, o, lse, rows.window)
        out[rows.start:rows.end] = o.view(rows.end - rows.start, -1)

    def _kernel_buffers(self, q: torch.Tensor, start: int, end: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows [start, end) of q (T, H, D) as the kernels read them, (n, KVH, G, D) float32, and room
        for their outputs and log-sum-exps."""
        n, kvh, g, d = end - start, self.num_kv_heads, self.group, self.head_dim
        qf = torch.empty(n, kvh, g, d)
        qf.view(n, kvh * g, d).copy_(q[start:end])
        return qf, torch.empty_like(qf), torch.empty(n, kvh, g)

    def _gather(self, kv_layer: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Copy the block rows `rows` (see _gather_rows) into the scratch buffer, in `compute_dtype`
        when one is set; returns it as (rows, bs * D). Read it back with `_blocks`."""
        two, kvh, num_blocks, bs, d = kv_layer.shape
        need = rows.shape[0] * bs * d
        buf = self._buffer(0, need, kv_layer.dtype, kv_layer.device).view(rows.shape[0], bs * d)
        torch.index_select(kv_layer.view(two * kvh * num_blocks, bs * d), 0, rows, out=buf)
        if self.compute_dtype is None or self.compute_dtype == buf.dtype:
            return buf
        # Into a kept buffer: a fresh float64 tensor per layer (`.to()`) pays its page faults every time.
        return self._buffer(1, need, self.compute_dtype, kv_layer.device).view_as(buf).copy_(buf)

    def _buffer(self, index: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`numel` elements of grow-only scratch buffer `index` (0: the gather, 1: its compute_dtype copy)."""
        scratch = self._scratch[index]
        if scratch is None or scratch.numel() < numel or scratch.dtype != dtype or scratch.device != device:
            size = numel if scratch is None else max(numel, scratch.numel() * 3 // 2)   # grow rarely
            scratch = self._scratch[index] = torch.empty(size, dtype=dtype, device=device)
        return scratch[:numel]

    def _blocks(self, buf: torch.Tensor, offset: int, count: int) -> torch.Tensor:
        """K and V of `count` blocks from block `offset` of a gather buffer filled by one `_gather_rows`
        call per run of blocks: (2, KVH, count * bs, D), contiguous."""
        planes = 2 * self.num_kv_heads
        part = buf[planes * offset:planes * (offset + count)]           # (planes * count, bs * D)
        return part.view(2, self.num_kv_heads, -1, self.head_dim)
