"""LoRA adapters in PEFT's format, and applying several of them to one batch.

An adapter is a folder with `adapter_config.json` and `adapter_model.safetensors` (what PEFT's
`save_pretrained` writes). Each targeted projection W (out, in) gains `scale * B @ A`, A (r, in) and
B (out, r), with `scale = lora_alpha / r` (or `/ sqrt(r)` under rsLoRA). The decoder fuses q|k|v and
gate|up into one matmul each, so the adapter's pairs are fused the same way at load: the A's stacked,
the B's block-diagonal (a missing target gets no rows), the scale folded into B:

    qkv:  A = [A_q; A_k; A_v]  (r_q + r_k + r_v, E)      B = diag(s B_q, s B_k, s B_v)  (q + 2 kv, sum r)

A step's rows are grouped by adapter (`LoRABatch`): each projection adds `(x[rows] @ A.T) @ B.T` to
its output per group, one low-rank pair of matmuls per adapter, never a per-token gather of adapter
weights; a step without adapters pays nothing.

The adapter's `digest` is the sha256 of its two files' bytes: what salts its requests' block hashes
(kvstrata.core.hashing), so cached KV follows what was computed, never the name it was loaded under.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstrata.model.arch import ModelArch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# HF module name -> (our fused projection, which part of it)
_TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
            "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served here; the message names the problem (a 4xx for a client)."""


@dataclass(frozen=True)
class LoRAPair:
    """One fused projection's low-rank update: y += (x @ a.T) @ b.T."""

    a: torch.Tensor       # (r_total, in)
    b: torch.Tensor       # (out, r_total), the scale folded in


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter, loaded for one model: per layer, the pairs of the projections it targets."""

    name: str
    digest: str                              # sha256 hex of the adapter's config and weights files
    rank: int                                # the largest rank of its targets
    layers: tuple[dict[str, LoRAPair], ...]  # per decoder layer: "qkv" / "o" / "gate_up" / "down" -> pair

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for p in layer.values() for t in (p.a, p.b))


def adapter_digest(folder: Path) -> str:
    """sha256 over the config's and the weights' bytes: equal digests, equal adapters."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        data = (folder / name).read_bytes()
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise AdapterError(f"no adapter folder at {folder}")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise AdapterError(f"the adapter folder {folder} has no {name} (PEFT's save_pretrained writes both)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{folder / CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder} is not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    unsupported = [k for k in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern") if config.get(k)]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise AdapterError(f"the adapter at {folder} uses {', '.join(unsupported)}, which kvstrata does not serve")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise AdapterError(f"the adapter at {folder} has no positive integer rank r")
    return config


def load_adapter(name: str, folder: str | Path, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                 max_rank: int) -> LoRAWeights:
    """Read, check and fuse a PEFT adapter for this model; AdapterError (nothing kept) if it cannot be served."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    config = _read_config(folder)
    digest = adapter_digest(folder)
    try:
        tensors = load_file(folder / WEIGHTS_FILE)
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"cannot read {folder / WEIGHTS_FILE}: {exc}") from exc
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match[3] not in _TARGETS:
            raise AdapterError(f"the adapter at {folder} has a tensor kvstrata cannot apply: {key!r} (it serves "
                               f"q/k/v/o_proj and gate/up/down_proj of the decoder layers)")
        layer = int(match[1])
        if layer >= arch.num_layers:
            raise AdapterError(f"{key!r}: the model has {arch.num_layers} layers")
        parts.setdefault((layer, match[3]), {})[match[4]] = tensor
    if not parts:
        raise AdapterError(f"the adapter at {folder} holds no LoRA weights")
    rank = max(t.shape[0] for p in parts.values() for side, t in p.items() if side == "A")
    if rank > max_rank:
        raise AdapterError(f"the adapter at {folder} has rank {rank}, over --max-lora-rank {max_rank}")
    scale_of = (lambda r: config.get("lora_alpha", r) / math.sqrt(r)) if config.get("use_rslora") else \
        (lambda r: config.get("lora_alpha", r) / r)
    layers = tuple(_fused_layer(arch, {m: parts[(i, m)] for (j, m) in parts if j == i}, scale_of, dtype, device)
                   for i in range(arch.num_layers))
    return LoRAWeights(name, digest, rank, layers)


def _out_sizes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Each fused projection's parts: their output sizes, in order; and the input size of each."""
    return {"qkv": (arch.q_size, arch.kv_size, arch.kv_size), "o": (arch.hidden_size,),
            "gate_up": (arch.intermediate_size, arch.intermediate_size), "down": (arch.hidden_size,)}


