"""`--quantization int8`: the int8 linear layer, the smoothing that must not change the float model,
int8 logits against float32, the cached int8 state, greedy outputs with caching on and off, and
int8 and float32 engines sharing one store without ever reading each other's KV."""

from pathlib import Path

import pytest
import torch
from model_helpers import Seq, new_cache, run_step, save_tiny_hf_model
from test_engine import GREEDY, shared_prefix_prompts, token_ids
from test_model import CONFIGS

from kvstrata.config import EngineConfig, ModelConfig
from kvstrata.engine import LLMEngine
from kvstrata.model.int8 import Int8Linear
from kvstrata.model.llama import LlamaModel
from kvstrata.model.loader import load_model
from kvstrata.model.quantize import calibration_ids, input_maxima, int8_cache_path, smooth

# SmolLM2, int8 against float32 on the first 256 tokens of the GPL text the accuracy bench reads
# (measured: mean |diff| 0.08 of the float logits' std, top-1 equal at 92%, KL(fp32 || int8) 0.033
# nats; 32 tokens were too few: one near-tie more or less moved top-1 by 3 points).
MEAN_ABS_DIFF_OF_STD = 0.12       # mean |logit difference| at most 12% of the float logits' std
TOP1_AGREEMENT = 0.85
MEAN_KL = 0.1
TEXT = Path(__file__).parent.parent / "bench" / "data" / "gpl-3.0.txt"


def logits_of(loaded, tokens: list[int]) -> torch.Tensor:
    seq = Seq(tokens, list(range(-(-len(tokens) // 16))))
    with torch.inference_mode():
        run_step(loaded.model, new_cache(loaded, len(seq.blocks)), [(seq, len(tokens))])
    return torch.stack(seq.logits)                                   # (T, vocab)


@pytest.fixture(scope="module")
def smollm2_int8():
    return load_model(ModelConfig(dtype="float32", device="cpu", quantization="int8"))


def test_int8_linear_is_within_rounding_error_of_float():
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(96, 256, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(5, 256, generator=gen)
    x[3] = 0                                                         # a zero row has a zero scale
    proj = Int8Linear.from_float(w, bias)
    y, ref = proj(x), torch.nn.functional.linear(x, w, bias)
    assert y.shape == (5, 96) and y.dtype == torch.float32 and torch.isfinite(y).all()
    assert torch.equal(y[3], bias)
    assert (y - ref).norm() / ref.norm() < 0.01             # 8-bit rounding on both sides: ~0.5%
    assert proj.nbytes == 96 * 256 + 96 * 4


@pytest.mark.parametrize("name", ["llama-bias", "qwen2", "mha-head-dim"])
def test_smoothing_leaves_the_float_model_unchanged(tmp_path, monkeypatch, name):
    save_tiny_hf_model(tmp_path, CONFIGS[name]())
    monkeypatch.setattr(LlamaModel, "pack_projections", lambda model: None)   # smoothing needs the float rows
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu"))
    tokens = list(range(3, 40))
    before = logits_of(loaded, tokens)
    maxima, head_max = input_maxima(loaded.model, calibration_ids(None, loaded.arch, 64))
    assert all(m.min() > 0 for layer in maxima for m in layer.values()) and head_max.min() > 0
    smooth(loaded.model, maxima, head_max)
    torch.testing.assert_close(logits_of(loaded, tokens), before, atol=1e-4, rtol=1e-4)


def test_int8_logits_close_to_float32(smollm2, smollm2_int8):
    tokens = smollm2.tokenizer(TEXT.read_text()[:3000])["input_ids"][:256]
    ref, ours = logits_of(smollm2, tokens), logits_of(smollm2_int8, tokens)
    assert (ours - ref).abs().mean() < MEAN_ABS_DIFF_OF_STD * ref.std()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= TOP1_AGREEMENT
    kl = torch.nn.functional.kl_div(ours.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert kl < MEAN_KL
    assert smollm2_int8.model.step_weight_bytes() < smollm2.model.step_weight_bytes() / 3.5


def test_int8_state_is_cached_and_reloads_identically(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))
    save_tiny_hf_model(tmp_path / "model", CONFIGS["llama"]())
    config = ModelConfig(model=str(tmp_path / "model"), device="cpu", quantization="int8")
    first = load_model(config)
    path = int8_cache_path(tmp_path / "cache", first.fingerprint)
    assert path.is_file()
    mtime = path.stat().st_mtime_ns
    second = load_model(config)
    assert path.stat().st_mtime_ns == mtime                          # read, not rewritten
    assert second.fingerprint == first.fingerprint
    tokens = list(range(5, 30))
    assert torch.equal(logits_of(second, tokens), logits_of(first, tokens))
    assert first.model.layers[0].qkv is None                         # the float weights are gone


def test_int8_rejects_what_its_kernels_cannot_run(tmp_path):
    save_tiny_hf_model(tmp_path, CONFIGS["llama"]())
    with pytest.raises(ValueError, match="float32"):
        load_model(ModelConfig(model=str(tmp_path), device="cpu", dtype="bfloat16", quantization="int8"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="int4").validate()


def test_int8_greedy_outputs_identical_with_caching_on_and_off(smollm2_int8):
    def engine(**opts):
        return LLMEngine(EngineConfig.from_options(audit_every_step=True, kv_cache_memory="64MiB", **opts),
                         loaded=smollm2_int8)
    reference = token_ids(engine(enable_prefix_caching=False, max_num_seqs=1).generate(shared_prefix_prompts(),
                                                                                         GREEDY))
    cached = engine()
    outputs = cached.generate(shared_prefix_prompts(), GREEDY)
    assert token_ids(outputs) == reference
    assert sum(o.num_cached_tokens for o in outputs) > 0


def test_int8_and_float32_engines_sharing_a_store_never_hit_each_other(smollm2, smollm2_int8, tmp_path):
    assert smollm2.fingerprint != smollm2_int8.fingerprint
    prompt = "The history of the Loire valley is long: castles, vineyards and rivers shaped it. " * 3

    def run(loaded):
        engine = LLMEngine(EngineConfig.from_options(
            audit_every_step=True, kv_cache_memory="64MiB", store="disk", store_path=str(tmp_path),
            write_policy="write_through"), loaded=loaded)
        out = engine.generate([prompt], GREEDY)[0]
        stats = engine.tiers.stats
        engine.close()
        return out.new_token_ids, stats.hit_tokens["store"], sum(stats.load_failures.values())

    fp32_tokens, hits, failures = run(smollm2)                       # writes fp32 records
    assert hits == 0 and failures == 0
    int8_tokens, hits, failures = run(smollm2_int8)                  # finds none of them
    assert hits == 0 and failures == 0
    again_tokens, hits, _ = run(smollm2)                             # its own records are still there
    assert hits >= 48 and again_tokens == fp32_tokens
    again_int8, hits, _ = run(smollm2_int8)
    assert hits >= 48 and again_int8 == int8_tokens
