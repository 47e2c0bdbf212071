"""The CUDA paths: the model, the engine with its tiers and the disk store, on a GPU.

Skipped without CUDA (CI has none); `benchmarks/device_check.py` runs them on a GPU machine
(`-m cuda`). A tiny random model without a tokenizer keeps each a few seconds and needs nothing
installed (not even the default model).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvstrata.core.config import EngineConfig, ModelConfig
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.model.loader import load_model
from tests.model.model_helpers import cuda_only, save_tiny_hf_model

PROMPTS = [list(range(100, 140 + 8 * i)) for i in range(4)] * 2           # repeats hit the cache
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A random Llama with GQA and llama3 RoPE scaling, as an HF folder."""
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_hf_model(folder, LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 256}))
    return str(folder)


def tiny(folder: str, device: str, dtype: str = "float32"):
    return load_model(ModelConfig(model=folder, device=device, dtype=dtype))


def greedy(loaded, **options) -> list[list[int]]:
    engine = LLMEngine(EngineConfig.from_options(audit_every_step=True, num_device_blocks=24, block_size=4,
                                                 **options), loaded=loaded)
    try:
        return [out.new_token_ids for prompt in PROMPTS for out in engine.generate([prompt], GREEDY)]
    finally:
        engine.close()


@cuda_only
def test_logits_on_cuda_equal_the_cpu_ones(tiny_folder):
    ids = list(range(100, 180))
    cpu = tiny(tiny_folder, "cpu").model.prefill_alone(ids)
    cuda = tiny(tiny_folder, "cuda").model.prefill_alone(ids).cpu()
    assert torch.allclose(cuda, cpu, atol=1e-3, rtol=1e-3), (cuda - cpu).abs().max()
    bf16 = tiny(tiny_folder, "cuda", "bfloat16").model.prefill_alone(ids)
    assert torch.isfinite(bf16).all()


@cuda_only
def test_greedy_on_cuda_with_every_tier_equals_cache_off_and_the_cpu(tiny_folder, tmp_path):
    loaded = tiny(tiny_folder, "cuda")
    tiers = greedy(loaded, num_host_blocks=32, store_path=str(tmp_path / "store"))
    assert tiers == greedy(loaded, enable_prefix_caching=False)
    assert tiers == greedy(tiny(tiny_folder, "cpu"), enable_prefix_caching=False)


@cuda_only
def test_a_restarted_cuda_engine_loads_the_prefix_from_the_disk_store(tiny_folder, tmp_path):
    loaded = tiny(tiny_folder, "cuda")
    options = dict(audit_every_step=True, num_device_blocks=24, block_size=4, store_path=str(tmp_path / "store"))
    first = LLMEngine(EngineConfig.from_options(**options), loaded=loaded)
    before = first.generate([PROMPTS[3]], GREEDY)[0]
    first.close()
    second = LLMEngine(EngineConfig.from_options(**options), loaded=loaded)
    after = second.generate([PROMPTS[3]], GREEDY)[0]
    second.close()
    assert after.new_token_ids == before.new_token_ids
    assert after.num_cached_tokens > 0 and before.num_cached_tokens == 0
