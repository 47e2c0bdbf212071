"""Real model shapes shipped with kvstrata: the `config.json` of models nobody can download here.

`--load-format dummy --model llama-3.2-1b` builds one with random weights (kvstrata.model.sources.dummy),
`kvstrata simulate --hardware h100 --model llama-3.2-1b` prices it on a roofline (kvstrata.sim.roofline),
and the peers' scripts serve the same config. The files are the real models' configs (vocabulary, GQA,
tied embeddings, RoPE scaling, biases), trimmed of nothing that changes the shape. Pure data: the
simulator, which never imports torch or the model, reads them too.
"""

from __future__ import annotations

import json
from pathlib import Path

SHAPES_DIR = Path(__file__).parent / "shape_configs"
SHIPPED_SHAPES = tuple(sorted(p.stem for p in SHAPES_DIR.glob("*.json")))


def shipped_config(name: str) -> dict:
    """The HF config of a shipped shape; ValueError naming the others."""
    if name not in SHIPPED_SHAPES:
        raise ValueError(f"no shipped shape {name!r}; shipped: {', '.join(SHIPPED_SHAPES)}")
    return json.loads((SHAPES_DIR / f"{name}.json").read_text())


def parameter_count(config: dict) -> int:
    """Parameters of a shipped HF config (Llama, Qwen, Gemma 3): projections, embeddings, an untied head, norms,
    biases."""
    e, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or e // heads
    qkv = (heads + 2 * kv_heads) * d
    bias = qkv if config["model_type"] == "qwen2" or config.get("attention_bias") else 0
    gemma = config["model_type"] == "gemma3_text"
    norms = (4 if gemma else 2) * e + (2 * d if gemma or config["model_type"] == "qwen3" else 0)   # + q/k norms
    per_layer = e * qkv + bias + heads * d * e + 3 * e * i + norms
    embed = config["vocab_size"] * e
    return layers * per_layer + embed * (1 if config.get("tie_word_embeddings") else 2) + e
