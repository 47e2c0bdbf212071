"""`--load-format dummy`: real shapes from shipped configs, seeded weights, the tokenizer's placeholders.

The shapes are checked against the real models' parameter counts; everything that runs uses a tiny
config, so the suite never allocates a 1B model (those runs live in benchmarks/).
"""

from __future__ import annotations

import json

import pytest
import torch

from kvstrata.core.config import EngineConfig, ModelConfig
from kvstrata.model.formats.dense import DenseFormat
from kvstrata.model.loader import load_model, plan_load
from kvstrata.model.sources import dummy

TINY = dict(model_type="llama", vocab_size=50_000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 512},
            rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=49_999)

# Parameter counts as the real models' cards give them, to 0.01B.
REAL_SIZES = {"llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21, "llama-3.1-8b": 8.03, "qwen2.5-1.5b": 1.54,
              "qwen2.5-7b": 7.62, "qwen3-0.6b": 0.60, "qwen3-4b": 4.02, "qwen3-8b": 8.19,
              "gemma-3-1b": 1.00, "gemma-3-4b": 3.88, "gemma-3-12b": 11.77}     # Gemma: the language model's
ROPE = {"llama": "llama3", "gemma-3-4b": "linear", "gemma-3-12b": "linear"}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny-llama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY))
    return path


@pytest.mark.parametrize("name", sorted(REAL_SIZES))
def test_shipped_shapes_are_the_real_models(name):
    source = dummy.dummy_source(name)
    arch = source.arch
    parameters = sum(torch.Size(shape).numel() for shape in dummy.tensor_shapes(arch).values())
    assert round(parameters / 1e9, 2) == REAL_SIZES[name]
    assert DenseFormat().footprint(arch, torch.bfloat16, torch.device("cpu")).parameters == parameters - sum(
        shape[0] for key, shape in dummy.tensor_shapes(arch).items() if "norm" in key or key.endswith("bias"))
    assert arch.attention_bias == name.startswith("qwen2")
    assert (arch.rope_scaling or {}).get("rope_type") == ROPE.get(name.split("-")[0], ROPE.get(name))


def test_each_tensor_depends_on_its_name_and_seed_alone():
    shape = (32, 16)
    first = dummy.dummy_tensor("model.layers.0.mlp.up_proj.weight", shape)
    dummy.dummy_tensor("model.layers.0.mlp.gate_proj.weight", shape)            # another draw in between
    assert torch.equal(dummy.dummy_tensor("model.layers.0.mlp.up_proj.weight", shape), first)
    assert not torch.equal(dummy.dummy_tensor("model.layers.0.mlp.gate_proj.weight", shape), first)
    assert not torch.equal(dummy.dummy_tensor("model.layers.0.mlp.up_proj.weight", shape, seed=1), first)
    assert first.std().item() == pytest.approx(16 ** -0.5, rel=0.2)            # fan-in scaled
    assert torch.equal(dummy.dummy_tensor("model.norm.weight", (8,)), torch.ones(8))


def test_a_config_path_or_folder_loads_and_names_the_model(tiny_config):
    for model in (str(tiny_config), str(tiny_config.parent)):
        source = dummy.dummy_source(model)
        assert source.name == "tiny-llama" and source.arch.vocab_size == 50_000


@pytest.mark.parametrize("model, message", [
    (None, "needs --model"), ("llama-9b", "shipped config"), ("/nowhere/config.json", "shipped config")])
def test_bad_dummy_models_are_user_errors(model, message):
    with pytest.raises(ValueError, match=message):
        dummy.dummy_source(model)


def test_a_shipped_name_without_dummy_says_which_flag(tmp_path):
    with pytest.raises(ValueError, match="--load-format dummy"):
        plan_load(ModelConfig(model="llama-3.2-1b"))


