"""A GGUF's Q4_0 / Q4_1 / Q8_0 matrices served at their own bits (`--quantization gguf`): the blocks decode
to exactly what gguf-py dequantizes, the 4-bit kernel multiplies by those weights, a row's result does
not depend on its batch, other types are widened with a warning, and the engine's greedy outputs are the
same with every cache feature on as off."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from kvstrata.core.config import EngineConfig, ModelConfig
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.model.gguf_bits import BLOCK_BYTES, Int4Linear, decode_blocks
from kvstrata.model.linear import PackedLinear
from kvstrata.model.loader import load_model
from tests.model.model_helpers import Seq, new_cache, run_step, save_tiny_hf_model, write_tiny_gguf

TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("kind", list(BLOCK_BYTES))
def test_blocks_decode_to_what_gguf_py_dequantizes(kind):
    w = np.random.default_rng(0).normal(0, 0.3, (48, 96)).astype(np.float32)
    w[3] = 0.0                                                  # an all-zero block: d = 0
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    terms = decode_blocks(torch.from_numpy(raw), kind)
    assert len(terms.q) == (2 if kind == "Q8_0" else 1)
    assert all(int(q.min()) >= 0 and int(q.max()) <= 15 for q in terms.q)
    np.testing.assert_array_equal(terms.dequantized().numpy(), expected)


@pytest.mark.parametrize("kind", list(BLOCK_BYTES))
def test_the_kernel_multiplies_by_the_decoded_weights_and_a_row_is_independent_of_its_batch(kind):
    w = np.random.default_rng(1).normal(0, 0.3, (64, 128)).astype(np.float32)
    terms = decode_blocks(torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])), kind)
    bias = torch.randn(64)
    linear = Int4Linear.from_terms(terms, bias)
    x = torch.randn(9, 128)
    y = linear(x)
    assert y.dtype == torch.float32
    reference = x.bfloat16().float() @ terms.dequantized().t() + bias
    # bf16 scales (2^-9 relative) and bf16 outputs: a few parts in a thousand of the row's scale
    assert (y - reference).abs().max() <= 1e-2 * reference.abs().max()
    assert torch.equal(linear(x[:1]), y[:1]) and torch.equal(linear(x[4:6]), y[4:6])
    assert linear.nbytes <= w.size * (1.25 if kind == "Q8_0" else 0.625)     # half a byte a weight a term, + scale and zero


# In a child whose CPU is capped at AVX2 (kvstrata.core.machine.isa_cap_environ: torch dispatches its AVX2
# kernels): the 4-bit kernel's error against the decoded weights and a row's independence of its batch.
CAPPED_CHECK = """
import json, gguf, numpy as np, torch
from kvstrata.core.machine import machine
from kvstrata.model.gguf_bits import Int4Linear, decode_blocks
out = {"isa": machine().isa, "aten": torch.backends.cpu.get_cpu_capability(), "errors": {}, "row_alone": {}}
for kind in ("Q4_0", "Q4_1", "Q8_0"):
    w = np.random.default_rng(2).normal(0, 0.3, (64, 128)).astype(np.float32)
    terms = decode_blocks(torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])), kind)
    linear, x = Int4Linear.from_terms(terms), torch.randn(5, 128)
    y, ref = linear(x), x.bfloat16().float() @ terms.dequantized().t()
    out["errors"][kind] = float((y - ref).abs().max() / ref.abs().max())
    out["row_alone"][kind] = bool(torch.equal(linear(x[2:3]), y[2:3]))
