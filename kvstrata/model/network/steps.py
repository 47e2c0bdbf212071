"""A step's walk through the layers, chosen once when a model is made: the one forward path.

    FusedLoop    every layer in one C++ call (kvstrata.model.network.fused): a bf16 model whose every projection
                 is at a GGUF's bits, with our norm and paged kernels
    KernelLoop   per layer: RoPE with the K/V write and the paged kernel's queries in one call
                 (`NormAct.rope_store`), the paged kernel for every row: a bf16 model on the CPU with our kernels
    TorchLoop    per layer: torch's ops around attention (or their torch.compile'd versions, `--compile`); the
                 one loop for layers other than Llama's (`ModelArch.plain_layers`: Qwen 3, Gemma 3), whose
                 attention still reads the cache through the paged kernel, a sliding layer from its window's start

A loop that cannot take a step hands it to the next one down, whole: the fused and kernel loops need the paged
kernel to attend every row with nothing to merge (`AttentionPlan.kernel_only`), and the fused loop no adapter in
the step. All three give the same bits (tests/model/test_fused_layers.py), so the hand-off changes no output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from kvstrata.kvcache.buffers import PagedKVCache
from kvstrata.model.adapters.lora import LoRABatch
from kvstrata.model.arch import ModelArch
from kvstrata.model.kernels import DecoderLayers, NormAct, PagedDecode
from kvstrata.model.network.attention import AttentionPlan, PagedAttention
from kvstrata.model.network.compiled import compiled_steps
from kvstrata.model.network.fused import FusedLayers, fused_layers
from kvstrata.model.network.layer import DecoderLayer


@dataclass(frozen=True)
class Kernels:
    """Which of our kernels a model runs with (None: torch's ops for that part). `layers` is the fused C++ loop,
    for a bf16 model whose every projection is at a GGUF's bits."""

    paged: PagedDecode | None = None
    norm_act: NormAct | None = None
    layers: DecoderLayers | None = None
    compiled: bool = False                 # torch.compile the work around attention (`--compile`)


class Walked(Protocol):
    """What the loops read of the model they walk (a kvstrata.model.network.decoder.DecoderModel)."""

    arch: ModelArch
    dtype: torch.dtype
    device: torch.device
    layers: list[DecoderLayer]
    attn: PagedAttention
    kernels: Kernels
    norm_act: NormAct | None


@dataclass(frozen=True)
class Sliding:
    """What the sliding layers read instead of the global ones' rows and plan: their RoPE and their window."""

    cos: torch.Tensor
    sin: torch.Tensor
    plan: AttentionPlan | None          # None with KV groups: each group's plan is in `Step.plans`


@dataclass(frozen=True)
class Step:
    """What every layer of one forward reads besides the residual stream: the RoPE rows, the attention plan, the
    cache it writes K/V into and reads from, the step's adapters; the sliding layers' own (`sliding`)."""

    cos: torch.Tensor                   # (T, 1, D)
    sin: torch.Tensor
    plan: AttentionPlan
    kv: PagedKVCache
    lora: LoRABatch | None
    sliding: Sliding | None = None
    plans: tuple[AttentionPlan, ...] = ()   # with KV groups (kv.spec.groups): each group's, over its block tables

    def of(self, layer: DecoderLayer) -> tuple[torch.Tensor, torch.Tensor, AttentionPlan]:
        """The RoPE rows and plan `layer` reads."""
        cos, sin, plan = (self.cos, self.sin, self.plan) if layer.window is None else \
            (self.sliding.cos, self.sliding.sin, self.sliding.plan)
        if self.plans:
            plan = self.plans[self.kv.spec.groups.group_of[layer.index]]
        return cos, sin, plan


class StepLoop:
    """A way through the layers of `model`: `takes` says whether it can run this step, else `fallback` (the next
    loop down) runs it whole."""

    name: ClassVar[str]

    def __init__(self, model: Walked, fallback: StepLoop | None = None) -> None:
        self.model = model
        self.fallback = fallback

    def takes(self, step: Step) -> bool:
        return True

    def run(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        """The residual stream h (T, E) after every layer, each layer's K/V written to the step's cache."""
        if self.fallback is not None and not self.takes(step):
            return self.fallback(h, step)
        return self.run(h, step)


class TorchLoop(StepLoop):
    name = "torch's ops"

    def __init__(self, model: Walked, compiled: bool) -> None:
        super().__init__(model)
        self.before, self.after = compiled_steps() if compiled else (DecoderLayer.attention_inputs,
                                                                     DecoderLayer.after_attention)
        if compiled:
            self.name = "torch's ops, compiled"

    def run(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        model, kv = self.model, step.kv
        for index, layer in enumerate(model.layers):
            cos, sin, plan = step.of(layer)
            q, k, v = self.before(layer, h, cos, sin, step.lora)
            kv.write(index, plan.slot_mapping, k, v)
            h = self.after(layer, h, model.attn(q, k, v, kv.layer(index), plan), step.lora)
        return h


class KernelLoop(StepLoop):
    name = "the paged kernel with RoPE and the K/V write in one call"

    def takes(self, step: Step) -> bool:
        """Whether our kernels take the whole of every layer between its QKV and O projections this step: RoPE
        with the K/V write and the paged kernel for every row, the same bits as torch's ops and
        `PagedAttention.__call__` (~25 fewer ops a layer)."""
        model = self.model
        return (not step.plans and step.plan.kernel_only
                and model.attn.reads_in_place(step.kv.block_size, model.dtype, model.device))

    def run(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        model, a, plan = self.model, self.model.arch, step.plan
        qf = torch.empty(h.shape[0], a.num_kv_heads, a.num_heads // a.num_kv_heads, a.head_dim)   # the kernel's
        o, lse = torch.empty_like(qf), torch.empty(qf.shape[:3])                 # queries, outputs, log-sum-exps
        for index, layer in enumerate(model.layers):
            kv_layer = step.kv.layer(index)
            model.norm_act.rope_store(layer.qkv_rows(h, step.lora), step.cos, step.sin, plan.slot_mapping, kv_layer, qf)
            h = layer.after_attention(h, model.attn.attend_rotated(qf, kv_layer, plan, o, lse, model.dtype), step.lora)
        return h


class FusedLoop(StepLoop):
    name = "the decoder layers in one C++ call"

    def __init__(self, model: Walked, fused: FusedLayers, fallback: KernelLoop) -> None:
        super().__init__(model, fallback)
        self.fused = fused

    def takes(self, step: Step) -> bool:
        return step.lora is None and self.fallback.takes(step)

    def run(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        self.fused(h, step.cos, step.sin, step.plan, step.kv)       # h updated in place
        return h


def step_loop(model: Walked) -> StepLoop:
    """The fastest loop `model`'s kernels allow (module docstring)."""
    k = model.kernels
    loop: StepLoop = TorchLoop(model, k.compiled)
    if (k.norm_act is None or k.paged is None or model.arch.head_dim > k.norm_act.rope_max_head_dim
            or not model.arch.plain_layers):
        return loop
    loop = KernelLoop(model, loop)
    fused = fused_layers(model, k.layers, k.norm_act, k.paged)
    return loop if fused is None else FusedLoop(model, fused, loop)
