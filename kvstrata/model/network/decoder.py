"""The decoder over a paged KV cache, assembled once from its parts and never changed afterwards.

Pre-norm decoder: x -> RMSNorm -> fused QKV -> RoPE -> paged attention -> O -> residual,
then RMSNorm -> fused gate|up -> SiLU(gate) * up -> down -> residual; final RMSNorm and the
LM head. The math follows transformers' `LlamaForCausalLM` so logits match it in float32, and its family's model
for what a description adds (kvstrata.model.network.layer): a sliding layer attends its window only, with its
own RoPE where the family has one, through an attention plan of its own.

`ModelParts` is what the builder (kvstrata.model.builder) hands over: the description, the embeddings and
norms, and the projections a weight format packed (`proj(x)`: the decoder never asks which format). `Kernels`
is which of our kernels this model runs with. `DecoderModel` takes both and picks its step loop once
(kvstrata.model.network.steps): a test that compares paths assembles a second model from the same parts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvstrata.kvcache.buffers import KVCacheSpec, PagedKVCache
from kvstrata.model.arch import ModelArch
from kvstrata.model.formats.base import Norms, Packed
from kvstrata.model.network.attention import PagedAttention
from kvstrata.model.network.forward_batch import ForwardBatch
from kvstrata.model.network.layer import DecoderLayer, rms_norm
from kvstrata.model.network.rope import RotaryTables
from kvstrata.model.network.steps import Kernels, Sliding, Step, step_loop


@dataclass(frozen=True)
class ModelParts:
    """Everything a decoder is made of, as the builder made it."""

    arch: ModelArch
    dtype: torch.dtype
    device: torch.device
    embeddings: torch.Tensor               # (vocab, hidden)
    norms: Norms
    packed: Packed
    exact_attention: bool                  # attention sums in float64, by the row alone ("Exact attention")
    exact_norms: bool                      # `--batch-invariant` on 16 bits: the norms' statistics in float64


class DecoderModel:
    """A runnable decoder: `model(batch, kv)` -> logits. Made by `DecoderModel(parts, kernels)`, never changed."""

    def __init__(self, parts: ModelParts, kernels: Kernels) -> None:
        a = parts.arch
        self.parts = parts
        self.kernels = kernels
        self.arch = a
        self.dtype = parts.dtype
        self.device = parts.device
        self.embed_tokens = parts.embeddings
        self.norm = parts.norms.final
        self.head = parts.packed.head
        stat = torch.float64 if parts.exact_norms else torch.float32
        self.norm_stat_dtype = stat
        self.norm_act = kernels.norm_act
        others = parts.norms.others or [{} for _ in range(a.num_layers)]
        self.layers = [DecoderLayer(a, i, parts.norms.input[i], parts.norms.post[i], parts.packed.layers[i],
                                    kernels.norm_act, stat, others[i]) for i in range(a.num_layers)]
        self.rope = RotaryTables(a, parts.dtype, parts.device)
        # the sliding layers' RoPE when it is their own (Gemma 3's local base)
        self.local_rope = RotaryTables(a.local(), parts.dtype, parts.device) if a.local() is not a else self.rope
        # Gemma scales the embeddings by sqrt(hidden) rounded to the model dtype, as transformers does
        self.embed_scale = torch.tensor(a.hidden_size ** 0.5).to(parts.dtype) if a.embedding_scale else None
        self.attn = PagedAttention(a.num_heads, a.num_kv_heads, a.head_dim, kernels.paged,
                                   torch.float64 if parts.exact_attention else None, a.query_scale)
        self.loop = step_loop(self)

    def step_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every projection, the head and the norms (the
        embedding rows it gathers are few). The roofline figure divides these by the step time."""
        norms = [self.norm] + [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)]
        return sum(p.nbytes for p in self.parts.packed.in_call_order()) + sum(n.numel() * n.element_size()
                                                                            for n in norms)

    def prefill_alone(self, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
        """Logits of one sequence computed in one piece through a scratch cache of its own (for
        calibration and warm-up; the engine never calls it)."""
        n = len(token_ids)
        kv = PagedKVCache(KVCacheSpec.for_model(self.arch, block_size, self.dtype), -(-n // block_size), self.device)
        pos = torch.arange(n, device=self.device)
        table = torch.arange(kv.num_blocks, device=self.device).view(1, -1)
        slots = table[0, pos // block_size] * block_size + pos % block_size
        batch = ForwardBatch(torch.tensor(token_ids, device=self.device), pos, slots, table,
                             torch.tensor([n], device=self.device), [0, n], 0, pos)
        return self(batch, kv)

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Run one step: writes K/V of every token in `batch`, returns float32 logits of shape
        (S, vocab) for the rows `batch.logits_indices`, in that order."""
        assert kv.spec.dtype == self.dtype, f"KV cache is {kv.spec.dtype}, model is {self.dtype}"
        plan = self.attn.plan(batch, kv.block_size, kv.num_blocks, self.dtype)
        cos, sin = self.rope.lookup(batch.positions)                 # (T, 1, D) each
        sliding, plans = None, ()
        if kv.spec.groups is not None:      # each KV group's plan reads its own block tables
            plans = (plan,) + tuple(self.attn.plan(replace(batch, block_tables=tables, slot_mapping=slots,
                                                           decode_groups=[]), kv.block_size, kv.num_blocks,
                                                   self.dtype, window)
                                    for (tables, slots), window in zip(batch.group_tables, kv.spec.groups.windows[1:]))
        if self.arch.sliding_window is not None:
            local = self.local_rope.lookup(batch.positions) if self.local_rope is not self.rope else (cos, sin)
            sliding = Sliding(*local, None if plans else self.attn.plan(batch, kv.block_size, kv.num_blocks,
                                                                        self.dtype, self.arch.sliding_window))
        h = F.embedding(batch.input_ids, self.embed_tokens)         # (T, E)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        h = self.loop(h, Step(cos, sin, plan, kv, batch.lora, sliding, plans))
        h = rms_norm(h[batch.logits_indices], self.norm, self.arch.rms_norm_eps, self.norm_stat_dtype,
                     self.norm_act)                                 # (S, E)
        return self.head(h).float()                                 # (S, vocab)
