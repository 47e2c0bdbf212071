"""Shared fixtures: the embedded model is loaded once per test session."""

import pytest
import torch

from kvstrata.core.config import EngineConfig, ModelConfig


@pytest.fixture(scope="session")
def smollm2():
    from kvstrata.model.loader import load_model
    return load_model(ModelConfig(dtype="float32", device="cpu", quantization="none"))   # widened: the fp32 reference


@pytest.fixture(scope="session")
def default_model():
    """What `make serve` and `LLM()` load: the embedded SmolLM2 at its GGUF's own bits, bf16 where the CPU has it."""
    from kvstrata.model.loader import load_model
    return load_model(ModelConfig())


@pytest.fixture(scope="session")
def lora_adapters(smollm2, tmp_path_factory):
    """name -> folder of four PEFT adapters of SmolLM2 (tests/model/lora_helpers.py): ranks 8, 16, 4, 8;
    all seven targets, attention only with rsLoRA, the MLP only, all seven."""
    from transformers import AutoModelForCausalLM

    from tests.model.lora_helpers import ALL_TARGETS, save_peft_adapter

    base = AutoModelForCausalLM.from_pretrained(smollm2.folder, dtype=torch.float32)
    root = tmp_path_factory.mktemp("lora")
    shapes = {"alpha": dict(rank=8), "beta": dict(rank=16, targets=ALL_TARGETS[:4], use_rslora=True),
              "gamma": dict(rank=4, targets=ALL_TARGETS[4:]), "delta": dict(rank=8, alpha=8)}
    return {name: save_peft_adapter(smollm2.folder, root / name, seed=seed, scale=0.1, base=base, **shape)
            for seed, (name, shape) in enumerate(shapes.items(), start=1)}


@pytest.fixture
def make_engine(smollm2):
    """LLMEngine factory on the shared SmolLM2 weights (or `loaded`); every step is audited."""
    from kvstrata.engine.llm_engine import LLMEngine

    def build(faults=None, loaded=None, **options):
        options.setdefault("kv_cache_memory", "64MiB")
        return LLMEngine(EngineConfig.from_options(audit_every_step=True, **options), loaded=loaded or smollm2,
                         faults=faults)
    return build
