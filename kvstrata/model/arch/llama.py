"""The Llama family's description (Llama, Mistral, Qwen2, Qwen3, SmolLM2): a pre-norm decoder, RoPE, a SiLU-gated
MLP, RMSNorm; biases on q/k/v for Qwen2 and for Llama's `attention_bias`, on o too for the latter; an RMSNorm over
each head of q and k for Qwen3. Every layer attends over every earlier key, but Mistral's `sliding_window` (and
Qwen's `use_sliding_window`, from `max_window_layers` on) makes layers sliding, as transformers applies them.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from kvstrata.model.arch.spec import GGUFLayout, ModelArch, rope_from_config

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def windows(config: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global), as transformers reads the config: v5's `layer_types`, else
    Mistral's `sliding_window` on every layer, Qwen's from `max_window_layers` on when `use_sliding_window`."""
    window = config.get("sliding_window")
    model_type = config.get("model_type")
    if not window or (model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window")):
        return ()
    types = config.get("layer_types")
    if types is None:
        first = int(config.get("max_window_layers", 0)) if model_type in ("qwen2", "qwen3") else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if "sliding_attention" not in types:
        return ()
    return tuple(int(window) if kind == "sliding_attention" else None for kind in types)


def describe(config: dict[str, Any]) -> ModelArch:
    """An HF `config.json` of the family; ValueError names what kvstrata cannot run."""
    model_type = config.get("model_type")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    theta, scaling = rope_from_config(config)
    if model_type == "qwen2":
        qkv_bias, out_bias = True, False
    elif model_type == "qwen3":
        qkv_bias = out_bias = bool(config.get("attention_bias", False))
    else:
        qkv_bias = out_bias = bool(config.get("attention_bias", False))
    layers = int(config["num_hidden_layers"])
    return ModelArch(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=layers,
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
        windows=windows(config, layers),
        qk_norm=model_type == "qwen3",
    )


def gguf_config(meta, shapes: dict[str, tuple[int, ...]], arch: str = "llama") -> dict[str, Any]:
    """The HF config of a llama- (or qwen3-) architecture GGUF file (`GGUFLayout.config`)."""
    hidden = int(meta(f"{arch}.embedding_length"))
    heads = int(meta(f"{arch}.attention.head_count"))
    theta = float(meta(f"{arch}.rope.freq_base", 10000.0))
    rope_type = meta(f"{arch}.rope.scaling.type", "none")
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if rope_type == "linear":
        rope_parameters = {"rope_type": "linear", "rope_theta": theta,
                           "factor": float(meta(f"{arch}.rope.scaling.factor"))}
    elif rope_type != "none":
        raise ValueError(f"GGUF rope scaling {rope_type!r} is not supported")
    vocab = meta(f"{arch}.vocab_size")
    if vocab is None:
        vocab = shapes["token_embd.weight"][-1]
    config = {
        "architectures": ["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"],
        "model_type": arch,
        "hidden_act": "silu",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta(f"{arch}.attention.key_length", meta(f"{arch}.rope.dimension_count",
                                                                   hidden // heads))),
        "rms_norm_eps": float(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(meta(f"{arch}.context_length", 2048)),
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


LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF = GGUFLayout(architecture="llama", layer_names=LAYER_NAMES, global_names=GLOBAL_NAMES, permuted_rope=True,
                  config=gguf_config)
# llama.cpp permutes q/k rows for its llama architecture only
QWEN3_GGUF = GGUFLayout(architecture="qwen3", permuted_rope=False, global_names=GLOBAL_NAMES,
                        layer_names={**LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
                        config=partial(gguf_config, arch="qwen3"))
