"""A model that cannot fit is refused before anything is allocated, with the figures and a way out."""

from __future__ import annotations

import pytest

from kvstrata.core.config import CacheConfig, EngineConfig, ModelConfig
from kvstrata.model.loader import plan_load
from kvstrata.worker import memory_check
from kvstrata.worker.memory_check import check_memory

GiB = 1024**3
MACHINE = 23 * GiB            # what a 24 GiB machine has available


def plan(model: str, **options):
    return plan_load(ModelConfig(model=model, load_format="dummy", device="cpu", **options))


def test_the_8b_shape_in_int8_is_refused_on_24_gib_with_the_figures():
    with pytest.raises(ValueError) as refused:
        check_memory(plan("llama-3.1-8b", quantization="int8"), CacheConfig(), available=MACHINE)
    message = str(refused.value)
    assert "8.03B parameters" in message and "float32 weights before int8" in message
    assert "23.0 GiB is available" in message
    assert "--quantization none --dtype bfloat16 (15.0 GiB of weights)" in message


def test_the_1b_shape_fits_with_tiers():
    check_memory(plan("llama-3.2-1b", dtype="bfloat16"), CacheConfig(host_cache_memory=4 * GiB),
                 available=MACHINE)


def test_a_kv_budget_too_big_says_how_much_room_is_left():
    with pytest.raises(ValueError, match=r"smaller --kv-cache-memory and --host-cache-memory \(together at most"):
        check_memory(plan("llama-3.2-1b", dtype="bfloat16"), CacheConfig(kv_cache_memory=16 * GiB,
                                                                          host_cache_memory=8 * GiB),
                     available=MACHINE)


def test_float32_too_big_suggests_bfloat16():
    with pytest.raises(ValueError, match=r"Ways out: --dtype bfloat16 \(6.7 GiB of weights\); a smaller model\."):
        check_memory(plan("llama-3.2-3b", dtype="float32"), CacheConfig(), available=10 * GiB)


def test_the_engine_refuses_before_loading(monkeypatch):
    from kvstrata.engine import llm_engine

    monkeypatch.setattr(memory_check, "available_memory", lambda: 2 * GiB)
    monkeypatch.setattr(llm_engine, "load_model", lambda config: pytest.fail("loaded a model that cannot fit"))
    with pytest.raises(ValueError, match="does not fit in this machine's memory"):
        llm_engine.LLMEngine(EngineConfig.from_options(model="llama-3.2-1b", load_format="dummy", device="cpu"))
