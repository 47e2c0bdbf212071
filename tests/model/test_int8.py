"""`--quantization int8`: the int8 linear layer, the smoothing that must not change the float model,
int8 logits against float32, the cached int8 state, greedy outputs with caching on and off, and
int8 and float32 engines sharing one store without ever reading each other's KV."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvstrata.core.config import EngineConfig, ModelConfig
from kvstrata.core.machine import ISA_CAPS
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.model.arch import tensors as names
from kvstrata.model.formats import int8_choice
from kvstrata.model.formats.base import Checkpoint, Norms, Packed
from kvstrata.model.formats.dense import DenseLinear
from kvstrata.model.formats.int8_choice import KernelTrial
from kvstrata.model.formats.int8_kernels import (
    INT8_KERNELS,
    DynamicLinear,
    Int8Rows,
    IntMMLinear,
    available_kernels,
    weight_bits,
)
from kvstrata.model.formats.smoothquant import FloatModel, calibration_ids, input_maxima, smooth
from kvstrata.model.loader import load_model
from kvstrata.model.network.decoder import DecoderModel, Kernels, ModelParts
from tests.engine.test_engine import GREEDY, shared_prefix_prompts, token_ids
from tests.model.model_helpers import Seq, new_cache, run_step, save_tiny_hf_model
from tests.model.test_model import CONFIGS

# SmolLM2, int8 against float32 on the first 256 tokens of the GPL text the accuracy bench reads
# (measured: mean |diff| 0.08 of the float logits' std, top-1 equal at 92%, KL(fp32 || int8) 0.033
# nats; 32 tokens were too few: one near-tie more or less moved top-1 by 3 points).
MEAN_ABS_DIFF_OF_STD = 0.12       # mean |logit difference| at most 12% of the float logits' std
TOP1_AGREEMENT = 0.85
MEAN_KL = 0.1
TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "gpl-3.0.txt"


def logits_of(loaded, tokens: list[int]) -> torch.Tensor:
    seq = Seq(tokens, list(range(-(-len(tokens) // 16))))
    with torch.inference_mode():
        run_step(loaded.model, new_cache(loaded, len(seq.blocks)), [(seq, len(tokens))])
    return torch.stack(seq.logits)                                   # (T, vocab)


@pytest.fixture(scope="module")
def smollm2_int8():
    return load_model(ModelConfig(dtype="float32", device="cpu", quantization="int8"))


def small_layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w, bias, x): a projection with an outlier input channel and a zero row, as SmolLM2's have."""
    gen = torch.Generator().manual_seed(seed)
    w, bias = torch.randn(96, 256, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(7, 256, generator=gen) * torch.rand(7, 1, generator=gen) * 4
    x[:, 5] *= 30
    x[3] = 0                                                         # a zero row has a zero scale
    return w, bias, x


def exact_int8(rows: Int8Rows, x: torch.Tensor) -> torch.Tensor:
    """What an int8 kernel must compute, in float64: per-token int8 activations times the rows."""
    q, scale = rows.weight.double(), rows.scale.double()
    x_scale = x.double().abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
    return (torch.round(x.double() / x_scale) @ q.t()) * x_scale * scale + rows.bias.double()


@pytest.mark.parametrize("kernel", available_kernels())
def test_int8_kernel_computes_exact_int8_products(kernel):
    """Within float rounding of `exact_int8` (an int16 pair sum that saturated would be far off),
    and within int8 rounding of float."""
    w, bias, x = small_layer()
    rows = Int8Rows.from_float(w, bias, weight_bits())
    proj = INT8_KERNELS[kernel](rows)
    y, ref = proj(x), torch.nn.functional.linear(x, w, bias)
    assert y.shape == (7, 96) and y.dtype == torch.float32 and torch.isfinite(y).all()
    assert torch.equal(y[3], bias)
    assert (y.double() - exact_int8(rows, x)).norm() / ref.norm() < 1e-4
    assert (y - ref).norm() / ref.norm() < 0.05              # the outlier channel takes most of each row's range
    assert proj.nbytes == 96 * 256 + 96 * 4


@pytest.mark.parametrize("kernel", available_kernels())
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(kernel):
    """Per-token quantization: the dynamic kernels' one scale per call is pinned, so no row's result
    depends on the others (what keeps int8 greedy outputs equal with caching on and off)."""
    _, _, x = small_layer()
    proj = INT8_KERNELS[kernel](Int8Rows.from_float(*small_layer(1)[:2], weight_bits()))
    together = proj(x)
    assert torch.equal(torch.cat([proj(x[i:i + 1]) for i in range(len(x))]), together)
    assert torch.equal(torch.cat([proj(x[:2]), proj(x[2:])]), together)


# Run in a child whose CPU is capped (kvstrata.core.machine.isa_cap_environ): what it may use, and each
# kernel it may use within rounding error of float32 on a small layer.
CAPPED_CHECK = """
import json, sys, torch
sys.path.insert(0, {root!r})
from tests.model.test_int8 import exact_int8, small_layer
from kvstrata.core.machine import machine
from kvstrata.model.formats.int8_kernels import INT8_KERNELS, Int8Rows, available_kernels, weight_bits
from kvstrata.model.formats.dense import native_bf16
w, bias, x = small_layer()
ref = torch.nn.functional.linear(x, w, bias).double()
rows = Int8Rows.from_float(w, bias, weight_bits())
errors = {{k: float((INT8_KERNELS[k](rows)(x) - exact_int8(rows, x)).norm() / ref.norm()) for k in available_kernels()}}
print(json.dumps({{"isa": machine().isa, "kernels": available_kernels(), "errors": errors, "bits": weight_bits(),
                  "native_bf16": native_bf16()}}))
"""


@pytest.mark.parametrize("cap", ["avx2", "avx512_vnni"])
def test_int8_kernels_under_a_forced_isa(cap):
    from kvstrata.core.machine import isa_cap_environ, machine
    if not set(ISA_CAPS[cap]) <= set(machine().isa):
        pytest.skip(f"this CPU has no {cap}")
    script = CAPPED_CHECK.format(root=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, **isa_cap_environ(cap)},
                          capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["isa"] == list(ISA_CAPS[cap])
    assert seen["kernels"] and all(error < 1e-4 for error in seen["errors"].values()), seen
    assert not seen["native_bf16"]                                   # neither cap has native bf16
    if cap == "avx2":
        assert "int_mm" not in seen["kernels"]                       # its int16 pair sums saturate there
        assert seen["bits"] == 7
    else:
        assert seen["bits"] == 8


def test_the_choice_is_the_fastest_accurate_kernel_and_warns_when_float_is_faster(monkeypatch, caplog):
    # kernel: (ms at 1 row, ms at 32 rows, perplexity); each "projection" built is the kernel's name.
    table = {"float32": (10.0, 40.0, 20.0), "int_mm": (5.0, 30.0, 20.2), "fbgemm": (2.0, 10.0, 25.0),
             "onednn": (6.0, 20.0, 20.1)}
    monkeypatch.setattr(int8_choice, "available_kernels", lambda: ["int_mm", "fbgemm", "onednn"])
    monkeypatch.setattr(int8_choice, "INT8_KERNELS", {k: (lambda rows, k=k: k) for k in table})
    monkeypatch.setattr(int8_choice, "_float_projection", lambda rows: "float32")
    monkeypatch.setattr(int8_choice, "_time_pass", lambda projections, rows, n: table[projections[0]][n > 1])
    choice = int8_choice.choose_kernel([None], lambda projections: table[projections[0]][2], list(table)[1:])
    assert choice.kernel == "onednn"              # fbgemm is fastest but 25% worse: never chosen
    assert [t.kernel for t in choice.trials] == list(table)
    assert choice.speedups() == {1: 10.0 / 6.0, 32: 2.0}
    assert int8_choice.Int8Choice.from_json(json.loads(json.dumps(choice.to_json()))) == choice
    with pytest.raises(ValueError, match="no int8 kernel keeps perplexity within 5% of float32"):
        int8_choice.choose_kernel([None], lambda projections: table[projections[0]][2], ["fbgemm"])

    def broken(rows):
        raise RuntimeError("this library cannot pack here")
    monkeypatch.setitem(int8_choice.INT8_KERNELS, "onednn", broken)       # a kernel that fails to build
    choice = int8_choice.choose_kernel([None], lambda projections: table[projections[0]][2], list(table)[1:])
    assert choice.kernel == "int_mm" and [t.kernel for t in choice.trials] == ["float32", "int_mm", "fbgemm"]
    slow = int8_choice.Int8Choice("int_mm", "cpu", torch.__version__,
                                  [KernelTrial("float32", {1: 10.0, 32: 40.0}, 20.0),
                                   KernelTrial("int_mm", {1: 12.0, 32: 60.0}, 20.2)])
    with caplog.at_level(logging.WARNING, logger="kvstrata.model.int8_choice"):
        int8_choice._report(slow)
    assert "float32 is faster here at 1/32 rows" in caplog.text and "serve without --quantization" in caplog.text


@pytest.mark.parametrize("name", ["llama-bias", "qwen2", "mha-head-dim"])
def test_smoothing_leaves_the_float_model_unchanged(tmp_path, monkeypatch, name):
    save_tiny_hf_model(tmp_path, CONFIGS[name]())
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu"))
    a, cpu = loaded.arch, torch.device("cpu")
    checkpoint = Checkpoint(dict(load_file(tmp_path / "model.safetensors")), torch.float32, cpu)   # the float rows
    embeddings = checkpoint.take(names.EMBEDDINGS)
    norms = Norms([checkpoint.take(names.norms(i, a)["input_norm"]) for i in range(a.num_layers)],
                  [checkpoint.take(names.norms(i, a)["post_norm"]) for i in range(a.num_layers)],
                  checkpoint.take(names.FINAL_NORM))
    biases = {"qkv": a.attention_bias, "o": a.attention_out_bias, "gate_up": False, "down": False}
    model = FloatModel([{p: DenseLinear(checkpoint.matrix(i, p), checkpoint.bias(i, p, biases[p]))
                         for p in names.PROJECTIONS} for i in range(a.num_layers)],
                       DenseLinear(embeddings if a.tie_word_embeddings else checkpoint.take(names.LM_HEAD), None))
    tokens = list(range(3, 40))

    def run(packed: Packed, ids: list[int] = tokens) -> torch.Tensor:
        return DecoderModel(ModelParts(a, torch.float32, cpu, embeddings, norms, packed, True, False),
                            Kernels()).prefill_alone(ids)

    before = run(model)
    torch.testing.assert_close(before, logits_of(loaded, tokens), atol=1e-4, rtol=1e-4)   # the float model
    maxima, head_max = input_maxima(model, lambda packed: run(packed, calibration_ids(None, a, 64)))
    assert all(m.min() > 0 for layer in maxima for m in layer.values()) and head_max.min() > 0
    smooth(model, norms, a, maxima, head_max, {name: 0.6 for name in ("qkv", "o", "gate_up", "down", "head")})
    torch.testing.assert_close(run(model), before, atol=1e-4, rtol=1e-4)


def test_int8_logits_close_to_float32(smollm2_fp32, smollm2_int8):
    tokens = smollm2_fp32.tokenizer(TEXT.read_text()[:3000])["input_ids"][:256]
    ref, ours = logits_of(smollm2_fp32, tokens), logits_of(smollm2_int8, tokens)
    assert (ours - ref).abs().mean() < MEAN_ABS_DIFF_OF_STD * ref.std()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= TOP1_AGREEMENT
    kl = torch.nn.functional.kl_div(ours.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert kl < MEAN_KL
    assert smollm2_int8.model.step_weight_bytes() < smollm2_fp32.model.step_weight_bytes() / 3.5


def test_int8_state_is_cached_and_reloads_identically(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))
    save_tiny_hf_model(tmp_path / "model", CONFIGS["llama"]())
    config = ModelConfig(model=str(tmp_path / "model"), device="cpu", quantization="int8")
    first = load_model(config)
    models = tmp_path / "cache" / "models"
    [path] = models.glob(f"int8-*-w{weight_bits()}.safetensors")
    [choice] = models.glob(f"{path.stem}.kernel-*.json")              # the kernel measured for this CPU
    assert json.loads(choice.read_text())["kernel"] == first.int8.kernel
    mtimes = path.stat().st_mtime_ns, choice.stat().st_mtime_ns
    second = load_model(config)
    assert (path.stat().st_mtime_ns, choice.stat().st_mtime_ns) == mtimes     # read, not rewritten
    assert second.fingerprint == first.fingerprint and second.int8 == first.int8
    tokens = list(range(5, 30))
    assert torch.equal(logits_of(second, tokens), logits_of(first, tokens))
    assert all(isinstance(p, (IntMMLinear, DynamicLinear))              # int8 rows, no float weights
               for p in first.model.parts.packed.in_call_order())
    # Another kernel rounds differently: the same int8 rows, another fingerprint (no KV crosses).
    other = next(k for k in available_kernels() if k != first.int8.kernel)
    monkeypatch.setenv("KVSTRATA_INT8_KERNEL", other)
    forced = load_model(config)
    assert forced.int8.kernel == other and forced.fingerprint != first.fingerprint
    assert path.stat().st_mtime_ns == mtimes[0]
    # A cache that cannot take the choice costs the next start a measurement, never the start.
    monkeypatch.delenv("KVSTRATA_INT8_KERNEL")
    choice.unlink()
    monkeypatch.setattr(int8_choice, "_write_atomically", lambda path, text: (_ for _ in ()).throw(OSError("full")))
    assert load_model(config).int8.trials and not choice.exists()        # measured again, not cached


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


def test_int8_and_float32_engines_sharing_a_store_never_hit_each_other(smollm2_fp32, smollm2_int8, tmp_path):
    assert smollm2_fp32.fingerprint != smollm2_int8.fingerprint
    prompt = "The history of the Loire valley is long: castles, vineyards and rivers shaped it. " * 3

    def run(loaded):
        engine = LLMEngine(EngineConfig.from_options(
            audit_every_step=True, kv_cache_memory="64MiB", store="disk", store_path=str(tmp_path),
            write_policy="write_through"), loaded=loaded)
        out = engine.generate([prompt], GREEDY)[0]
        stats = engine.tiers.stats
        engine.close()
        return out.new_token_ids, stats.hit_tokens["store"], sum(stats.load_failures.values())

    fp32_tokens, hits, failures = run(smollm2_fp32)                       # writes fp32 records
    assert hits == 0 and failures == 0
    int8_tokens, hits, failures = run(smollm2_int8)                  # finds none of them
    assert hits == 0 and failures == 0
    again_tokens, hits, _ = run(smollm2_fp32)                             # its own records are still there
    assert hits >= 48 and again_tokens == fp32_tokens
    again_int8, hits, _ = run(smollm2_int8)
    assert hits >= 48 and again_int8 == int8_tokens
