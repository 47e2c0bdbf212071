"""Turn a loaded float32 `LlamaModel` into its int8 form (`--quantization int8`), at load time.

    load_or_quantize_int8(model, tokenizer, int8_cache_path(cache_root, fingerprint, weight_bits()))

1. Calibrate: one forward over a short fixed text records, per projection, the largest |x| of
   each input channel.
2. Smooth (SmoothQuant, Xiao et al. 2022): a few input channels carry activations 100x larger
   than the rest, and one int8 scale per token spends its range on them. Per channel j,
   s_j = max|x_j| ** alpha / max|w_:,j| ** (1 - alpha) (`SMOOTHING_ALPHA`, 0.4-0.6 by projection
   and weight bits); the projection's weight columns are multiplied by s and
   its input divided by s, which is folded, exactly, into whatever produced the input:
       qkv, gate_up  <- the RMSNorm weight before them        (input_norm, post_norm)
       head          <- the final RMSNorm weight
       down          <- the rows of `up` (down's input is silu(gate) * up, linear in up)
       o             <- the rows of V (o's input is softmax(qk) @ V, linear in V); with GQA one
                        V channel feeds several heads, so s is shared across each group.
   The float model computes the same function after smoothing (checked: identical perplexity);
   only the int8 rounding sees the difference.
3. Quantize every projection and the LM head to int8 rows (`Int8Rows`: 8 bits, or 7 on a CPU
   without VNNI, `kvstrata.model.int8`), and drop their float weights (the token embeddings stay
   float32 for the lookup).
4. Install them through the int8 kernel chosen for this CPU (`kvstrata.model.int8_choice`).

Smoothing is what keeps int8 close to fp32: on SmolLM2 it took the perplexity cost from +5.0% to
+1.6% (benchmarks/data/gpl-3.0.txt; the figures, and how the alphas were chosen:
docs/design/model.md). `benchmarks/quant_accuracy.py` measures perplexity and greedy agreement.

Doing all this takes seconds (the calibration forward and reductions over every weight), too slow
for every start, so the result is cached once per model:
`<cache root>/models/int8-<model fingerprint>-v<INT8_FORMAT_VERSION>-w<bits>.safetensors` (int8
rows, scales, smoothed norms; 140 MB), written under a temporary name and renamed into place. A
warm start loads the float model as usual and then swaps in the cached state.

The V rows are smoothed too, so an int8 engine's KV differs from an fp32 engine's: the loader puts
the quantization, and the kernel with its weight bits, into the model fingerprint, and no cached
block crosses between them.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from kvstrata.model.arch import ModelArch
from kvstrata.model.int8 import INT8_KERNELS, Int8Rows, weight_bits
from kvstrata.model.int8_choice import Int8Choice, cached_or_chosen, candidates, perplexity
from kvstrata.model.linear import DenseLinear, Projection
from kvstrata.model.llama import LlamaModel

logger = logging.getLogger(__name__)

# By weight bits (`kvstrata.model.int8.weight_bits`), then projection. The down projection's input
# (silu(gate) * up) has the worst outliers: with 8-bit weights it smooths harder, with 7-bit ones
# less; each alpha is the one of least perplexity over the kernels (the sweep: docs/design/model.md).
SMOOTHING_ALPHA = {
    8: {"qkv": 0.5, "o": 0.5, "gate_up": 0.5, "down": 0.6, "head": 0.5},
    7: {"qkv": 0.5, "o": 0.5, "gate_up": 0.5, "down": 0.45, "head": 0.5},
}
INT8_FORMAT_VERSION = 3        # bump when the calibration text, alpha or the layout below changes
_PROJECTIONS = ("qkv", "o", "gate_up", "down")

# A fixed, varied text (prose, a list, code, numbers, a chat turn), written for this purpose.
CALIBRATION_MESSAGES = [
    {"role": "user", "content": (
        "Can you explain how a city decides where to build a new bridge? Please cover traffic, "
        "cost, the river, and what people who live nearby might say. Also write a short Python "
        "function that sums the prices in a list, and tell me what 17 times 23 is.")},
    {"role": "assistant", "content": (
        "Planners start with traffic counts: how many cars, buses, bicycles and people on foot "
        "cross the river each day, and where they come from and go to. A bridge that joins two "
        "busy roads can cut a twenty-minute detour to three minutes, while one in the wrong place "
        "stands half empty.\n\n"
        "1. Cost. Engineers compare a few designs (beam, arch, cable-stayed, suspension) and "
        "price each one, including the foundations, which can cost more than the deck itself.\n"
        "2. The river. Boats need clearance, floods need room, and fish need the banks left "
        "alone, so surveys of the water, the soil and the wildlife come early.\n"
        "3. Neighbours. Public meetings collect worries about noise, views, property values and "
        "years of construction; the final plan often moves a ramp or adds a footpath because of "
        "them.\n\n"
        "Here is the function:\n\n"
        "```python\n"
        "def total_price(prices: list[float]) -> float:\n"
        "    \"\"\"Return the sum of all prices.\"\"\"\n"
        "    return sum(prices)\n"
        "```\n\n"
        "For example, total_price([2.50, 4.75, 10]) returns 17.25. And 17 x 23 = 391.")},
]


def calibration_ids(tokenizer, arch: ModelArch, length: int = 320) -> list[int]:
    """Token ids to calibrate on: the fixed conversation above, through the chat template when the
    tokenizer has one; seeded random ids for a model without a tokenizer (test models). At most
    the model's context."""
    length = min(length, arch.max_position_embeddings)
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, arch.vocab_size, (length,), generator=gen).tolist()
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(CALIBRATION_MESSAGES, tokenize=False)
    else:
        text = "\n\n".join(m["content"] for m in CALIBRATION_MESSAGES)
    return tokenizer(text, add_special_tokens=False)["input_ids"][:arch.max_position_embeddings]


