"""The checkpoint's tensor names, in one place: every family kvstrata runs keeps transformers' Llama names
(`model.layers.N.self_attn.q_proj.weight`, ...), a GGUF's are mapped to them at conversion, and the rest of the
wing looks them up here: the builder loads by them, a GGUF's own blocks and a LoRA adapter's targets are found
by them, dummy weights are made under them.

The decoder fuses q|k|v and gate|up into one matmul each (at decode each matmul reads all its weights for a
handful of rows), so a projection is named by its fused name and made of its HF parts, in order.
"""

from __future__ import annotations

from kvstrata.model.arch.spec import ModelArch

PROJECTIONS = ("qkv", "o", "gate_up", "down")          # the decoder's projections, in call order
EMBEDDINGS = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
# HF module name -> (the fused projection it is part of, its place in it)
MODULES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def module(layer: int, name: str) -> str:
    """The HF prefix of one projection module: module(0, "q_proj") -> "model.layers.0.self_attn.q_proj"."""
    return f"model.layers.{layer}.{_BLOCK[name]}.{name}"


def parts(layer: int, projection: str, suffix: str = "weight") -> list[str]:
    """The HF tensors a fused projection is made of, in order: parts(0, "qkv") -> [...q_proj.weight, k, v]."""
    return [f"{module(layer, name)}.{suffix}" for name, (fused, _) in MODULES.items() if fused == projection]


def norms(layer: int, arch: ModelArch) -> dict[str, str]:
    """A layer's norm weights by the decoder's names, in checkpoint order: `input_norm` before q|k|v, `post_norm`
    before gate|up, and as the description has them `q_norm` / `k_norm` (over each head) and `attn_out_norm` /
    `mlp_out_norm` (on attention's and the MLP's outputs). Gemma's post_attention_layernorm is on attention's
    output, Llama's before the MLP."""
    base = f"model.layers.{layer}"
    found = {"input_norm": f"{base}.input_layernorm.weight"}
    if arch.qk_norm:
        found |= {"q_norm": f"{base}.self_attn.q_norm.weight", "k_norm": f"{base}.self_attn.k_norm.weight"}
    if arch.sandwich_norms:
        return found | {"attn_out_norm": f"{base}.post_attention_layernorm.weight",
                        "post_norm": f"{base}.pre_feedforward_layernorm.weight",
                        "mlp_out_norm": f"{base}.post_feedforward_layernorm.weight"}
    return found | {"post_norm": f"{base}.post_attention_layernorm.weight"}


def head(tied: bool) -> str:
    """The matrix the LM head multiplies by: the embeddings when tied."""
    return EMBEDDINGS if tied else LM_HEAD
