"""Turn a loaded float32 `LlamaModel` into its int8 form (`--quantization int8`), at load time.

    quantize_int8(model, calibration_ids)

1. Calibrate: one forward over a short fixed text records, per projection, the largest |x| of
   each input channel.
2. Smooth (SmoothQuant, Xiao et al. 2022, alpha = 0.5): a few input channels carry activations
   100x larger than the rest, and one int8 scale per token spends its range on them. Per channel
   j, s_j = sqrt(max|x_j| / max|w_:,j|); the projection's weight columns are multiplied by s and
   its input divided by s, which is folded, exactly, into whatever produced the input:
       qkv, gate_up  <- the RMSNorm weight before them        (input_norm, post_norm)
       head          <- the final RMSNorm weight
       down          <- the rows of `up` (down's input is silu(gate) * up, linear in up)
       o             <- the rows of V (o's input is softmax(qk) @ V, linear in V); with GQA one
                        V channel feeds several heads, so s is shared across each group.
   The float model computes the same function after smoothing (checked: identical perplexity);
   only the int8 rounding sees the difference.
3. Quantize every projection and the LM head to `Int8Linear`, and drop their float weights (the
   token embeddings stay float32 for the lookup).

Measured on SmolLM2-135M-Instruct (perplexity on bench/data/gpl-3.0.txt, first 2,048 tokens):
fp32 21.26, int8 without smoothing 22.31 (+5.0%), with it 21.60 (+1.6%); alpha 0.7 gave 21.71.
`bench/quant_accuracy.py` reports the figures over the whole text and greedy agreement.

Doing all this takes 6.5 s for SmolLM2 on the 2-core machine (the calibration forward and
reductions over 134M weights), too slow for every start, so the result is cached once per model:
`<cache root>/models/int8-<int8 model fingerprint>-v<INT8_FORMAT_VERSION>.safetensors` (int8 rows,
scales, smoothed norms; 140 MB), written under a temporary name and renamed into place. A warm
start loads the float model as usual and then swaps in the cached state.

The V rows are smoothed too, so an int8 engine's KV differs from an fp32 engine's: the loader puts
the quantization into the model fingerprint, and no cached block crosses between the two.
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
from kvstrata.model.int8 import Int8Linear
from kvstrata.model.linear import DenseLinear
from kvstrata.model.llama import LlamaModel

logger = logging.getLogger(__name__)

SMOOTHING_ALPHA = 0.5
INT8_FORMAT_VERSION = 1        # bump when the calibration text, alpha or the layout below changes
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


def _smoothing(x_max: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """s (in,): divides the input, multiplies the weight columns."""
    return (x_max.clamp_min(1e-5) ** SMOOTHING_ALPHA) / (w.abs().amax(dim=0).clamp_min(1e-5) ** (1 - SMOOTHING_ALPHA))


@torch.no_grad()
def quantize_int8(model: LlamaModel, token_ids: list[int]) -> None:
    """Calibrate, smooth and quantize `model` in place (see the module docstring)."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        raise ValueError("quantization int8 runs on CPU with float32 activations; got device "
                         f"{model.device}, dtype {str(model.dtype).removeprefix('torch.')}")
    assert token_ids, "calibration needs at least one token"
    start = time.perf_counter()
    smooth(model, *input_maxima(model, token_ids))
    for layer in model.layers:
        layer.projections = {name: Int8Linear.from_float(p.weight, p.bias) for name, p in layer.projections.items()}
        layer.qkv = layer.o = layer.gate_up = layer.down = layer.qkv_bias = layer.o_bias = None
    model.head = Int8Linear.from_float(model.head.weight)
    model.lm_head = None                       # a tied head shares the embeddings, which stay float
    logger.info("quantized to int8 (%d calibration tokens) in %.2fs", len(token_ids), time.perf_counter() - start)


