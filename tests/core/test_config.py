"""Configs are frozen, and validate() explains what is wrong in words a user understands."""

import dataclasses

import pytest

from kvstrata.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, parse_size
from kvstrata.core.sampling_params import SamplingParams


def test_configs_are_frozen():
    config = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 32


@pytest.mark.parametrize("config, message", [
    (CacheConfig(block_size=12), "block_size must be a power of two"),
    (CacheConfig(num_device_blocks=0), "num_device_blocks must be at least 1"),
    (CacheConfig(reserve_ratio_min=0.9, reserve_ratio_init=0.5), "reserve_ratio_min"),
    (SchedulerConfig(max_num_seqs=0), "max_num_seqs must be at least 1"),
    (SchedulerConfig(policy="random"), "policy must be one of fcfs, priority, lpm"),
    (SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=1024),
     "without chunked prefill"),
    (ModelConfig(dtype="float16"), "dtype must be one of"),
])
def test_validate_explains_the_problem(config, message):
    with pytest.raises(ValueError, match=message):
        config.validate()


@pytest.mark.parametrize("params, message", [
    (SamplingParams(max_tokens=0), "max_tokens must be a positive integer"),
    (SamplingParams(temperature=-1), "temperature"),
    (SamplingParams(top_p=0), "top_p"),
    (SamplingParams(stop=("",)), "stop strings"),
    (SamplingParams(logprobs=50), "logprobs"),
])
def test_sampling_params_validate(params, message):
    with pytest.raises(ValueError, match=message):
        params.validate()


def test_parse_size():
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError, match="cannot read"):
        parse_size("lots")


def test_speculative_config_takes_vllm_fields_and_defaults():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (4, 3, 3)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).prompt_lookup_min == 5
    options = EngineConfig.from_options(speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                                            "prompt_lookup_max": 4})
    assert options.speculative_config == SpeculativeConfig("ngram", 3, 4, 2)
    assert EngineConfig.from_options().speculative_config is None


@pytest.mark.parametrize("value, message", [
    ("{", "not valid JSON"), ("[4]", "must be a JSON object"), ({}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "between 1 and"), ({"num_speculative_tokens": 2, "model": "x"}, "unknown field"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min <="),
    ({"num_speculative_tokens": "4"}, "must be an integer"),
])
def test_speculative_config_explains_the_problem(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
