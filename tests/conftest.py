"""Shared fixtures: the embedded model is loaded once per test session."""

import os

import pytest
import torch

from kvstrata.core.config import EngineConfig, ModelConfig, cache_dir

# The kernels built for this session's cache (`make install` built them), whatever cache a test makes its own:
# a library is keyed by its sources and flags, so one build serves every test (and the children they start).
os.environ.setdefault("KVSTRATA_KERNEL_DIR", str(cache_dir() / "kernels"))


@pytest.fixture(scope="session")
def smollm2():
    """What `make serve` and `LLM()` load, and what the engine and server tests run on: the embedded SmolLM2 at its
    GGUF's own bits, bf16, a step in one C++ call (batch-invariant by construction: a row's bits never depend on
    its batch, chunk or cache path)."""
    from kvstrata.model.loader import load_model
    return load_model(ModelConfig())


@pytest.fixture(scope="session")
def default_model(smollm2):
    return smollm2


@pytest.fixture(scope="session")
def smollm2_fp32():
    """The same file widened to float32: the reference transformers, PEFT and int8 are compared with."""
    from kvstrata.model.loader import load_model
    return load_model(ModelConfig(dtype="float32", device="cpu", quantization="none"))


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
