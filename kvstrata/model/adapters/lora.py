"""LoRA adapters in PEFT's format, and applying several of them to one batch.

An adapter is a folder with `adapter_config.json` and `adapter_model.safetensors` (what PEFT's
`save_pretrained` writes). Each targeted projection W (out, in) gains `scale * B @ A`, A (r, in) and
B (out, r), with `scale = lora_alpha / r` (or `/ sqrt(r)` under rsLoRA). The decoder fuses q|k|v and
gate|up into one matmul each, so the adapter's pairs are fused the same way at load: the A's stacked,
the B's block-diagonal (a missing target gets no rows), the scale folded into B:

    qkv:  A = [A_q; A_k; A_v]  (r_q + r_k + r_v, E)      B = diag(s B_q, s B_k, s B_v)  (q + 2 kv, sum r)

A step's rows are grouped by adapter (`LoRABatch`): each projection adds `(x[rows] @ A.T) @ B.T` to
its output per group, never a per-token gather of adapter weights; a step without adapters pays
nothing. A bf16 model on the CPU does all of a projection's groups in one call of our kernel
(kernels/csrc/lora.cpp, `kernels.LoRAApply`): in torch each group costs two small matmuls and an add, whose
dispatches cost more than their arithmetic on a few rows. B is kept transposed (BT, r x out), and for
the kernel a second time in tiles of 16 columns that it reads in one stream.

The adapter's `digest` is the sha256 of its two files' bytes: what salts its requests' block hashes
(kvstrata.core.hashing), so cached KV follows what was computed, never the name it was loaded under.
The files are read by files.py, which judges their sizes and the tensors' declared shapes (here,
`_check_tensors`) before it reads their data: a path a client names is never trusted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvstrata.model.adapters.files import WIDEST, AdapterError, TensorSpec, read_adapter_files
from kvstrata.model.arch import ModelArch
from kvstrata.model.arch import tensors as names
from kvstrata.model.kernels import LoRAApply, face

_TARGETS = names.MODULES           # HF module name -> (our fused projection, which part of it)
PROJECTIONS = names.PROJECTIONS    # the decoder's fused projections, in the kernel table's order
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d{1,6})\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRAPair:
    """One fused projection's low-rank update: y += (x @ a.T) @ bt."""

    a: torch.Tensor       # (r_total, in)
    bt: torch.Tensor      # (r_total, out): B transposed, the scale folded in
    bt_tiles: torch.Tensor | None = None   # the kernel's copy of bt: (out / 16, r_total, 16), tile by tile

    @classmethod
    def of(cls, a: torch.Tensor, bt: torch.Tensor) -> LoRAPair:
        """The pair, with the kernel's tiles where it can take them."""
        kernel = face(LoRAApply)
        takes = kernel is not None and kernel.takes(a.dtype, a.device, a.shape[1], bt.shape[1])
        tiles = bt.view(bt.shape[0], -1, 16).transpose(0, 1).contiguous() if takes else None
        return cls(a, bt, tiles)


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter, loaded for one model: per layer, the pairs of the projections it targets."""

    name: str
    digest: str                              # sha256 hex of the adapter's config and weights files
    rank: int                                # the largest rank of its targets
    layers: tuple[dict[str, LoRAPair], ...]  # per decoder layer: "qkv" / "o" / "gate_up" / "down" -> pair
    pointers: np.ndarray = field(init=False, repr=False, compare=False)   # `table()`, once
    kernel_takes: bool = field(init=False, repr=False, compare=False)     # whether the kernel can apply it

    def __post_init__(self) -> None:
        kernel = face(LoRAApply)
        pairs = [pair for layer in self.layers for pair in layer.values()]
        object.__setattr__(self, "pointers", self.table())
        object.__setattr__(self, "kernel_takes", kernel is not None and all(p.bt_tiles is not None for p in pairs))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for p in layer.values()
                   for t in (p.a, p.bt, p.bt_tiles) if t is not None)

    def table(self) -> np.ndarray:
        """(3, layers, 4) int64: the address of each pair's A, of its BT, and its rank (0: not targeted),
        for the kernel."""
        table = np.zeros((3, len(self.layers), len(PROJECTIONS)), dtype=np.int64)
        for i, layer in enumerate(self.layers):
            for p, name in enumerate(PROJECTIONS):
                pair = layer.get(name)
                if pair is not None and pair.bt_tiles is not None:
                    table[:, i, p] = pair.a.data_ptr(), pair.bt_tiles.data_ptr(), pair.a.shape[0]
        return table


def max_adapter_bytes(arch: ModelArch, max_rank: int) -> int:
    """The most data an adapter of this model can hold: rank `max_rank` on all seven targets of every
    layer, at the widest dtype. A weights file larger than this (its header aside) is refused unread."""
    per_rank = sum(sum(_out_sizes(arch)[fused]) + arch.projection_shapes()[fused][1] * len(_out_sizes(arch)[fused])
                   for fused in PROJECTIONS)
    return arch.num_layers * per_rank * max_rank * WIDEST


def _check_config(config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError("it is not a LoRA adapter (its peft_type)")
    unsupported = [k for k in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern") if config.get(k)]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise AdapterError(f"it uses {', '.join(unsupported)}, which kvstrata does not serve")
    if type(config.get("r")) is not int or config["r"] < 1:
        raise AdapterError("it has no positive integer rank r")
    alpha = config.get("lora_alpha", 1)
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise AdapterError("its lora_alpha is not a finite number")


def _check_tensors(arch: ModelArch, max_rank: int, specs: dict[str, TensorSpec]) -> None:
    """Each declared tensor a lora_A (r, in) or lora_B (out, r) of a target kvstrata applies, in a layer
    the model has, with 1 <= r <= max_rank: judged from the header, before any data is read."""
    if not specs:
        raise AdapterError("it holds no LoRA weights")
    outs = _out_sizes(arch)
    for key, spec in specs.items():
        match = _KEY.match(key)
        if match is None or match[3] not in _TARGETS:
            raise AdapterError("it has a tensor kvstrata cannot apply (it serves q/k/v/o_proj and gate/up/down_proj "
                               "of the decoder layers)")
        if int(match[1]) >= arch.num_layers:
            raise AdapterError(f"it has a tensor of a layer this model does not have ({arch.num_layers} layers)")
        fused, index = _TARGETS[match[3]]
        rank = (spec.shape[0] if match[4] == "A" else spec.shape[-1]) if len(spec.shape) == 2 else 0
        expected = (rank, arch.projection_shapes()[fused][1]) if match[4] == "A" else (outs[fused][index], rank)
        if spec.shape != expected or rank < 1:
            raise AdapterError(f"its {match[3]} lora_{match[4]} {spec.shape} does not fit this model")
        if rank > max_rank:
            raise AdapterError(f"it has rank {rank}, over --max-lora-rank {max_rank}")


def load_adapter(name: str, folder: str | Path, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                 max_rank: int, roots: Sequence[str] = ()) -> LoRAWeights:
    """Read, check and fuse a PEFT adapter for this model (its files beneath one of `roots`, when any; see
    files.py); AdapterError (nothing kept) if it cannot be served."""
    files = read_adapter_files(folder, roots, max_adapter_bytes(arch, max_rank),
                               lambda config, specs: (_check_config(config), _check_tensors(arch, max_rank, specs)))
    config = files.config
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in files.tensors.items():
        match = _KEY.match(key)
        parts.setdefault((int(match[1]), match[3]), {})[match[4]] = tensor
    rank = max(t.shape[0] for p in parts.values() for side, t in p.items() if side == "A")
    assert 3 * max_rank <= LoRAApply.MAX_FUSED_RANK, "the kernel's scratch row holds 3 x 1024 ranks"
    scale_of = (lambda r: config.get("lora_alpha", r) / math.sqrt(r)) if config.get("use_rslora") else \
        (lambda r: config.get("lora_alpha", r) / r)
    layers = tuple(_fused_layer(arch, {m: parts[(i, m)] for (j, m) in parts if j == i}, scale_of, dtype, device)
                   for i in range(arch.num_layers))
    return LoRAWeights(name, files.digest, rank, layers)


def _out_sizes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Each fused projection's parts: their output sizes, in order; and the input size of each."""
    return {"qkv": (arch.q_size, arch.kv_size, arch.kv_size), "o": (arch.hidden_size,),
            "gate_up": (arch.intermediate_size, arch.intermediate_size), "down": (arch.hidden_size,)}


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
            a, b = pair["A"].float(), pair["B"].float()     # their shapes fit the model (_check_tensors)
            r = a.shape[0]
            if b.shape[1] != r:
                raise AdapterError(f"{module}: its lora_A has rank {r}, its lora_B {b.shape[1]}")
            a_rows.append(a)
            b_blocks.append((index, b * scale_of(r)))
        total = sum(a.shape[0] for a in a_rows)
        b_full = torch.zeros(sum(sizes), total)
        col = 0
        for index, b in b_blocks:
            row = sum(sizes[:index])
            b_full[row:row + b.shape[0], col:col + b.shape[1]] = b
            col += b.shape[1]
        pairs[fused] = LoRAPair.of(torch.cat(a_rows).to(device, dtype).contiguous(),
                                   b_full.T.to(device, dtype).contiguous())
    return pairs


