"""SmoothQuant for the `int8` format (kvstrata.model.formats.int8): a float32 checkpoint's projections made
int8 rows, at load time, and the state cached.

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
   without VNNI, `kvstrata.model.formats.int8_kernels`), and drop their float weights (the token embeddings
   stay float32 for the lookup).
4. The format installs them through the int8 kernel chosen for this CPU (`kvstrata.model.formats.int8_choice`).

Smoothing is what keeps int8 close to fp32: on SmolLM2 it took the perplexity cost from +5.0% to
+1.6% (benchmarks/data/gpl-3.0.txt; the figures, and how the alphas were chosen:
docs/design/model.md). `benchmarks/quant_accuracy.py` measures perplexity and greedy agreement.

Doing all this takes seconds (the calibration forward and reductions over every weight), too slow
for every start, so the result is cached once per model:
`<cache root>/models/int8-<model fingerprint>-v<INT8_FORMAT_VERSION>-w<bits>.safetensors` (int8
rows, scales, smoothed norms; 140 MB), written under a temporary name and renamed into place. A
warm start takes the float matrices as usual and then swaps in the cached state.

The V rows are smoothed too, so an int8 engine's KV differs from an fp32 engine's: the loader puts
the quantization, and the kernel with its weight bits, into the model fingerprint, and no cached
block crosses between them.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from kvstrata.model.arch import ModelArch
from kvstrata.model.arch import tensors as names
from kvstrata.model.formats.base import Norms, Packed, Projection
from kvstrata.model.formats.dense import DenseLinear
from kvstrata.model.formats.int8_kernels import Int8Rows

logger = logging.getLogger(__name__)

# By weight bits (`kvstrata.model.formats.int8_kernels.weight_bits`), then projection. The down projection's input
# (silu(gate) * up) has the worst outliers: with 8-bit weights it smooths harder, with 7-bit ones
# less; each alpha is the one of least perplexity over the kernels (the sweep: docs/design/model.md).
SMOOTHING_ALPHA = {
    8: {"qkv": 0.5, "o": 0.5, "gate_up": 0.5, "down": 0.6, "head": 0.5},
    7: {"qkv": 0.5, "o": 0.5, "gate_up": 0.5, "down": 0.45, "head": 0.5},
}
INT8_FORMAT_VERSION = 3        # bump when the calibration text, alpha or the layout below changes

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
class _ChannelMax(Projection):
    """Wraps a projection during calibration; records max |x| per input channel."""

    inner: DenseLinear
    amax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        seen = x.abs().amax(dim=0)                                    # (in,)
        self.amax = seen if self.amax is None else torch.maximum(self.amax, seen)
        return self.inner(x)


FloatModel = Packed[DenseLinear]    # the float32 projections int8 is made from; smoothing rescales them in place
Int8Weights = Packed[Int8Rows]      # every projection's int8 rows (the smoothed norms live in `Norms`)


def input_maxima(model: FloatModel, run: Callable[[Packed], object]) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """max |x| per input channel of every projection (per layer) and of the head, over one `run` of the model."""
    recorders = [{name: _ChannelMax(proj) for name, proj in layer.items()} for layer in model.layers]
    head = _ChannelMax(model.head)
    run(Packed(recorders, head))
    return [{name: rec.amax for name, rec in recs.items()} for recs in recorders], head.amax


def _smoothing(x_max: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """s (in,): divides the input, multiplies the weight columns."""
    return (x_max.clamp_min(1e-5) ** alpha) / (w.abs().amax(dim=0).clamp_min(1e-5) ** (1 - alpha))


@torch.no_grad()
def quantize_int8(model: FloatModel, norms: Norms, arch: ModelArch, run: Callable[[Packed], object],
                  bits: int) -> Int8Weights:
    """Calibrate and smooth `model` and `norms` in place (`run` feeds the calibration text through the model with
    the projections it is given), and return the projections quantized to `bits`-bit rows (module docstring)."""
    start = time.perf_counter()
    smooth(model, norms, arch, *input_maxima(model, run), SMOOTHING_ALPHA[bits])
    weights = Int8Weights([{name: Int8Rows.from_float(p.weight, p.bias, bits) for name, p in layer.items()}
                           for layer in model.layers], Int8Rows.from_float(model.head.weight, None, bits))
    logger.info("quantized to int8 in %.2fs", time.perf_counter() - start)
    return weights


@torch.no_grad()
def smooth(model: FloatModel, norms: Norms, arch: ModelArch, maxima: list[dict[str, torch.Tensor]],
           head_max: torch.Tensor, alpha: dict[str, float]) -> None:
    """SmoothQuant's rescaling of a float model, in place; the function it computes is unchanged.
    `maxima[i][name]` is max |x| per input channel of layer i's projection `name`; `alpha` by projection."""
    a = arch
    v_rows = slice(a.q_size + a.kv_size, a.q_size + 2 * a.kv_size)
    group = a.num_heads // a.num_kv_heads
    for i, (layer, x_max) in enumerate(zip(model.layers, maxima)):
        qkv, o, gate_up, down = (layer[p].weight for p in names.PROJECTIONS)
        s = _smoothing(x_max["qkv"], qkv, alpha["qkv"])
        qkv.mul_(s)
        norms.input[i].div_(s)
        s = _smoothing(x_max["gate_up"], gate_up, alpha["gate_up"])
        gate_up.mul_(s)
        norms.post[i].div_(s)
        s = _smoothing(x_max["down"], down, alpha["down"])
        down.mul_(s)
        gate_up[a.intermediate_size:].div_(s[:, None])
        s = _smoothing(x_max["o"], o, alpha["o"]).view(a.num_kv_heads, group, a.head_dim).amax(dim=1)  # (KVH, D)
        o.mul_(s.repeat_interleave(group, dim=0).reshape(-1))
        qkv[v_rows].div_(s.reshape(-1, 1))
        if layer["qkv"].bias is not None:
            layer["qkv"].bias[v_rows].div_(s.reshape(-1))
    s = _smoothing(head_max, model.head.weight, alpha["head"])
    norms.final.div_(s)
    model.head = DenseLinear(model.head.weight * s, None)    # a copy: a tied head is the embeddings


