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
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")   # freq_factors: a GGUF's rope_freqs
ACTIVATIONS = ("silu",)                           # the gated MLP's activation: act(gate) * up


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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, not {self.head_dim}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.activation!r} is not supported (kvstrata runs {', '.join(ACTIVATIONS)})")

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
