"""LoRA adapters for tests and benchmarks, made here with PEFT (never downloaded): random A and
non-zero random B, so an adapter really changes the model's outputs."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_peft_adapter(base_folder: Path, out: Path, seed: int, rank: int = 8, alpha: int = 16,
                      targets: tuple[str, ...] = ALL_TARGETS, scale: float = 0.02, use_rslora: bool = False,
                      base=None) -> Path:
    """A PEFT LoRA adapter of the HF model in `base_folder` (or `base`, already loaded), saved to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = base if base is not None else AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        use_rslora=use_rslora, init_lora_weights=True)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(out)
    peft_model.unload()          # the base model's modules back as they were, for the next adapter
    return Path(out)
