"""The weight-format seam: `--quantization`, `--dtype` and `--device` resolved in one place (kvstrata.model.formats.
resolve), the format deciding the dtype and the path whatever the CPU's float types, and what runs said out loud."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstrata.core.config import ModelConfig
from kvstrata.core.machine import ISA_CAPS, isa_cap_environ, machine
from kvstrata.model import formats, kernels
from kvstrata.model.arch import describe
from kvstrata.model.formats import dense
from kvstrata.model.formats.gguf import read_types
from kvstrata.model.loader import load_model, plan_load
from kvstrata.model.network.steps import FusedLoop, KernelLoop, TorchLoop
from tests.model.model_helpers import GGUF_MATRICES, kernels_on, tiny_gguf
from tests.model.model_helpers import TINY_LLAMA as TINY

AT_BITS = {**dict.fromkeys(GGUF_MATRICES, "Q4_0"), "attn_output": "Q4_1", "token_embd": "Q8_0"}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def at_bits(tmp_path):
    """A tiny GGUF whose every matrix the kernel runs at its bits."""
    return str(tiny_gguf(tmp_path / "bits", TINY, AT_BITS, seed=4))


def resolved(**options) -> formats.Resolved:
    return plan_load(ModelConfig(device="cpu", **options)).resolved


@kernels_on
def test_a_gguf_runs_at_its_bits_in_bf16_whatever_the_cpus_float_types(at_bits, monkeypatch):
    """Without native bf16 (an Ice Lake Xeon, or this CPU told so) float weights take float32, but a GGUF at its
    bits still takes bf16 and the fused layers: every step is our kernels, which widen bf16 in software."""
    monkeypatch.setattr(dense, "native_bf16", lambda: False)
    plan = resolved(model=at_bits)
    assert (plan.format.name, plan.dtype) == ("gguf", torch.bfloat16) and "own bits" in plan.why
    loaded = load_model(ModelConfig(model=at_bits))
    assert isinstance(loaded.model.loop, FusedLoop)
    assert loaded.runs() == {"quantization": "gguf", "dtype": "bfloat16", "kv_cache_dtype": "bfloat16",
                             "step": FusedLoop.name, "kernels": kernels.level().label}
    assert resolved(model=at_bits, quantization="none").dtype == torch.float32       # float weights: float32


@kernels_on
def test_a_gguf_with_widened_matrices_takes_the_float_dtype_of_its_cpu(tmp_path, monkeypatch):
    """A widened matrix runs through oneDNN, so without native bf16 the file runs in float32 (the Python loop)."""
    path = str(tiny_gguf(tmp_path / "widened", TINY, {**AT_BITS, "ffn_down": "F16"}, seed=4))
    monkeypatch.setattr(dense, "native_bf16", lambda: False)
    assert (resolved(model=path).format.name, resolved(model=path).dtype) == ("gguf", torch.float32)
    monkeypatch.setattr(dense, "native_bf16", lambda: True)
    assert resolved(model=path).dtype == torch.bfloat16


def test_an_explicit_float32_means_float32_math(at_bits):
    """`--dtype float32` with `--quantization auto` widens the GGUF (no int8 activation blocks): lm-eval through
    the server then matches transformers on the same file. `--quantization gguf` still runs the bits."""
    plan = resolved(model=at_bits, dtype="float32")
    assert (plan.format.name, plan.dtype) == ("none", torch.float32) and "float32 math" in plan.why
    loaded = load_model(ModelConfig(model=at_bits, dtype="float32"))
    assert loaded.quantization == "none" and isinstance(loaded.model.loop, TorchLoop)
    if kernels.off_reason() is None:
        assert resolved(model=at_bits, dtype="float32", quantization="gguf").format.name == "gguf"


def test_with_the_kernels_off_auto_widens_and_says_why_and_gguf_is_refused(at_bits, monkeypatch):
    monkeypatch.setenv("KVSTRATA_KERNELS", "0")
    plan = resolved(model=at_bits)
    assert plan.format.name == "none" and "KVSTRATA_KERNELS=0" in plan.why
    with pytest.raises(ValueError, match=r"GGUF kernel, which is off here \(KVSTRATA_KERNELS=0\)"):
        resolved(model=at_bits, quantization="gguf")


def test_formats_refuse_what_they_cannot_run(at_bits, tmp_path):
    with pytest.raises(ValueError, match="int8 runs with float32 activations"):
        resolved(model=at_bits, quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="--compile cannot trace"):
        resolved(model=at_bits, quantization="gguf", compile=True)
    assert resolved(model=at_bits, compile=True).format.name == "none"          # auto: widened under --compile
    with pytest.raises(ValueError, match="dtype must be"):
        formats.resolve(ModelConfig(dtype="float16"), describe(TINY.to_dict()), None)


@kernels_on
def test_every_gguf_type_fact_comes_from_the_kernels_header(at_bits):
    """The converter kept the blocks of exactly the types the header's table names, and the format reads them."""
    folder = load_model(ModelConfig(model=at_bits)).folder
    types = read_types(folder)
    assert set(types.values()) == {"Q4_0", "Q4_1", "Q8_0"} and set(types.values()) <= set(kernels.gguf.GGUF_TYPES)
    assert [t.name for t in kernels.abi.gguf_types()] == list(kernels.gguf.GGUF_TYPES)
    assert kernels.gguf.GGUF_TYPES["Q6_K"].block_weights == 256 and kernels.gguf.GGUF_TYPES["Q4_1"].block_bytes == 20


@kernels_on
def test_a_float_bf16_model_takes_the_kernel_loop(tmp_path):
    from tests.model.model_helpers import save_tiny_hf_model
    save_tiny_hf_model(tmp_path / "hf", TINY)
    loaded = load_model(ModelConfig(model=str(tmp_path / "hf"), dtype="bfloat16"))
    assert loaded.quantization == "none" and isinstance(loaded.model.loop, KernelLoop)


# In a child whose CPU is capped (kvstrata.core.machine.isa_cap_environ): what `make serve`'s model runs there.
CAPPED_DEFAULT = """
import json
from kvstrata.core.config import ModelConfig
from kvstrata.core.machine import machine
from kvstrata.model.loader import load_model
loaded = load_model(ModelConfig())
print(json.dumps({"native_bf16": machine().native_bf16, **loaded.runs()}))
"""


@kernels_on
@pytest.mark.slow
@pytest.mark.parametrize("cap", ["avx2", "avx512_vnni"])
def test_the_default_takes_the_fast_path_on_a_cpu_without_bf16(cap):
    """An AVX2-only EPYC, an Ice Lake Xeon: no native bf16, and the shipped file still runs at its bits in bf16, its
    layers in one C++ call (built for that ISA level), as on a CPU with bf16. Slow: every library is built for the
    capped level first (~1 min on 2 cores); the rule itself is tested in the main suite above."""
    if not set(ISA_CAPS[cap]) <= set(machine().isa):
        pytest.skip(f"this CPU has no {cap}")
    done = subprocess.run([sys.executable, "-c", CAPPED_DEFAULT], env={**os.environ, **isa_cap_environ(cap)},
                          capture_output=True, text=True, timeout=300, check=True,
                          cwd=Path(__file__).resolve().parents[2])
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert not seen["native_bf16"] and seen["kernels"] == cap
    assert (seen["quantization"], seen["dtype"], seen["step"]) == ("gguf", "bfloat16", FusedLoop.name), seen