@torch.no_grad()
def smooth(model: LlamaModel, maxima: list[dict[str, torch.Tensor]], head_max: torch.Tensor) -> None:
    """SmoothQuant's rescaling of a float model, in place; the function it computes is unchanged.
    `maxima[i][name]` is max |x| per input channel of layer i's projection `name`."""
    a = model.arch
    v_rows = slice(a.q_size + a.kv_size, a.q_size + 2 * a.kv_size)
    group = a.num_heads // a.num_kv_heads
    for layer, x_max in zip(model.layers, maxima):
        s = _smoothing(x_max["qkv"], layer.qkv)
        layer.qkv.mul_(s)
        layer.input_norm.div_(s)
        s = _smoothing(x_max["gate_up"], layer.gate_up)
        layer.gate_up.mul_(s)
        layer.post_norm.div_(s)
        s = _smoothing(x_max["down"], layer.down)
        layer.down.mul_(s)
        layer.gate_up[a.intermediate_size:].div_(s[:, None])
        s = _smoothing(x_max["o"], layer.o).view(a.num_kv_heads, group, a.head_dim).amax(dim=1)  # (KVH, D)
        layer.o.mul_(s.repeat_interleave(group, dim=0).reshape(-1))
        layer.qkv[v_rows].div_(s.reshape(-1, 1))
        if layer.qkv_bias is not None:
            layer.qkv_bias[v_rows].div_(s.reshape(-1))
    s = _smoothing(head_max, model.head.weight)
    model.norm.div_(s)
    model.head = DenseLinear(model.head.weight * s, None)    # a copy: a tied head is the embeddings


def int8_cache_path(cache_root: Path, fingerprint: str) -> Path:
    return cache_root / "models" / f"int8-{fingerprint}-v{INT8_FORMAT_VERSION}.safetensors"


def load_or_quantize_int8(model: LlamaModel, tokenizer, path: Path) -> None:
    """Make `model` (just loaded in float32) int8: from the state cached at `path`, or by
    `quantize_int8` and then writing that state to `path` for the next start. Its attention then
    sums in float64 (see "Exact attention" in kvstrata.model.attention): int8 activations would
    turn the float32 attention's path-dependent last bits into different greedy tokens."""
    model.attn.compute_dtype = torch.float64
    if path.is_file():
        _apply_int8_state(model, safetensors.torch.load_file(path))
        return
    quantize_int8(model, calibration_ids(tokenizer, model.arch))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        safetensors.torch.save_file(_int8_state(model), tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)                  # readers see a whole file or none
    finally:
        Path(tmp).unlink(missing_ok=True)


def _int8_state(model: LlamaModel) -> dict[str, torch.Tensor]:
    """What quantization changed: int8 rows and scales of every projection, the smoothed norms."""
    state = {"norm": model.norm, "head.weight": model.head.weight_t.t(), "head.scale": model.head.scale}
    for i, layer in enumerate(model.layers):
        state[f"layers.{i}.input_norm"] = layer.input_norm
        state[f"layers.{i}.post_norm"] = layer.post_norm
        for name, proj in layer.projections.items():
            state[f"layers.{i}.{name}.weight"] = proj.weight_t.t()          # (out, in) int8
            state[f"layers.{i}.{name}.scale"] = proj.scale
            if proj.bias is not None:
                state[f"layers.{i}.{name}.bias"] = proj.bias
    return {k: v.detach().contiguous() for k, v in state.items()}


@torch.no_grad()
def _apply_int8_state(model: LlamaModel, state: dict[str, torch.Tensor]) -> None:
    def int8(prefix: str) -> Int8Linear:
        return Int8Linear(state[f"{prefix}.weight"].t(), state[f"{prefix}.scale"], state.get(f"{prefix}.bias"))

    model.norm.copy_(state["norm"])
    model.head = int8("head")
    model.lm_head = None
    for i, layer in enumerate(model.layers):
        layer.input_norm.copy_(state[f"layers.{i}.input_norm"])
        layer.post_norm.copy_(state[f"layers.{i}.post_norm"])
        layer.projections = {name: int8(f"layers.{i}.{name}") for name in _PROJECTIONS}
        layer.qkv = layer.o = layer.gate_up = layer.down = layer.qkv_bias = layer.o_bias = None
