"""Step time and transfer time: what the simulator charges for a batch and for moving KV.

    step_seconds = overhead_s + max(compute . x, memory . x)
    x = (1, prefill_tokens, decode_seqs, kv_tokens_read, attention_pairs, masked_pairs, prefill_chunks,
         decode_groups, decode_pairs, decode_segments, lone_decode_pairs, prefix_pairs)   (BatchShape)

Two sources of coefficients, and every profile says which in `source`:
- *calibrated*: a non-negative least-squares fit of the real engine's step times over a grid of
  batch shapes on this machine (`kvstrata calibrate`, with `fit` here); all terms in `compute`,
  `memory` empty.
- *roofline*: derived from a hardware description and the model's size, for machines we cannot
  run (`kvstrata.sim.roofline`); a step costs the slower of compute and memory.

Moving KV costs `latency + bytes / bandwidth` on a `Link`: device <-> host copies on `host_link`,
store I/O on `store_link`; a block's bytes come from `kv_bytes_per_token`. Encoding a block's store
record (before a write) and decoding one (after a load) run in the engine's step loop and cost
`record_link` and `decode_link` each (checksums and copies; None: free, as in profiles made before
they were measured; a profile without `decode_link` decodes at `record_link`).

A calibrated profile names what it was fitted on (`fitted_on`: the batch grid, and any trace slices
replayed), so a validation can refuse to call a slice it was fitted on a validation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvstrata.core.machine import machine as current_machine
from kvstrata.sim.batch_shape import BatchShape, LayerMix, layer_mix

logger = logging.getLogger(__name__)

FEATURES = ("step", "prefill_tokens", "decode_seqs", "kv_tokens_read", "attention_pairs", "masked_pairs",
            "prefill_chunks", "decode_groups", "decode_pairs", "decode_segments", "lone_decode_pairs",
            "prefix_pairs")


@dataclass(frozen=True)
class Link:
    """A path KV travels: a fixed latency per operation, then bytes at a bandwidth."""

    latency_s: float
    bandwidth: float              # bytes per second

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class CostModel:
    source: str                                  # how the numbers were obtained, for every report
    kv_bytes_per_token: int
    host_link: Link
    store_link: Link
    compute: tuple[float, ...]                   # seconds per unit of each of FEATURES
    memory: tuple[float, ...] = (0.0,) * len(FEATURES)
    overhead_s: float = 0.0
    device_cache_tokens: int | None = None       # what the device holds beside the weights, when known
    record_link: Link | None = None              # encode one block's store record, in the step
    decode_link: Link | None = None              # decode one (None: as record_link): it checks and copies
                                                 # more than an encode (docs/design/simulator.md)
    fitted_on: tuple[dict, ...] = ()             # what a calibrated profile was fitted to (see calibrate)
    decode_in_place: bool = False                # the engine fitted on read blocks in place (decodes, prefill chunks)
    machine: dict | None = None                  # a calibrated profile's CPU (kvstrata.core.machine), engine dtype
                                                 # and model (none: SmolLM2, which profiles fitted before naming it)
    layer_windows: tuple[int | None, ...] = ()   # the model's sliding windows by layer (None: global; none given:
                                                 # every layer global): its attention terms and KV groups

    def __post_init__(self) -> None:
        if len(self.compute) != len(FEATURES) or len(self.memory) != len(FEATURES):
            raise ValueError(f"a cost model has one coefficient per feature: {', '.join(FEATURES)}")
        if min(self.compute + self.memory) < 0:
            raise ValueError("cost model coefficients must not be negative")

    def step_seconds(self, shape: BatchShape) -> float:
        """Unrolled: the simulator asks once per step, millions of times per trace."""
        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11 = self.compute
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11 = self.memory
        p, d, kv, pairs, masked, chunks, groups, dpairs, segments, lone, prefix = shape
        return self.overhead_s + max(
            c0 + c1 * p + c2 * d + c3 * kv + c4 * pairs + c5 * masked + c6 * chunks + c7 * groups + c8 * dpairs
            + c9 * segments + c10 * lone + c11 * prefix,
            m0 + m1 * p + m2 * d + m3 * kv + m4 * pairs + m5 * masked + m6 * chunks + m7 * groups + m8 * dpairs
            + m9 * segments + m10 * lone + m11 * prefix)

    @property
    def mix(self) -> LayerMix:
        """Its model's layers by window, as BatchShape weighs a step's attention terms."""
        return layer_mix(self.layer_windows)

    def block_bytes(self, block_size: int, pages: int = 1) -> int:
        """A block's bytes, or with KV groups a page's: one of a block's `pages` groups of layers."""
        return self.kv_bytes_per_token * block_size // pages

    def record_seconds(self, block_size: int, decode: bool = False, pages: int = 1) -> float:
        """Engine-thread time to encode (or decode) one block's store record (a page's, with KV groups)."""
        link = self.decode_link if decode and self.decode_link is not None else self.record_link
        return 0.0 if link is None else link.seconds(self.block_bytes(block_size, pages))

    # ---- files ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        data = asdict(self)
        data["compute"] = dict(zip(FEATURES, self.compute))
        data["memory"] = dict(zip(FEATURES, self.memory))
        data["fitted_on"] = list(self.fitted_on)
        return data

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        unknown = set(data.get("compute", {})) | set(data.get("memory", {}))
        if unknown - set(FEATURES):
            raise ValueError(f"unknown cost model features: {', '.join(sorted(unknown - set(FEATURES)))}")
        return cls(source=data["source"], kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                   host_link=Link(**data["host_link"]), store_link=Link(**data["store_link"]),
                   compute=tuple(float(data["compute"].get(f, 0.0)) for f in FEATURES),
                   memory=tuple(float(data.get("memory", {}).get(f, 0.0)) for f in FEATURES),
                   overhead_s=float(data.get("overhead_s", 0.0)),
                   device_cache_tokens=data.get("device_cache_tokens"),
                   record_link=Link(**data["record_link"]) if data.get("record_link") else None,
                   decode_link=Link(**data["decode_link"]) if data.get("decode_link") else None,
                   fitted_on=tuple(data.get("fitted_on", ())),
                   decode_in_place=bool(data.get("decode_in_place", False)), machine=data.get("machine"),
                   layer_windows=tuple(data.get("layer_windows", ())))

    def other_machine(self) -> str | None:
        """Why this calibrated profile does not time steps on this machine, or None where it does
        (roofline profiles describe hardware by name and are never checked)."""
        if self.source.startswith("roofline"):
            return None
        here = current_machine()
        if self.machine is None:
            return (f"this profile does not say which CPU it was calibrated on ({self.source}); this machine is "
                    f"{here.kind}")
        if self.machine.get("kind") != here.kind:
            return (f"this profile was calibrated on {self.machine.get('kind')} in {self.machine.get('dtype')}; "
                    f"this machine is {here.kind}: its step times do not apply here")
        return None

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read a cost profile from {path}: {exc!r}") from exc


# ---- calibration: fitting measured steps --------------------------------------------------------
def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative term and refit until none is.

    Enough for a handful of physically non-negative terms (a full NNLS solver is not worth a dependency).
    """
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        fit = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        if fit.min() >= 0:
            coef[active] = fit
            break
        del active[int(np.argmin(fit))]
    return coef


def fit(shapes: Sequence[BatchShape], seconds: Sequence[float], **profile) -> CostModel:
    """Fit `compute` to measured step times, minimizing relative error (steps span 1 ms to seconds)."""
    if len(shapes) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps to fit a cost model")
    x = np.array([s.features() for s in shapes], dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    coef = nonnegative_lstsq(x / scale / y[:, None], np.ones_like(y)) / scale
    return CostModel(compute=tuple(float(c) for c in coef), **profile)


def relative_errors(model: CostModel, shapes: Sequence[BatchShape], seconds: Sequence[float]) -> np.ndarray:
    predicted = np.array([model.step_seconds(s) for s in shapes])
    return predicted / np.asarray(seconds) - 1.0