print(json.dumps(out))
"""


def test_the_4bit_kernel_under_an_avx2_cap():
    from kvstrata.core.machine import isa_cap_environ
    done = subprocess.run([sys.executable, "-c", CAPPED_CHECK], env={**os.environ, **isa_cap_environ("avx2")},
                          capture_output=True, text=True, timeout=120, check=True,
                          cwd=Path(__file__).resolve().parents[2])
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "avx512f" not in seen["isa"] and seen["aten"] == "AVX2", seen          # torch's AVX2 kernels ran
    assert all(error <= 1e-2 for error in seen["errors"].values()) and all(seen["row_alone"].values()), seen


@pytest.fixture
def quantized_gguf(tmp_path):
    """A tiny model written as a Q4_0 GGUF, but Q4_1 attention output, Q8_0 embeddings and F16 ffn_down."""
    hf = save_tiny_hf_model(tmp_path / "hf", TINY, seed=3)
    path = tmp_path / "Tiny-Llama.Q4_0.gguf"
    types = {kind: "Q4_0" for kind in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")}
    write_tiny_gguf(path, hf, {**types, "attn_output": "Q4_1", "token_embd": "Q8_0", "ffn_down": "F16"})
    return path


def test_a_gguf_is_served_at_its_own_bits_and_other_types_widened_with_a_warning(quantized_gguf, caplog):
    with caplog.at_level(logging.WARNING, logger="kvstrata.model.loader"):
        own = load_model(ModelConfig(model=str(quantized_gguf), quantization="gguf", dtype="float32"))
    widened = load_model(ModelConfig(model=str(quantized_gguf), dtype="float32"))
    layer = own.model.layers[0].projections
    assert all(isinstance(layer[name], Int4Linear) for name in ("qkv", "o", "gate_up"))
    assert isinstance(layer["down"], PackedLinear) and isinstance(own.model.head, Int4Linear)
    assert "2 matrices widened to float32 (2 F16)" in caplog.text
    assert own.fingerprint != widened.fingerprint            # KV of one weight format never serves the other
    logits = {}
    for name, loaded in (("own", own), ("widened", widened)):
        seq = Seq(list(range(3, 60)), blocks=[3, 1, 0, 2])
        kv = new_cache(loaded, 4, 16)
        run_step(loaded.model, kv, [(seq, 50)])
        for _ in range(7):
            run_step(loaded.model, kv, [(seq, 1)])
        logits[name] = torch.stack(seq.logits)
    # the same weights: only the kernel's bf16 activations and scales differ from the float32 model
    assert (logits["own"] - logits["widened"]).abs().max() <= 0.05 * logits["widened"].abs().max()


def test_only_a_gguf_on_cpu_has_own_bits(tmp_path):
    save_tiny_hf_model(tmp_path / "hf", TINY)
    with pytest.raises(ValueError, match="did not come from a GGUF file"):
        load_model(ModelConfig(model=str(tmp_path / "hf"), quantization="gguf"))
    with pytest.raises(ValueError, match="dummy weights have none"):
        load_model(ModelConfig(model="llama-3.2-1b", load_format="dummy", quantization="gguf"))


def test_greedy_outputs_at_own_bits_are_the_same_with_every_cache_feature_on_as_off(quantized_gguf, tmp_path):
    """Prefix caching, a host tier and the disk store, preemption and reloads, against none of them."""
    loaded = load_model(ModelConfig(model=str(quantized_gguf), quantization="gguf"))
    shared = list(range(5, 69))
    prompts = [shared + [i, i + 1, i + 2] for i in range(6)] + [shared[:40]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run(**options) -> tuple[list[list[int]], dict[str, int]]:
        engine = LLMEngine(EngineConfig.from_options(audit_every_step=True, block_size=16, **options), loaded=loaded)
        first = engine.generate(prompts[:3], params)
        rest = engine.generate(prompts[3:], params)               # revisits what the first round cached
        return [out.new_token_ids for out in first + rest], dict(engine.tiers.stats.hit_tokens)

    plain, plain_hits = run(num_device_blocks=64, enable_prefix_caching=False)
    cached, hits = run(num_device_blocks=12, num_host_blocks=8, store="disk", store_path=str(tmp_path / "store"))
    assert sum(plain_hits.values()) == 0 and sum(hits.values()) > 0, hits
    assert cached == plain
