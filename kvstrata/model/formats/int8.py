"""The `int8` weight format (`--quantization int8`, CPU only): SmoothQuant's int8 rows (`smoothquant.py`) through
the int8 kernel measured fastest on this CPU (`int8_choice.py`; the kernels: `int8_kernels.py`).

The model is made from float32 weights: calibration runs the float model once, smoothing folds its scales into
the norms (which the decoder then uses), and the int8 rows and smoothed norms are cached by the float model's
identity. The kernel chosen, with its weight bits, joins the fingerprint: two kernels round differently.
"""

from __future__ import annotations

import torch

from kvstrata.core.config import cache_dir
from kvstrata.model.arch import ModelArch
from kvstrata.model.arch import tensors as names
from kvstrata.model.formats.base import (
    Checkpoint,
    PackContext,
    Packed,
    Target,
    WeightFootprint,
    WeightFormat,
    weight_counts,
)
from kvstrata.model.formats.dense import DenseLinear
from kvstrata.model.formats.int8_choice import Int8Choice, cached_or_chosen, candidates, perplexity
from kvstrata.model.formats.int8_kernels import INT8_KERNELS, weight_bits
from kvstrata.model.formats.smoothquant import (
    FloatModel,
    calibration_ids,
    int8_cache_path,
    load_int8_state,
    quantize_int8,
    save_int8_state,
)


class Int8Format(WeightFormat):
    name = "int8"
    cpu_only = True
    exact_attention = True        # int8 activations: see WeightFormat.exact_attention

    def __init__(self) -> None:
        self.choice: Int8Choice | None = None       # the kernel `pack` chose, with the figures it chose by

    def unavailable(self, target: Target) -> str | None:
        if not target.arch.plain_layers:
            return (f"--quantization int8 smooths Llama's layers into their norms; a {target.arch.family} model's "
                    "layers are not those: use --quantization none (or its GGUF at its bits)")
        if target.dtype == "bfloat16":
            return "--quantization int8 runs with float32 activations; drop --dtype bfloat16"
        return None

    def auto_dtype(self, target: Target) -> torch.dtype:
        """float32: the int8 kernels take and return float32 activations."""
        return torch.float32

    def footprint(self, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> WeightFootprint:
        """The float32 model, a smoothed float32 copy of the head and the int8 rows beside them at the peak; once
        loaded, the rows (a byte a weight; the head quantized, tied or not) and the float32 embeddings."""
        parameters, linear, embed, _ = weight_counts(arch)
        resident = embed * 4 + linear + embed
        return WeightFootprint(parameters * 4 + embed * 4 + linear + embed, resident, parameters,
                               "float32 weights before int8")

    def identity(self) -> dict:
        assert self.choice is not None, "the int8 kernel is chosen by pack()"
        return {"int8_kernel": self.choice.kernel_id}

    def describe(self) -> str:
        return "int8" if self.choice is None else f"int8 ({self.choice.summary()})"

    def pack(self, checkpoint: Checkpoint, ctx: PackContext) -> Packed:
        """The cached int8 state when there is one, else calibrate, smooth and quantize (then cache); then this
        CPU's kernel over the rows (one dynamo traces under --compile, where the CPU has one)."""
        a = ctx.arch
        assert ctx.dtype == torch.float32 and ctx.device.type == "cpu", "int8 is made from float32 on the CPU"
        biases = {"qkv": a.attention_bias, "o": a.attention_out_bias, "gate_up": False, "down": False}
        model = FloatModel([{p: DenseLinear(checkpoint.matrix(i, p), checkpoint.bias(i, p, biases[p]))
                             for p in names.PROJECTIONS} for i in range(a.num_layers)],
                           DenseLinear(ctx.embeddings if a.tie_word_embeddings else checkpoint.take(names.LM_HEAD), None))
        token_ids = calibration_ids(ctx.tokenizer, a)
        path = int8_cache_path(cache_dir(), ctx.identity, weight_bits())
        if path.is_file():
            weights = load_int8_state(ctx.norms, path, a.num_layers)
        else:
            weights = quantize_int8(model, ctx.norms, a, lambda packed: ctx.run(packed, token_ids), weight_bits())
            save_int8_state(ctx.norms, weights, path)
        del model                                   # the float matrices: the rows replace them

        def perplexity_with(projections: list) -> float:
            return perplexity(ctx.run(_packed(projections, a.num_layers), token_ids), token_ids)

        self.choice = cached_or_chosen(weights.in_call_order(), perplexity_with, path, candidates(ctx.traceable))
        return _packed([INT8_KERNELS[self.choice.kernel](rows) for rows in weights.in_call_order()], a.num_layers)


def _packed(projections: list, num_layers: int) -> Packed:
    """Projections in `Int8Weights.in_call_order` as a model's."""
    per = len(names.PROJECTIONS)
    assert len(projections) == num_layers * per + 1, "one projection per int8 row set"
    return Packed([dict(zip(names.PROJECTIONS, projections[i * per:(i + 1) * per])) for i in range(num_layers)],
                  projections[-1])