@dataclass(frozen=True)
class LoRAGroup:
    """The token rows of one step that run under one adapter: a slice where they are contiguous."""

    weights: LoRAWeights
    rows: slice | torch.Tensor


@dataclass(frozen=True)
class KernelArgs:
    """What `kvs_lora_apply` reads for a step: every group's rows, and per layer and projection each
    group's A, BT and rank (the arrays are kept here, alive, while the step runs)."""

    kernel: LoRAApply
    offsets: np.ndarray     # (groups + 1,) int64
    rows: np.ndarray        # (rows under adapters,) int64
    table: np.ndarray       # (3, layers, 4, groups) int64: A addresses, BT addresses, ranks
    bases: tuple[int, int, int] = field(init=False, repr=False)   # the three arrays' addresses, taken once

    def __post_init__(self) -> None:
        object.__setattr__(self, "bases", (self.offsets.ctypes.data, self.rows.ctypes.data, self.table.ctypes.data))

    def addresses(self, layer: int, projection: int) -> tuple[int, int, int, int, int]:
        """The addresses the kernel takes for one projection: offsets, rows, and its A, BT and rank lists."""
        offsets, rows, table = self.bases
        step = self.table.itemsize * self.table.shape[3]
        first = table + (layer * self.table.shape[2] + projection) * step
        per_kind = self.table.strides[0]
        return offsets, rows, first, first + per_kind, first + 2 * per_kind


