"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Pre-norm decoder: x -> RMSNorm -> fused QKV -> RoPE -> paged attention -> O -> residual,
then RMSNorm -> fused gate|up -> SiLU(gate) * up -> down -> residual; final RMSNorm and the
LM head (tied to the embeddings or not). The math follows transformers' `LlamaForCausalLM`
so logits match it in float32; the structure is gpt-fast's: parameters are created on the meta
device and replaced by the loaded tensors (`assign=True`), so weights are never allocated twice.

Q/K/V and gate/up are fused into single matmuls, which matters at decode where each matmul
reads all its weights for a handful of rows.

Once loaded, each projection is a callable `proj(x)` (`DenseLinear` in the model dtype); then
either `pack_projections` hands them to oneDNN (float models on CPU) or `kvstrata.model.quantize`
swaps them for int8 ones; both drop the layers' float weights. `keep_gguf_bits` first swaps those a
GGUF file keeps in 4 or 8 bits for its own blocks (`kvstrata.model.gguf_bits`); when every projection
is at its bits, `fuse_layers` runs a step's layers in one C++ call (`kvstrata.model.fused_layers`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.kvcache.buffers import KVCacheSpec, PagedKVCache
from kvstrata.model.arch import ModelArch
from kvstrata.model.attention import AttentionPlan, PagedAttention
from kvstrata.model.forward_batch import ForwardBatch
from kvstrata.model.fused_layers import FusedLayers, fused_layers
from kvstrata.model.gguf_bits import GGUFBlocks, GGUFLinear, in_one_arena
from kvstrata.model.kernels import NormAct, norm_act
from kvstrata.model.linear import DenseLinear, PackedLinear, Projection, can_pack
from kvstrata.model.lora import LoRABatch
from kvstrata.model.rope import RotaryTables, apply_rotary

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, stat_dtype: torch.dtype = torch.float32,
             fused: NormAct | None = None) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalize in float32, scale in the model dtype. In float32 that is
    `F.rms_norm` (one op to dispatch, half the time of five at one row); in bfloat16 our kernel when
    `fused` (one call, a row's sum in a fixed order), else ten plain ops, since `F.rms_norm` would
    scale in float32. `stat_dtype=float64` sums the mean square in float64: torch splits one row's sum
    across threads but not a batch's rows, so in float32 a row's bits depend on the batch, which bf16
    rounding can turn into another greedy token."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    if fused is not None:
        return fused.rms_norm(x, weight, eps)
    xs = x.to(stat_dtype)
    normed = (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True).add_(eps))).float()
    return weight * normed.to(x.dtype)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, index: int = 0) -> None:
        super().__init__()
        e, i = arch.hidden_size, arch.intermediate_size
        qkv = arch.q_size + 2 * arch.kv_size
        self.arch = arch
        self.index = index                         # its place in the stack (which adapter weights it takes)
        self.norm_stat_dtype = torch.float32       # float64 after LlamaModel.sum_exactly
        self.norm_act: NormAct | None = None       # set by LlamaModel.fuse_norm_act
        self.input_norm = _param(e, dtype=dtype)
        self.qkv = _param(qkv, e, dtype=dtype)
        self.qkv_bias = _param(qkv, dtype=dtype) if arch.attention_bias else None
        self.o = _param(e, arch.q_size, dtype=dtype)
        self.o_bias = _param(e, dtype=dtype) if arch.attention_out_bias else None
        self.post_norm = _param(e, dtype=dtype)
        self.gate_up = _param(2 * i, e, dtype=dtype)
        self.down = _param(e, i, dtype=dtype)
        self.projections: dict[str, Projection] = {}      # filled by bind_projections after loading

    def bind_projections(self) -> None:
        """Make the loaded weights callable as `self.projections[name](x)`."""
        biases = {"qkv": self.qkv_bias, "o": self.o_bias, "gate_up": None, "down": None}
        self.projections = {name: DenseLinear(getattr(self, name), bias) for name, bias in biases.items()}

    def project(self, name: str, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """One projection, plus the step's adapters' low-rank updates on their rows (kvstrata.model.lora)."""
        y = self.projections[name](x)
        return y if lora is None else lora.apply(self.index, name, x, y)

    def qkv_rows(self, h: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """h (T, E) -> RMSNorm, fused QKV (T, (H + 2 KVH) D), before RoPE."""
        x = rms_norm(h, self.input_norm, self.arch.rms_norm_eps, self.norm_stat_dtype, self.norm_act)    # (T, E)
        return self.project("qkv", x, lora)

    def attention_inputs(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lora: LoRABatch | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h (T, E) -> q (T, H, D), k and v (T, KVH, D): RMSNorm, fused QKV, RoPE on q and k."""
        a = self.arch
        t = h.shape[0]
        nh, nkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        qkv = self.qkv_rows(h, lora)                                              # (T, (H + 2 KVH) D)
        qk = apply_rotary(qkv[:, :(nh + nkv) * d].view(t, nh + nkv, d), cos, sin)  # (T, H + KVH, D)
        return qk[:, :nh], qk[:, nh:], qkv[:, (nh + nkv) * d:].view(t, nkv, d)

    def after_attention(self, h: torch.Tensor, o: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """The residual stream h (T, E) and attention's output o (T, H D) -> the layer's output (T, E):
        O projection, residual, RMSNorm, fused gate|up, SiLU(gate) * up, down, residual."""
        h = h + self.project("o", o, lora)
        x = rms_norm(h, self.post_norm, self.arch.rms_norm_eps, self.norm_stat_dtype, self.norm_act)
        gu = self.project("gate_up", x, lora)                                     # (T, 2 I)
        if self.norm_act is not None:
            return h + self.project("down", self.norm_act.silu_mul(gu), lora)
        i = self.arch.intermediate_size
        return h + self.project("down", F.silu(gu[:, :i]) * gu[:, i:], lora)


class LlamaModel(nn.Module):
    """Parameters start on the meta device; `load_hf_weights` makes the model runnable."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.device = torch.empty(0, device=device).device     # canonical: 'cuda' -> 'cuda:0'
        self.embed_tokens = _param(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype, index) for index in range(arch.num_layers))
        self.norm = _param(arch.hidden_size, dtype=dtype)
        self.lm_head = None if arch.tie_word_embeddings else _param(arch.vocab_size, arch.hidden_size,
                                                                    dtype=dtype)
        self.rope = RotaryTables(arch, dtype, self.device)
        # What each layer runs before and after attention: the methods, or torch.compile'd versions
        # of them (see kvstrata.model.compiled); paged attention and the KV write stay eager.
        self.layer_steps = (DecoderLayer.attention_inputs, DecoderLayer.after_attention)
        self.attn = PagedAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self.norm_stat_dtype = torch.float32
        self.exact_sums = False                                 # set by sum_exactly
        self.norm_act: NormAct | None = None                    # set by fuse_norm_act
        self.head: Projection | None = None                     # set by load_hf_weights
        self.fused: FusedLayers | None = None                   # set by fuse_layers

    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...), fuse, convert and
        assign them. Consumes `tensors` (entries are dropped as they are used)."""
        own = {}

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"the checkpoint has no tensor {name!r}")
            return tensors.pop(name).to(self.device, self.dtype)

        own["embed_tokens"] = take("model.embed_tokens.weight")
        own["norm"] = take("model.norm.weight")
        if self.lm_head is not None:
            own["lm_head"] = take("lm_head.weight")
        tensors.pop("lm_head.weight", None)       # tied checkpoints may still store a copy
        for i in range(self.arch.num_layers):
            p, attn, mlp = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            own[f"layers.{i}.input_norm"] = take(p + "input_layernorm.weight")
            own[f"layers.{i}.post_norm"] = take(p + "post_attention_layernorm.weight")
            own[f"layers.{i}.qkv"] = torch.cat([take(attn + f"{x}_proj.weight") for x in "qkv"])
            if self.arch.attention_bias:
                own[f"layers.{i}.qkv_bias"] = torch.cat([take(attn + f"{x}_proj.bias") for x in "qkv"])
            own[f"layers.{i}.o"] = take(attn + "o_proj.weight")
            if self.arch.attention_out_bias:
                own[f"layers.{i}.o_bias"] = take(attn + "o_proj.bias")
            own[f"layers.{i}.gate_up"] = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])
            own[f"layers.{i}.down"] = take(mlp + "down_proj.weight")
        leftover = [n for n in tensors if not n.endswith("rotary_emb.inv_freq")]
        if leftover:
            raise ValueError(f"the checkpoint has {len(leftover)} tensors kvstrata does not use, "
                             f"e.g. {leftover[:3]}")
        self.load_state_dict(own, strict=True, assign=True)
        for name, param in self.named_parameters():
            param.requires_grad_(False)
            assert param.device == self.device, f"{name} on {param.device}"
        for layer in self.layers:
            layer.bind_projections()
        self.head = DenseLinear(self.embed_tokens if self.lm_head is None else self.lm_head, None)

    def keep_gguf_bits(self, blocks: GGUFBlocks) -> list[str]:
        """Serve every projection (and the head) whose parts the file keeps in a type `gguf_bits` runs at
        those bits (`GGUFLinear`); returns the HF names of the matrices left in the model dtype."""
        left: list[str] = []

        def own_bits(projection: Projection, names: list[str]) -> Projection:
            own = blocks.linear(names, getattr(projection, "bias", None))
            if own is None:
                left.extend(names)
                return projection
            return own

        for i, layer in enumerate(self.layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            parts = {"qkv": [attn + f"{x}_proj.weight" for x in "qkv"], "o": [attn + "o_proj.weight"],
                     "gate_up": [mlp + "gate_proj.weight", mlp + "up_proj.weight"], "down": [mlp + "down_proj.weight"]}
            layer.projections = {name: own_bits(layer.projections[name], names) for name, names in parts.items()}
        self.head = own_bits(self.head, ["lm_head.weight" if self.lm_head is not None else "model.embed_tokens.weight"])
        head, self.head = {"head": self.head}, None         # `head` holds its only reference while it moves
        in_one_arena([(layer.projections, name) for layer in self.layers for name in parts
                      if isinstance(layer.projections[name], GGUFLinear)]
                     + ([(head, "head")] if isinstance(head["head"], GGUFLinear) else []))
        self.head = head["head"]
        # The kernel quantizes activations to int8, which turns a last-bit difference into another quant:
        # attention must sum in an order set by the row alone, as for int8 ("Exact attention" in
        # kvstrata.model.attention), and a 16-bit widened projection pads a lone row (`pack_projections`).
        self.attn.compute_dtype = torch.float64
        return left

    def pack_projections(self) -> None:
        """Hand every float projection and the head to oneDNN (`PackedLinear`) when it can take them (those
        kept at a GGUF's bits stay as they are), and drop the layers' float weights (the head of a tied model packs a copy: the embeddings stay)."""
        if not can_pack(self.embed_tokens):
            return
        rows = 2 if self.attn.compute_dtype is not None and self.dtype.itemsize < 4 else 1   # see PackedLinear.__call__
        pack = lambda p: PackedLinear.from_dense(p, rows) if isinstance(p, DenseLinear) else p  # noqa: E731
        for layer in self.layers:
            layer.projections = {name: pack(p) for name, p in layer.projections.items()}
            layer.qkv = layer.o = layer.gate_up = layer.down = layer.qkv_bias = layer.o_bias = None
        self.head = pack(self.head)
        self.lm_head = None

    def fuse_norm_act(self) -> bool:
        """RMSNorm and SiLU-and-multiply by our bf16 kernels (kvstrata.model.kernels.NormAct), one call
        each where torch dispatches ten ops and four, when they take this model; returns whether they
        do. Not with --compile (dynamo cannot trace a ctypes call), nor after `sum_exactly` (float64
        statistics stay torch's, so an exact engine's bits are what they were)."""
        fused = norm_act()
        if fused is None or self.exact_sums or not fused.takes(self.dtype, self.device, self.arch.hidden_size,
                                                               self.arch.intermediate_size):
            return False
        self.norm_act = fused
        for layer in self.layers:
            layer.norm_act = fused
        return True

    def fuse_layers(self) -> bool:
        """Run a step's layers in one C++ call (kvstrata.model.fused_layers) when this model can: bf16, our
        kernels, every projection at a GGUF's bits. The same bits as the Python loop; returns whether it does."""
        self.fused = fused_layers(self)
        return self.fused is not None

    def sum_exactly(self) -> None:
        """`--batch-invariant`: attention and the norms' statistics summed in float64 (attention in
        the paged kernel, whose sums follow the row alone, when it can read the cache), and a lone
        row padded to two in the packed projections, so a 16-bit model's outputs do not depend on
        the batch or on the path that made its KV (docs/design/model.md has the measurements). See
        "Exact attention" in kvstrata.model.attention and `PackedLinear`."""
        self.exact_sums = True
        self.attn.compute_dtype = torch.float64
        self.norm_stat_dtype = torch.float64
        for layer in self.layers:
            layer.norm_stat_dtype = torch.float64

    def step_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every projection, the head and the norms (the
        embedding rows it gathers are few). The roofline figure divides these by the step time."""
        projections = [p for layer in self.layers for p in layer.projections.values()] + [self.head]
        norms = [self.norm] + [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)]
        return sum(p.nbytes for p in projections) + sum(n.numel() * n.element_size() for n in norms)

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

    def _kernels_take(self, plan: AttentionPlan, kv: PagedKVCache) -> bool:
        """Whether our kernels take the whole of every layer between its QKV and O projections this step: RoPE
        with the K/V write (`NormAct.rope_store`) and the paged kernel for every row, the same bits as torch's
        ops and `PagedAttention.__call__` (~25 fewer ops a layer)."""
        return (self.norm_act is not None and plan.kernel_only and self.arch.head_dim <= self.norm_act.rope_max_head_dim
                and self.attn.reads_in_place(kv.block_size, self.dtype, self.device))

    def _rotated_buffers(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The paged kernel's queries, outputs and log-sum-exps for a step's t rows, shared by its layers."""
        a = self.arch
        qf = torch.empty(t, a.num_kv_heads, a.num_heads // a.num_kv_heads, a.head_dim)
        return qf, torch.empty_like(qf), torch.empty(qf.shape[:3])

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Run one step: writes K/V of every token in `batch`, returns float32 logits of shape
        (S, vocab) for the rows `batch.logits_indices`, in that order."""
        assert kv.spec.dtype == self.dtype, f"KV cache is {kv.spec.dtype}, model is {self.dtype}"
        plan = self.attn.plan(batch, kv.block_size, kv.num_blocks, self.dtype)
        cos, sin = self.rope.lookup(batch.positions)                 # (T, 1, D) each
        h = F.embedding(batch.input_ids, self.embed_tokens)         # (T, E)
        before, after = self.layer_steps
        lora = batch.lora
        kernels_only = self._kernels_take(plan, kv)
        if kernels_only and self.fused is not None and lora is None:
            self.fused(h, cos, sin, plan, kv)           # every layer in one call (kvstrata.model.fused_layers)
            return self._logits(h, batch)
        rotated = self._rotated_buffers(h.shape[0]) if kernels_only else None
        for index, layer in enumerate(self.layers):
            if rotated is not None:       # RoPE, the K/V write and the kernel's queries in one call
                kv_layer = kv.layer(index)
                self.norm_act.rope_store(layer.qkv_rows(h, lora), cos, sin, plan.slot_mapping, kv_layer, rotated[0])
                o = self.attn.attend_rotated(rotated[0], kv_layer, plan, *rotated[1:], self.dtype)
            else:
                q, k, v = before(layer, h, cos, sin, lora)
                kv.write(index, plan.slot_mapping, k, v)
                o = self.attn(q, k, v, kv.layer(index), plan)
            h = after(layer, h, o, lora)
        return self._logits(h, batch)

    def _logits(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The last layer's output h (T, E) -> float32 logits (S, vocab) of the rows `batch.logits_indices`."""
        h = rms_norm(h[batch.logits_indices], self.norm, self.arch.rms_norm_eps, self.norm_stat_dtype,
                     self.norm_act)                                 # (S, E)
        return self.head(h).float()                                 # (S, vocab)
