"""`ModelArch`: the description of a decoder that the rest of the wing builds from.

One frozen value holds everything the model code needs (sizes, attention, RoPE, biases, the activation)
whatever the source: a GGUF file is converted to an HF-style folder first, so a family's parser of an HF
`config.json` (kvstrata.model.arch.llama, ...) is the only reader. The builder assembles the network from it, the
model fingerprint hashes it, the KV cache is shaped by it. A new family is a new description (a module beside
llama.py and its entry in `FAMILIES`), plus what is really new in it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")   # freq_factors: a GGUF's rope_freqs
ACTIVATIONS = ("silu", "gelu_tanh")               # the gated MLP's activation: act(gate) * up
NORM_STYLES = ("llama", "gemma")                  # how an RMSNorm applies its weight (ModelArch.norm_style)


@dataclass(frozen=True)
class ModelArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None          # {"rope_type": "linear" | "llama3", ...}; None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool               # q/k/v projections carry a bias (Qwen2, Llama attention_bias)
    attention_out_bias: bool = False   # o_proj carries a bias too (Llama attention_bias only)
    family: str = "llama"              # the description it came from (FAMILIES in kvstrata.model.arch)
    activation: str = "silu"
    # Beyond Llama's layer (each at a default that is Llama's; `identity` leaves the defaults out):
    windows: tuple[int | None, ...] = ()   # per layer: its sliding window W (a query sees its last W keys, itself
                                           # included), None for a global layer; () every layer global
    local_rope_theta: float | None = None  # the sliding layers' RoPE (Gemma 3: 10,000 beside the global 1e6);
    local_rope_scaling: dict | None = None  # None: the same as the global layers'
    qk_norm: bool = False              # an RMSNorm over each head of q and k before RoPE (Qwen 3, Gemma 3)
    sandwich_norms: bool = False       # RMSNorms on attention's and the MLP's outputs too (Gemma 2/3)
    norm_style: str = "llama"          # "llama": w * normed, in the model dtype; "gemma": (1 + w) * normed in
                                       # float32, then rounded
    embedding_scale: bool = False      # embeddings times sqrt(hidden_size), in the model dtype (Gemma)
    query_scale: float | None = None   # attention's scale (Gemma: query_pre_attn_scalar ** -0.5); None: head_dim's

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, not {self.head_dim}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.activation!r} is not supported (kvstrata runs {', '.join(ACTIVATIONS)})")
        if self.norm_style not in NORM_STYLES:
            raise ValueError(f"norm style {self.norm_style!r}: one of {', '.join(NORM_STYLES)}")
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError(f"{len(self.windows)} layer windows for {self.num_layers} layers")
        if len({w for w in self.windows if w is not None}) > 1:
            raise ValueError(f"one sliding window for every sliding layer, not {sorted(set(self.windows) - {None})}")
        if any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"a sliding window is at least one token, not {min(w for w in self.windows if w)}")

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding layers (one for all of them), None when every layer is global."""
        return next((w for w in self.windows if w is not None), None)

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    @property
    def plain_layers(self) -> bool:
        """Whether every layer is Llama's (what our fused kernels compute): no window, no extra norms, SiLU,
        norms scaled in the model dtype, attention scaled by head_dim."""
        return (self.sliding_window is None and not (self.qk_norm or self.sandwich_norms or self.embedding_scale)
                and self.norm_style == "llama" and self.activation == "silu" and self.query_scale is None)

    def local(self) -> ModelArch:
        """The description as the sliding layers see it: their own RoPE."""
        if self.local_rope_theta is None:
            return self
        return replace(self, rope_theta=self.local_rope_theta, rope_scaling=self.local_rope_scaling,
                       local_rope_theta=None, local_rope_scaling=None)

    def identity(self) -> dict[str, Any]:
        """What the model fingerprint hashes: every field, less those at their defaults past Llama's own (so a
        Llama model's fingerprint is what it was before the fields existed)."""
        found = asdict(self)
        for f in fields(self)[fields(self).index(_FIRST_EXTRA):]:
            if found[f.name] == f.default:
                del found[f.name]
        return found
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """Each fused projection's (out, in)."""
        e, i = self.hidden_size, self.intermediate_size
        return {"qkv": (self.q_size + 2 * self.kv_size, e), "o": (e, self.q_size), "gate_up": (2 * i, e),
                "down": (e, i)}


_FIRST_EXTRA = next(f for f in fields(ModelArch) if f.name == "windows")


@dataclass(frozen=True)
class GGUFLayout:
    """How a family's GGUF files name their tensors and metadata (kvstrata.model.sources.gguf_convert reads them).

    `config(meta, shapes)`: the HF config.json of a file, from its metadata (`meta(key, default)`) and its
    tensors' shapes by GGUF name."""

    architecture: str                          # general.architecture
    layer_names: dict[str, str]                # blk.N.<gguf name> -> model.layers.N.<hf name>
    global_names: dict[str, str]               # token_embd -> model.embed_tokens, ...
    permuted_rope: bool                        # llama.cpp interleaved the RoPE halves of q/k rows
    config: Callable[[Callable[..., Any], dict[str, tuple[int, ...]]], dict[str, Any]]
    norm_shift: float = 0.0                    # stored norm weights are HF's + this (Gemma's 1 + w): taken off

    def hf_name(self, gguf_name: str) -> str:
        base, _, suffix = gguf_name.rpartition(".")
        parts = base.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in self.layer_names:
            return f"model.layers.{parts[1]}.{self.layer_names[parts[2]]}.{suffix}"
        if base in self.global_names:
            return f"{self.global_names[base]}.{suffix}"
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a {self.architecture}-architecture model")


def rope_from_config(config: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling) from either config style (transformers v4's `rope_theta` + `rope_scaling`, v5's
    `rope_parameters`); scaling is None for plain RoPE."""
    params = config.get("rope_parameters")
    if params is not None:       # transformers v5: one dict holds theta and the scaling
        params = dict(params)
        theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = dict(config.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; kvstrata supports "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), None
    if ("factors" if rope_type == "freq_factors" else "factor") not in scaling:
        raise ValueError(f"rope scaling {rope_type!r} needs " + ("its 'factors'" if rope_type == "freq_factors"
                                                                  else "a 'factor'"))
    return float(theta), {"rope_type": rope_type, **scaling}


def resolve_max_model_len(asked: int | None, arch: ModelArch) -> int:
    """The context length to enforce: the model's `max_position_embeddings` unless asked for less.

    Longer is refused: the rotary tables stop there, and a RoPE-scaled checkpoint (linear, llama3)
    already states its extended context in that field."""
    limit = arch.max_position_embeddings
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(f"max_model_len {asked} is longer than the model's context ({limit} tokens, its "
                         f"max_position_embeddings); use --max-model-len {limit} or less")
    return asked