@dataclass
class _ChannelMax:
    """Wraps a projection during calibration; records max |x| per input channel."""

    inner: DenseLinear
    amax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        seen = x.abs().amax(dim=0)                                    # (in,)
        self.amax = seen if self.amax is None else torch.maximum(self.amax, seen)
        return self.inner(x)


def input_maxima(model: LlamaModel, token_ids: list[int]) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """max |x| per input channel of every projection (per layer) and of the head, over one pass."""
    recorders = []
    for layer in model.layers:
        layer.projections = {name: _ChannelMax(proj) for name, proj in layer.projections.items()}
        recorders.append(layer.projections)
    head = model.head = _ChannelMax(model.head)
    model.prefill_alone(token_ids)
    for layer, recs in zip(model.layers, recorders):
        layer.projections = {name: rec.inner for name, rec in recs.items()}
    model.head = head.inner
    return [{name: rec.amax for name, rec in recs.items()} for recs in recorders], head.amax


def _smoothing(x_max: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """s (in,): divides the input, multiplies the weight columns."""
    return (x_max.clamp_min(1e-5) ** alpha) / (w.abs().amax(dim=0).clamp_min(1e-5) ** (1 - alpha))


@dataclass
class Int8Weights:
    """Every projection's int8 rows, layer by layer, and the head's (the smoothed norms live in the model)."""

    layers: list[dict[str, Int8Rows]]
    head: Int8Rows

    def in_call_order(self) -> list[Int8Rows]:
        return [rows for layer in self.layers for rows in layer.values()] + [self.head]


@torch.no_grad()
def quantize_int8(model: LlamaModel, token_ids: list[int], bits: int) -> Int8Weights:
    """Calibrate and smooth `model` in place, and return its projections quantized to `bits`-bit
    rows (see the module docstring); `install` then puts them in the model."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        raise ValueError("quantization int8 runs on CPU with float32 activations; got device "
                         f"{model.device}, dtype {str(model.dtype).removeprefix('torch.')}")
    assert token_ids, "calibration needs at least one token"
    start = time.perf_counter()
    smooth(model, *input_maxima(model, token_ids), SMOOTHING_ALPHA[bits])
    weights = Int8Weights([{name: Int8Rows.from_float(p.weight, p.bias, bits) for name, p in layer.projections.items()}
                           for layer in model.layers], Int8Rows.from_float(model.head.weight, None, bits))
    logger.info("quantized to int8 (%d calibration tokens) in %.2fs", len(token_ids), time.perf_counter() - start)
    return weights


def install(model: LlamaModel, weights: Int8Weights, projections: list[Projection]) -> None:
    """Make `projections` (one per `weights.in_call_order()` entry) the model's, and drop its float
    weights (a tied head shares the embeddings, which stay float for the lookup)."""
    it = iter(projections)
    for layer, rows in zip(model.layers, weights.layers):
        layer.projections = {name: next(it) for name in rows}
        layer.qkv = layer.o = layer.gate_up = layer.down = layer.qkv_bias = layer.o_bias = None
    model.head = next(it)
    model.lm_head = None
    assert next(it, None) is None, "one projection per int8 row set"


@torch.no_grad()
def smooth(model: LlamaModel, maxima: list[dict[str, torch.Tensor]], head_max: torch.Tensor,
           alpha: dict[str, float]) -> None:
    """SmoothQuant's rescaling of a float model, in place; the function it computes is unchanged.
    `maxima[i][name]` is max |x| per input channel of layer i's projection `name`; `alpha` by projection."""
    a = model.arch
    v_rows = slice(a.q_size + a.kv_size, a.q_size + 2 * a.kv_size)
    group = a.num_heads // a.num_kv_heads
    for layer, x_max in zip(model.layers, maxima):
        s = _smoothing(x_max["qkv"], layer.qkv, alpha["qkv"])
        layer.qkv.mul_(s)
        layer.input_norm.div_(s)
        s = _smoothing(x_max["gate_up"], layer.gate_up, alpha["gate_up"])
        layer.gate_up.mul_(s)
        layer.post_norm.div_(s)
        s = _smoothing(x_max["down"], layer.down, alpha["down"])
        layer.down.mul_(s)
        layer.gate_up[a.intermediate_size:].div_(s[:, None])
        s = _smoothing(x_max["o"], layer.o, alpha["o"]).view(a.num_kv_heads, group, a.head_dim).amax(dim=1)  # (KVH, D)
        layer.o.mul_(s.repeat_interleave(group, dim=0).reshape(-1))
        layer.qkv[v_rows].div_(s.reshape(-1, 1))
        if layer.qkv_bias is not None:
            layer.qkv_bias[v_rows].div_(s.reshape(-1))
    s = _smoothing(head_max, model.head.weight, alpha["head"])
    model.norm.div_(s)
    model.head = DenseLinear(model.head.weight * s, None)    # a copy: a tied head is the embeddings


def int8_cache_path(cache_root: Path, fingerprint: str, bits: int) -> Path:
    return cache_root / "models" / f"int8-{fingerprint}-v{INT8_FORMAT_VERSION}-w{bits}.safetensors"


def load_or_quantize_int8(model: LlamaModel, tokenizer, path: Path, traceable: bool = False) -> Int8Choice:
    """Make `model` (just loaded in float32) int8: from the state cached at `path`, or by
    `quantize_int8` and then writing that state to `path` for the next start; through the kernel
    chosen for this CPU (one dynamo traces, if `traceable` and the CPU has one), which is returned.
    Its attention then sums in float64 (see "Exact attention" in kvstrata.model.attention): int8
    activations would turn the float32 attention's path-dependent last bits into different greedy
    tokens."""
    model.attn.compute_dtype = torch.float64
    token_ids = calibration_ids(tokenizer, model.arch)
    if path.is_file():
        weights = _apply_int8_state(model, safetensors.torch.load_file(path))
    else:
        weights = quantize_int8(model, token_ids, weight_bits())
        _save_int8_state(model, weights, path)

    def perplexity_with(projections: list[Projection]) -> float:
        install(model, weights, projections)
        return perplexity(model.prefill_alone(token_ids), token_ids)

    choice = cached_or_chosen(weights.in_call_order(), perplexity_with, path, candidates(traceable))
    install(model, weights, [INT8_KERNELS[choice.kernel](rows) for rows in weights.in_call_order()])
    return choice


def _save_int8_state(model: LlamaModel, weights: Int8Weights, path: Path) -> None:
    """What quantization changed (int8 rows and scales of every projection, the smoothed norms),
    written under a temporary name and renamed: readers see a whole file or none."""
    state = {"norm": model.norm, "head.weight": weights.head.weight, "head.scale": weights.head.scale}
    for i, (layer, rows) in enumerate(zip(model.layers, weights.layers)):
        state[f"layers.{i}.input_norm"] = layer.input_norm
        state[f"layers.{i}.post_norm"] = layer.post_norm
        for name, r in rows.items():
            state[f"layers.{i}.{name}.weight"] = r.weight                    # (out, in) int8
            state[f"layers.{i}.{name}.scale"] = r.scale
            if r.bias is not None:
                state[f"layers.{i}.{name}.bias"] = r.bias
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        safetensors.torch.save_file({k: v.detach().contiguous() for k, v in state.items()}, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


@torch.no_grad()
def _apply_int8_state(model: LlamaModel, state: dict[str, torch.Tensor]) -> Int8Weights:
    """The smoothed norms into the model; the int8 rows returned."""
    def rows(prefix: str) -> Int8Rows:
        return Int8Rows(state[f"{prefix}.weight"], state[f"{prefix}.scale"], state.get(f"{prefix}.bias"))

    model.norm.copy_(state["norm"])
    for i, layer in enumerate(model.layers):
        layer.input_norm.copy_(state[f"layers.{i}.input_norm"])
        layer.post_norm.copy_(state[f"layers.{i}.post_norm"])
    return Int8Weights([{name: rows(f"layers.{i}.{name}") for name in _PROJECTIONS} for i in range(len(model.layers))],
                       rows("head"))
