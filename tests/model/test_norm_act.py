"""Our bf16 RMSNorm and SiLU-and-multiply kernels (kvstrata/model/kernels/csrc/norm_act.cpp): what torch's ops
compute, rounded where they round, at every ISA level this CPU runs, a row's result independent of its batch, and
used by a bf16 model on the CPU except where exactness or --compile keeps torch's ops."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kvstrata.core.config import ModelConfig
from kvstrata.model import kernels
from kvstrata.model.loader import load_model
from kvstrata.model.network.decoder import DecoderModel
from kvstrata.model.network.layer import rms_norm
from tests.model.model_helpers import kernels_on

pytestmark = kernels_on


@pytest.fixture(scope="module", params=kernels.isa.levels_here(), ids=lambda level: level.label)
def fused(request) -> kernels.NormAct:
    """The kernels built for each ISA level this CPU can run."""
    return kernels.face(kernels.NormAct, request.param)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart two bf16 tensors of finite values are (same sign assumed where nonzero)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)          # no kernel: transformers' ops in bf16


@pytest.mark.parametrize("rows, width", [(1, 576), (5, 2048), (300, 576)])
def test_rms_norm_is_torchs_to_an_ulp(fused, rows, width):
    torch.manual_seed(rows)
    x = (torch.randn(rows, width) * 3).bfloat16()
    weight = (torch.randn(width) * 0.5 + 1).bfloat16()
    ours, theirs = fused.rms_norm(x, weight, 1e-5), torch_norm(x, weight, 1e-5)
    apart = ulps_apart(ours, theirs)
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 1e-3, (int(apart.max()), int((apart > 0).sum()))


@pytest.mark.parametrize("rows, width", [(1, 640), (7, 256), (300, 640)])
def test_gemmas_norm_with_its_float32_weight_is_torchs_to_an_ulp(fused, rows, width):
    """Gemma's 1 + w in float32 (scaled in float32, rounded once), over rows of a fused projection's view (a
    head's vectors, `stride` apart): torch's path to an ulp, and each row independent of its batch."""
    torch.manual_seed(rows)
    qkv = (torch.randn(rows, 3 * width) * 3).bfloat16()
    x = qkv[:, width:2 * width]                                   # rows `3 * width` apart, as a head of k
    weight = torch.randn(width) * 0.5 + 1
    ours, theirs = fused.rms_norm(x, weight, 1e-6), torch_norm(x, weight, 1e-6)
    apart = ulps_apart(ours, theirs)
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 1e-2, (int(apart.max()), int((apart > 0).sum()))
    assert torch.equal(ours[-1], fused.rms_norm(x[-1:].contiguous(), weight, 1e-6)[0])


@pytest.mark.parametrize("rows, width", [(1, 1536), (5, 8192), (300, 1536)])
def test_silu_mul_is_torchs_to_an_ulp(fused, rows, width):
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * width) * 4).bfloat16()
    ours = fused.silu_mul(gate_up)
    theirs = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    assert ours.shape == theirs.shape
    apart = ulps_apart(ours, theirs)
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 1e-3, (int(apart.max()), int((apart > 0).sum()))


def test_a_rows_result_is_independent_of_its_batch(fused):
    """Big batches run on several threads, a lone row on one: the same bits either way."""
    torch.manual_seed(0)
    x = torch.randn(400, 576).bfloat16()
    weight = torch.randn(576).bfloat16()
    gate_up = torch.randn(400, 3072).bfloat16()
    batched, act = fused.rms_norm(x, weight, 1e-6), fused.silu_mul(gate_up)
    for row in (0, 123, 399):
        assert torch.equal(batched[row], fused.rms_norm(x[row:row + 1].clone(), weight, 1e-6)[0])
        assert torch.equal(act[row], fused.silu_mul(gate_up[row:row + 1].clone())[0])


def test_extreme_values(fused):
    """A zero row normalizes to zeros (eps keeps it finite), a NaN stays NaN, huge gates saturate as torch's."""
    weight = torch.ones(32, dtype=torch.bfloat16)
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[1, 3] = float("nan")
    out = fused.rms_norm(x, weight, 1e-6)
    assert torch.equal(out[0], torch.zeros(32, dtype=torch.bfloat16)) and bool(out[1].isnan().all())
    gate = torch.tensor([[-1e4, -100.0, -1.0, 0.0, 1.0, 100.0, 1e4] + [0.5] * 9], dtype=torch.bfloat16)
    gate_up = torch.cat([gate, torch.ones_like(gate)], dim=1)
    assert torch.equal(fused.silu_mul(gate_up), F.silu(gate) * 1)


def test_a_bf16_model_uses_them_except_exact_or_compiled():
    """The default bf16 model on the CPU takes the kernels (its fingerprint says so: its KV's last bits
    are theirs); float32 and --batch-invariant keep torch's ops (so does --compile: the loader does not ask);
    logits stay within bf16's noise of the ops' and greedy tokens equal."""
    def load(**options):
        return load_model(ModelConfig(device="cpu", quantization="none", **options))   # the float path under test

    plain, fused = load(dtype="bfloat16"), kernels.face(kernels.NormAct)
    assert plain.model.norm_act is fused and all(layer.norm_act is fused for layer in plain.model.layers)
    assert load(dtype="float32").model.norm_act is None
    exact = load(dtype="bfloat16", batch_invariant=True)
    assert exact.model.norm_act is None and exact.fingerprint != plain.fingerprint
    ids = plain.tokenizer.encode("The capital of France is a city that")
    with_kernels = plain.model.prefill_alone(ids)
    ops = DecoderModel(plain.model.parts, dataclasses.replace(plain.model.kernels, norm_act=None, layers=None))
    with_ops = ops.prefill_alone(ids)
    assert torch.equal(with_kernels.argmax(-1), with_ops.argmax(-1))
    assert float((with_kernels - with_ops).abs().max()) < 0.25