@dataclass(frozen=True)
class LoRABatch:
    """A step's adapters and their rows (rows under none: the base model alone)."""

    groups: tuple[LoRAGroup, ...]          # those torch's ops apply
    kernel: KernelArgs | None = None       # the groups the kernel applies (bf16 on the CPU, small groups)

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (T, out) = projection(x (T, in)) plus every group's low-rank update on its rows, in place."""
        if self.kernel is not None:
            x = x if x.stride(1) == 1 else x.contiguous()
            self.kernel.kernel(y, x, len(self.kernel.offsets) - 1,
                               *self.kernel.addresses(layer, PROJECTIONS.index(projection)))
        for group in self.groups:
            pair = group.weights.layers[layer].get(projection)
            if pair is None:
                continue
            rows = group.rows
            if isinstance(rows, slice):
                y[rows].addmm_(x[rows] @ pair.a.T, pair.bt)
            else:
                y.index_add_(0, rows, (x[rows] @ pair.a.T) @ pair.bt)
        return y


def group_rows(adapters: list[LoRAWeights | None], lengths: list[int], device: torch.device,
               use_kernel: bool = True) -> LoRABatch | None:
    """A step's LoRABatch from each sequence's adapter (None: base) and its token count, in batch order;
    None when no sequence has an adapter. Where the kernel takes an adapter, every row of it goes to the kernel,
    prefill chunks too: a row's bits then depend on that row alone, so a token's KV is the same whether its
    prompt was prefilled in one chunk, in several, or recomputed after a handoff (torch's matmuls are faster
    from ~128 rows, 155 against 299 us at 512, but round by the run's length). Elsewhere each adapter is one
    group in torch. `use_kernel=False` keeps torch's ops (tests compare)."""
    runs: dict[str, tuple[LoRAWeights, list[range]]] = {}     # adapter -> its runs of consecutive rows
    start = 0
    for weights, n in zip(adapters, lengths):
        if weights is not None:
            own = runs.setdefault(weights.digest, (weights, []))[1]
            if own and own[-1].stop == start:
                own[-1] = range(own[-1].start, start + n)
            else:
                own.append(range(start, start + n))
        start += n
    if not runs:
        return None
    groups, small = [], []
    for weights, spans in runs.values():
        if use_kernel and weights.kernel_takes:
            small.append((weights, [i for r in spans for i in r]))
        elif len(spans) == 1:
            groups.append(LoRAGroup(weights, slice(spans[0].start, spans[0].stop)))
        else:
            groups.append(LoRAGroup(weights, torch.tensor([i for r in spans for i in r], dtype=torch.int64,
                                                          device=device)))
    return LoRABatch(tuple(groups), _kernel_args(small) if small else None)


def _kernel_args(groups: list[tuple[LoRAWeights, list[int]]]) -> KernelArgs:
    """The kernel's arrays for these groups."""
    offsets = np.cumsum([0] + [len(ids) for _, ids in groups], dtype=np.int64)
    rows = np.fromiter((i for _, ids in groups for i in ids), dtype=np.int64, count=int(offsets[-1]))
    table = np.ascontiguousarray(np.stack([weights.pointers for weights, _ in groups], axis=-1))
    return KernelArgs(face(LoRAApply), offsets, rows, table)
