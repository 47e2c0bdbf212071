"""The Gemma 3 family's description (text models: 270M, 1B, and the 4B-27B language towers): sliding-window
layers interleaved with global ones (five of every six sliding), each kind with its own RoPE; four RMSNorms a
layer scaled by 1 + w in float32 (before and after attention and the MLP), an RMSNorm over each head of q and k,
attention scaled by `query_pre_attn_scalar`, a GELU(tanh)-gated MLP, embeddings times sqrt(hidden), a tied head.

transformers' Gemma3ForCausalLM is the reference; the window is its: a query sees its last W keys, itself
included. A GGUF stores the norms with the 1 already added (llama.cpp's converter adds it) and neither the
layer pattern nor the local RoPE base: those are Gemma 3's (every 6th layer global, 10,000), as llama.cpp and
transformers assume too.
"""

from __future__ import annotations

from typing import Any

from kvstrata.model.arch.spec import GGUFLayout, ModelArch, rope_from_config

MODEL_TYPES = ("gemma3_text",)
PATTERN = 6                        # every 6th layer global (Gemma 3's `_sliding_window_pattern`)
LOCAL_ROPE_THETA = 10_000.0
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def layer_types(config: dict[str, Any], layers: int) -> list[str]:
    types = config.get("layer_types")
    if types is None:
        pattern = int(config.get("_sliding_window_pattern") or config.get("sliding_window_pattern") or PATTERN)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of {layers} layers")
    return list(types)


def ropes(config: dict[str, Any]) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """The global and the sliding layers' (theta, scaling), from either config style: transformers v5's
    `rope_parameters` by layer type, or v4's `rope_theta` + `rope_scaling` and `rope_local_base_freq`."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return (rope_from_config({"rope_parameters": params["full_attention"]}),
                rope_from_config({"rope_parameters": params.get("sliding_attention") or params["full_attention"]}))
    local = float(config.get("rope_local_base_freq", LOCAL_ROPE_THETA))
    return rope_from_config(config), (local, None)


def describe(config: dict[str, Any]) -> ModelArch:
    """A Gemma 3 text config; ValueError names what kvstrata cannot run."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise ValueError(f"{key}={config[key]} is not supported (Gemma 3 has none)")
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true (an embedding model) is not supported: kvstrata decodes")
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_activation {act!r} is not supported (Gemma 3 runs gelu_pytorch_tanh)")
    layers = int(config["num_hidden_layers"])
    window = int(config["sliding_window"])
    heads = int(config["num_attention_heads"])
    (theta, scaling), (local_theta, local_scaling) = ropes(config)
    head_dim = int(config.get("head_dim") or 256)
    return ModelArch(
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(config.get("max_position_embeddings", 131_072)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        attention_bias=bool(config.get("attention_bias", False)),
        attention_out_bias=bool(config.get("attention_bias", False)),
        family="gemma3",
        activation=ACTIVATIONS[act],
        windows=tuple(window if kind == "sliding_attention" else None for kind in layer_types(config, layers)),
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        qk_norm=True,
        sandwich_norms=True,
        norm_style="gemma",
        embedding_scale=True,
        query_scale=float(config.get("query_pre_attn_scalar") or head_dim) ** -0.5,
    )


def gguf_config(meta, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The HF config of a gemma3-architecture GGUF file (`GGUFLayout.config`)."""
    hidden = int(meta("gemma3.embedding_length"))
    heads = int(meta("gemma3.attention.head_count"))
    layers = int(meta("gemma3.block_count"))
    head_dim = int(meta("gemma3.attention.key_length", hidden // heads))
    theta = float(meta("gemma3.rope.freq_base", 1_000_000.0))
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    rope_type = meta("gemma3.rope.scaling.type", "none")
    if rope_type == "linear":               # the 4B-27B: the global layers' RoPE only
        full = {"rope_type": "linear", "rope_theta": theta, "factor": float(meta("gemma3.rope.scaling.factor"))}
    elif rope_type != "none":
        raise ValueError(f"GGUF rope scaling {rope_type!r} is not supported")
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "vocab_size": int(meta("gemma3.vocab_size", shapes["token_embd.weight"][-1])),
        "hidden_size": hidden,
        "intermediate_size": int(meta("gemma3.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("gemma3.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta("gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta("gemma3.context_length", 131_072)),
        "sliding_window": int(meta("gemma3.attention.sliding_window")),
        "layer_types": layer_types({}, layers),
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_THETA}},
        # llama.cpp's choice for the 27B (62 layers), whose scalar is hidden / heads; head_dim for the others
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "dtype": "float32",
    }
    for key in ("bos", "eos", "pad"):
        token = meta(f"tokenizer.ggml.{key}_token_id")
        if token is not None:
            config[f"{key}_token_id"] = int(token)
    return config


GGUF = GGUFLayout(
    architecture="gemma3",
    layer_names={"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                 "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"},
    global_names={"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
    permuted_rope=False,
    config=gguf_config,
    norm_shift=1.0,
)