def int8_cache_path(cache_root: Path, fingerprint: str, bits: int) -> Path:
    return cache_root / "models" / f"int8-{fingerprint}-v{INT8_FORMAT_VERSION}-w{bits}.safetensors"


def save_int8_state(norms: Norms, weights: Int8Weights, path: Path) -> None:
    """What quantization changed (int8 rows and scales of every projection, the smoothed norms),
    written under a temporary name and renamed: readers see a whole file or none."""
    state = {"norm": norms.final, "head.weight": weights.head.weight, "head.scale": weights.head.scale}
    for i, rows in enumerate(weights.layers):
        state[f"layers.{i}.input_norm"] = norms.input[i]
        state[f"layers.{i}.post_norm"] = norms.post[i]
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
def load_int8_state(norms: Norms, path: Path, num_layers: int) -> Int8Weights:
    """The smoothed norms copied into `norms`; the int8 rows returned."""
    state = safetensors.torch.load_file(path)

    def rows(prefix: str) -> Int8Rows:
        return Int8Rows(state[f"{prefix}.weight"], state[f"{prefix}.scale"], state.get(f"{prefix}.bias"))

    norms.final.copy_(state["norm"])
    for i in range(num_layers):
        norms.input[i].copy_(state[f"layers.{i}.input_norm"])
        norms.post[i].copy_(state[f"layers.{i}.post_norm"])
    return Int8Weights([{name: rows(f"layers.{i}.{name}") for name in names.PROJECTIONS} for i in range(num_layers)],
                       rows("head"))