def _in_size(arch: ModelArch, fused: str) -> int:
    return {"qkv": arch.hidden_size, "o": arch.q_size, "gate_up": arch.hidden_size,
            "down": arch.intermediate_size}[fused]


def _fused_layer(arch: ModelArch, modules: dict[str, dict[str, torch.Tensor]], scale_of, dtype: torch.dtype,
                 device: torch.device) -> dict[str, LoRAPair]:
    """One layer's pairs: each fused projection's targeted parts stacked (A) and block-diagonal (B)."""
    pairs = {}
    outs = _out_sizes(arch)
    for fused, sizes in outs.items():
        targeted = [(m, index) for m, (f, index) in _TARGETS.items() if f == fused and m in modules]
        if not targeted:
            continue
        a_rows, b_blocks = [], []
        for module, index in targeted:
            pair = modules[module]
            if set(pair) != {"A", "B"}:
                raise AdapterError(f"{module}: the adapter has lora_{'A' if 'A' not in pair else 'B'} missing")
            a, b = pair["A"].float(), pair["B"].float()
            r = a.shape[0]
            if a.shape != (r, _in_size(arch, fused)) or b.shape != (sizes[index], r):
                raise AdapterError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                                   f"this model (expected ({r}, {_in_size(arch, fused)}) and ({sizes[index]}, {r}))")
            a_rows.append(a)
            b_blocks.append((index, b * scale_of(r)))
        total = sum(a.shape[0] for a in a_rows)
        b_full = torch.zeros(sum(sizes), total)
        col = 0
        for index, b in b_blocks:
            row = sum(sizes[:index])
            b_full[row:row + b.shape[0], col:col + b.shape[1]] = b
            col += b.shape[1]
        pairs[fused] = LoRAPair(torch.cat(a_rows).to(device, dtype).contiguous(), b_full.to(device, dtype).contiguous())
    return pairs


@dataclass(frozen=True)
class LoRAGroup:
    """The token rows of one step that run under one adapter: a slice where they are contiguous."""

    weights: LoRAWeights
    rows: slice | torch.Tensor


@dataclass(frozen=True)
class LoRABatch:
    """A step's adapters and their rows (rows under none: the base model alone)."""

    groups: tuple[LoRAGroup, ...]

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (T, out) = projection(x (T, in)) plus every group's low-rank update on its rows, in place."""
        for group in self.groups:
            pair = group.weights.layers[layer].get(projection)
            if pair is None:
                continue
            rows = group.rows
            if isinstance(rows, slice):
                y[rows].addmm_(x[rows] @ pair.a.T, pair.b.T)
            else:
                y.index_add_(0, rows, (x[rows] @ pair.a.T) @ pair.b.T)
        return y


def group_rows(adapters: list[LoRAWeights | None], lengths: list[int], device: torch.device) -> LoRABatch | None:
    """A step's LoRABatch from each sequence's adapter (None: base) and its token count, in batch order;
    None when no sequence has an adapter."""
    rows: dict[str, tuple[LoRAWeights, list[int]]] = {}
    start = 0
    for weights, n in zip(adapters, lengths):
        if weights is not None:
            rows.setdefault(weights.digest, (weights, []))[1].extend(range(start, start + n))
        start += n
    if not rows:
        return None
    groups = []
    for weights, ids in rows.values():
        contiguous = ids[-1] - ids[0] + 1 == len(ids)
        groups.append(LoRAGroup(weights, slice(ids[0], ids[-1] + 1) if contiguous
                                else torch.tensor(ids, dtype=torch.int64, device=device)))
    return LoRABatch(tuple(groups))
