"""Shared fixtures: the embedded model is loaded once per test session."""

import pytest

from kvstrata.core.config import EngineConfig, ModelConfig


@pytest.fixture(scope="session")
def smollm2():
    from kvstrata.model.loader import load_model
    return load_model(ModelConfig(dtype="float32", device="cpu"))


@pytest.fixture
def make_engine(smollm2):
    """LLMEngine factory on the shared SmolLM2 weights; every step is audited."""
    from kvstrata.engine.llm_engine import LLMEngine

    def build(faults=None, **options):
        options.setdefault("kv_cache_memory", "64MiB")
        return LLMEngine(EngineConfig.from_options(audit_every_step=True, **options), loaded=smollm2, faults=faults)
    return build
