"""The weight-format seam: what every format is asked, and what it is given.

A weight format (`none`: the dtype's own floats; `int8`; `gguf`: a GGUF file's own bits) is one module with one
`WeightFormat` subclass, registered in `kvstrata.model.formats.FORMATS`. The builder (kvstrata.model.builder) asks
it, in this order: can it run here (`unavailable`), in which dtype by default (`auto_dtype`), what it will take in
memory (`footprint`), what it adds to the model fingerprint (`identity`), and then, once, to `pack` the
checkpoint's matrices into the projections the decoder calls. The decoder never branches on the format: it
calls `proj(x)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import torch

from kvstrata.model.arch import ModelArch
from kvstrata.model.arch import tensors as names
from kvstrata.model.kernels.layers import KvsProjection

T = TypeVar("T")


class Projection:
    """What the decoder calls for each of its projections: `proj(x)`, x (M, in) -> (M, out); every format's
    projection class derives from it. `nbytes`: the bytes of weights one call reads."""

    nbytes: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kernel_view(self) -> KvsProjection | None:
        """The projection as the fused decoder layers call it (a GGUF kernel's blocks, no bias), or None."""
        return None


@dataclass
class Packed(Generic[T]):
    """Something for every projection of a model: per layer by fused name (`names.PROJECTIONS`), and for the LM
    head. A format's projections are `Packed[Projection]`; int8 keeps its rows as `Packed[Int8Rows]`."""

    layers: list[dict[str, T]]
    head: T

    def in_call_order(self) -> list[T]:
        return [p for layer in self.layers for p in layer.values()] + [self.head]


@dataclass
class Norms:
    """The norm weights a format may rescale in place (int8's smoothing folds into them), and the others a
    description may have (`ModelArch.qk_norm`, `sandwich_norms`), which no format touches."""

    input: list[torch.Tensor]           # per layer, before q|k|v
    post: list[torch.Tensor]            # per layer, before gate|up
    final: torch.Tensor                 # before the head
    others: list[dict[str, torch.Tensor]] = field(default_factory=list)   # per layer: q_norm, attn_out_norm, ...


@dataclass
class Checkpoint:
    """The HF-named tensors of a checkpoint (a dict of memory-mapped tensors, or dummy weights made on demand),
    taken as the model needs them: each is converted to the model dtype and device when taken, and dropped from
    `tensors`, so the float checkpoint is never held twice."""

    tensors: MutableMapping[str, torch.Tensor]
    dtype: torch.dtype
    device: torch.device

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        return self.tensors.pop(name).to(self.device, self.dtype)

    def matrix(self, layer: int, projection: str) -> torch.Tensor:
        """A fused projection's (out, in) weights: its parts' rows, stacked."""
        return torch.cat([self.take(n) for n in names.parts(layer, projection)])

    def bias(self, layer: int, projection: str, present: bool) -> torch.Tensor | None:
        return torch.cat([self.take(n) for n in names.parts(layer, projection, "bias")]) if present else None

    def skip(self, tensor_names: list[str]) -> None:
        """Drop tensors a format serves from elsewhere (a GGUF's own blocks) without converting them."""
        for name in tensor_names:
            self.tensors.pop(name, None)

    def leftover(self) -> list[str]:
        return [n for n in self.tensors if not n.endswith("rotary_emb.inv_freq")]


@dataclass(frozen=True)
class PackContext:
    """What a format may need to pack a model beyond its checkpoint."""

    arch: ModelArch
    dtype: torch.dtype
    device: torch.device
    embeddings: torch.Tensor            # (vocab, hidden) in the dtype: a tied head's weights
    norms: Norms
    exact: bool                         # attention sums by the row alone (`--batch-invariant`, or the format's)
    traceable: bool                     # `--compile` follows: projections dynamo can trace
    folder: Path | None                 # the converted folder the weights came from (a GGUF's own blocks)
    identity: str                       # the float model's fingerprint (what a format's cached state is keyed by)
    tokenizer: Any | None
    # Logits of `token_ids` through the decoder with these projections and the norms as they are now (int8
    # calibrates and chooses its kernel with it).
    run: Callable[[Packed, list[int]], torch.Tensor] = field(repr=False, default=None)


@dataclass(frozen=True)
class WeightFootprint:
    """Bytes of weights at the worst moment of loading, and once loaded."""

    peak: int
    resident: int
    parameters: int
    peak_reason: str                # what the peak is, in a few words, for the error a user reads


@dataclass(frozen=True)
class Target:
    """Where and how a model is asked to run, as a format sees it before anything is loaded."""

    arch: ModelArch
    device: torch.device
    dtype: str                      # as asked: auto, float32, bfloat16
    gguf_types: dict[str, str] | None   # a GGUF's matrices' types by HF name; None: the weights are no GGUF's
    dummy: bool                     # --load-format dummy
    compile: bool                   # --compile


class WeightFormat(ABC):
    """One weight format (module docstring). Subclasses are stateless but for what `pack` measures."""

    name: ClassVar[str]
    cpu_only: ClassVar[bool] = False
    # Its projections round activations (int8 blocks, int8 rows), which turns a last-bit difference into another
    # quant: attention must then sum in an order set by the row alone (`PackContext.exact`).
    exact_attention: ClassVar[bool] = False

    def unavailable(self, target: Target) -> str | None:
        """Why it cannot run for `target` (the user's to fix), or None."""
        return None

    @abstractmethod
    def auto_dtype(self, target: Target) -> torch.dtype:
        """The activations' dtype `--dtype auto` picks for this format."""

    @abstractmethod
    def footprint(self, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> WeightFootprint:
        """The weights' bytes as this format loads them (kvstrata.worker.memory_check refuses what cannot fit)."""

    def identity(self) -> dict[str, Any]:
        """What the model fingerprint carries for this format besides its name: whatever moves a bit of its KV."""
        return {}

    @abstractmethod
    def pack(self, checkpoint: Checkpoint, ctx: PackContext) -> Packed:
        """Every projection and the head, from the checkpoint's matrices (taken from it as they are packed)."""

    def describe(self) -> str:
        """What runs, for the start-up log line and /v1/models."""
        return self.name


def weight_counts(arch: ModelArch) -> tuple[int, int, int, int]:
    """(parameters, projection weights, embedding weights, the most held at once while loading: a layer's
    projections or the embeddings) of `arch`."""
    per_layer = sum(o * i for o, i in arch.projection_shapes().values())
    embed = arch.vocab_size * arch.hidden_size
    parameters = arch.num_layers * per_layer + embed + (0 if arch.tie_word_embeddings else embed)
    return parameters, arch.num_layers * per_layer, embed, max(per_layer, embed)
