"""`ModelArch`: the shape of a Llama-family decoder, read from an HF `config.json`.

One frozen value describes everything the model code needs (sizes, RoPE, biases), whatever the
source: a GGUF file is first converted to an HF-style folder, so this parser is the only one.
Both config styles are read: transformers v4 (`rope_theta` + `rope_scaling`) and v5
(`rope_parameters`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")   # freq_factors: a GGUF's rope_freqs


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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, not {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope(config: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling) from either config style; scaling is None for plain RoPE."""
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


def arch_from_hf_config(config: dict[str, Any]) -> ModelArch:
    """Parse an HF `config.json` dict; ValueError names what kvstrata cannot run."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; kvstrata runs "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (Llama-family models use silu)")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    window = config.get("sliding_window")
    if window and (model_type == "mistral" or config.get("use_sliding_window")):
        logger.warning("sliding_window=%s is not applied: outputs are exact only up to %s tokens",
                       window, window)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    theta, scaling = _rope(config)
    if model_type == "qwen2":
        qkv_bias, out_bias = True, False
    else:
        qkv_bias = out_bias = bool(config.get("attention_bias", False))
    return ModelArch(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        attention_out_bias=out_bias,
    )


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
