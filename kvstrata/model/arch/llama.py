"""The Llama family's description (Llama, Mistral, Qwen2, SmolLM2): a pre-norm decoder where every layer
attends over every earlier key, RoPE, a SiLU-gated MLP, RMSNorm; biases on q/k/v for Qwen2 and for Llama's
`attention_bias`, on o too for the latter.
"""

from __future__ import annotations

import logging
from typing import Any

from kvstrata.model.arch.spec import GGUFLayout, ModelArch, rope_from_config

logger = logging.getLogger(__name__)

MODEL_TYPES = ("llama", "mistral", "qwen2")


def describe(config: dict[str, Any]) -> ModelArch:
    """An HF `config.json` of the family; ValueError names what kvstrata cannot run."""
    model_type = config.get("model_type")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    window = config.get("sliding_window")
    if window and (model_type == "mistral" or config.get("use_sliding_window")):
        logger.warning("sliding_window=%s is not applied: outputs are exact only up to %s tokens",
                       window, window)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    theta, scaling = rope_from_config(config)
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
        family="llama",
        activation=config.get("hidden_act", "silu"),
    )


def gguf_config(meta, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The HF config of a llama-architecture GGUF file (`GGUFLayout.config`)."""
    hidden = int(meta("llama.embedding_length"))
    heads = int(meta("llama.attention.head_count"))
    theta = float(meta("llama.rope.freq_base", 10000.0))
    rope_type = meta("llama.rope.scaling.type", "none")
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if rope_type == "linear":
        rope_parameters = {"rope_type": "linear", "rope_theta": theta,
                           "factor": float(meta("llama.rope.scaling.factor"))}
    elif rope_type != "none":
        raise ValueError(f"GGUF rope scaling {rope_type!r} is not supported")
    vocab = meta("llama.vocab_size")
    if vocab is None:
        vocab = shapes["token_embd.weight"][-1]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("llama.feed_forward_length")),
        "num_hidden_layers": int(meta("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta("llama.attention.key_length", meta("llama.rope.dimension_count",
                                                                   hidden // heads))),
        "rms_norm_eps": float(meta("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(meta("llama.context_length", 2048)),
        "rope_theta": theta,
        "rope_parameters": rope_parameters,
        "mlp_bias": False,
        "dtype": "float32",
    }
    if rope_parameters["rope_type"] != "default":
        config["rope_scaling"] = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    for key in ("bos", "eos", "pad"):
        token = meta(f"tokenizer.ggml.{key}_token_id")
        if token is not None:
            config[f"{key}_token_id"] = int(token)
    return config


GGUF = GGUFLayout(
    architecture="llama",
    layer_names={"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
    global_names={"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
    permuted_rope=True,
    config=gguf_config,
)
