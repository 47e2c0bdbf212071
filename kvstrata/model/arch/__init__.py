"""The architectures room: what a model is, as a frozen description (`ModelArch`) read from an HF config.

    spec.py       ModelArch, the RoPE settings of a config, the context length to enforce
    tensors.py    the checkpoint's tensor names, the one place every other room looks them up
    llama.py      the Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM2): its config, and its GGUF files' layout
    gemma3.py     Gemma 3 (sliding and global layers, four norms a layer, GELU): its config and GGUF layout

Pure data: nothing here imports torch or another room of the wing. `describe` picks the family by the config's
`model_type`; a new family is a module here and its line in `FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from kvstrata.model.arch import gemma3, llama
from kvstrata.model.arch.spec import GGUFLayout, ModelArch, resolve_max_model_len

__all__ = ["FAMILIES", "GGUF_LAYOUTS", "GGUFLayout", "ModelArch", "describe", "gguf_layout", "resolve_max_model_len"]

FAMILIES = {**{model_type: llama.describe for model_type in llama.MODEL_TYPES},
            **{model_type: gemma3.describe for model_type in gemma3.MODEL_TYPES}}
GGUF_LAYOUTS = {layout.architecture: layout for layout in (llama.GGUF, llama.QWEN3_GGUF, gemma3.GGUF)}


def describe(config: dict[str, Any]) -> ModelArch:
    """The description of an HF `config.json` dict; ValueError names what kvstrata cannot run."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; kvstrata runs {', '.join(FAMILIES)}")
    return FAMILIES[model_type](config)


def gguf_layout(architecture: str, file: str) -> GGUFLayout:
    """How a GGUF file of `architecture` lays out its tensors; ValueError for one kvstrata cannot read."""
    if architecture not in GGUF_LAYOUTS:
        raise ValueError(f"{file}: GGUF architecture {architecture!r} is not supported; kvstrata reads "
                         f"{', '.join(GGUF_LAYOUTS)}-architecture GGUF files or HF folders")
    return GGUF_LAYOUTS[architecture]