def test_dummy_model_decodes_finite_logits_with_the_default_tokenizer(tiny_config):
    """bf16, 200 positions: the weights keep activations finite; ids past SmolLM2's 49,152 tokens
    decode as placeholders; the stop token is the tokenizer's, not the config's."""
    loaded = load_model(ModelConfig(model=str(tiny_config), load_format="dummy", dtype="bfloat16", device="cpu"))
    assert loaded.folder is None and loaded.eos_token_ids == (2,)
    assert len(loaded.tokenizer) == 50_000
    assert loaded.tokenizer.decode([49_999, 5], skip_special_tokens=True).startswith("<|id_49999|>")
    logits = loaded.model.prefill_alone(list(range(100, 300)))
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_dummy_weights_have_a_fingerprint_of_their_own(tiny_config, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(TINY, num_hidden_layers=2)))
    fingerprints = {load_model(ModelConfig(model=str(path), load_format="dummy", device="cpu")).fingerprint
                    for path in (tiny_config, other)}
    assert len(fingerprints) == 2
    again = load_model(ModelConfig(model=str(tiny_config), load_format="dummy", device="cpu"))
    assert again.fingerprint in fingerprints


def greedy_with_and_without_caches(loaded, prompts: list[list[int]], block_size: int, device_blocks: int,
                                   host_blocks: int) -> tuple[list[list[int]], list[list[int]], dict[str, int]]:
    """Each prompt's greedy tokens asked one after another, every cache on (prefix caching, a host tier below a
    device pool too small to keep them all: a long prompt between revisits pushes the others down), then every
    cache off; audited every step. Also the prompt tokens each tier served with the caches on."""
    from kvstrata.core.sampling_params import SamplingParams
    from kvstrata.engine.llm_engine import LLMEngine

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def outputs(**options) -> tuple[list[list[int]], dict[str, int]]:
        engine = LLMEngine(EngineConfig.from_options(audit_every_step=True, num_device_blocks=device_blocks,
                                                     block_size=block_size, **options), loaded=loaded)
        done = [out.new_token_ids for prompt in prompts for out in engine.generate([prompt], params)]
        assert all(len(tokens) == params.max_tokens for tokens in done), "a request ended early (an error?)"
        rest = engine.tiers.audit()
        assert all(c.used == 0 and c.in_flight == 0 for c in rest.values()), f"blocks held at rest: {rest}"
        return done, dict(engine.tiers.stats.hit_tokens)

    on, hits = outputs(enable_prefix_caching=True, num_host_blocks=host_blocks)
    return on, outputs(enable_prefix_caching=False)[0], hits


def test_greedy_outputs_with_every_cache_feature_on_equal_those_with_it_off(tiny_config):
    loaded = load_model(ModelConfig(model=str(tiny_config), load_format="dummy", dtype="float32", device="cpu"))
    shared = list(range(1000, 1040))
    prompts = [shared + list(range(3000, 3008)), shared + list(range(4000, 4008)), list(range(6000, 6060))] * 2
    on, off, hits = greedy_with_and_without_caches(loaded, prompts, block_size=4, device_blocks=24, host_blocks=32)
    assert on == off and len(on) == len(prompts)
    assert hits["device"] > 0 and hits["host"] > 0, hits


@pytest.mark.slow
def test_the_1b_shape_serves_the_same_greedy_tokens_with_every_cache_on_and_off():
    """The real llama-3.2-1b shape (GQA, llama3 RoPE scaling, tied 128k vocabulary) in float32: prefixes
    served from the device and the host tier give the tokens a recompute gives."""
    loaded = load_model(ModelConfig(model="llama-3.2-1b", load_format="dummy", dtype="float32", device="cpu"))
    shared = list(range(2000, 2000 + 96))
    prompts = [shared + list(range(5000, 5010)), shared + list(range(6000, 6010)), list(range(8000, 8150))] * 2
    on, off, hits = greedy_with_and_without_caches(loaded, prompts, block_size=16, device_blocks=12, host_blocks=64)
    assert on == off and len(on) == len(prompts)
    assert hits["device"] > 0 and hits["host"] > 0, hits
    assert all(0 <= token < loaded.arch.vocab_size for tokens in on for token in tokens)
