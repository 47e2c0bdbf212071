"""Which int8 kernel a model runs on this CPU: measured once per CPU kind and model, then cached.

The fastest int8 kernel differs by ISA far more than any tuning recovers: on a Zen 3 EPYC (AVX2,
no VNNI) `_int_mm` ran SmolLM2 at 0.36x fp32's speed at batch 1, where FBGEMM beats fp32; with VNNI
the order changes again (figures per machine: BENCHMARKS.md, docs/design/model.md). So at first
load on a CPU kind, `choose_kernel` builds
every candidate kernel of `kvstrata.model.formats.int8_kernels` over the model's own int8 rows (one whose library
cannot pack or run here is dropped, with a warning), and for each:
1. times one pass over all projections and the head at 1 and 32 rows (a decode of one stream and of
   a batch), fastest of `REPEATS`, beside the same pass in float32 (the dequantized rows packed as
   the fp32 model packs them), all weights read from memory as in a real step;
2. scores perplexity on the calibration text against that float32 reference, a guard against a
   kernel that computes garbage here: one more than `MAX_PERPLEXITY_RATIO` above it is never
   chosen. (Kernels that would saturate on this ISA are not candidates at all: `available_kernels`.
   The guard cannot rank the rest: the smallest change to one projection moves an int8 model's
   perplexity more than the kernels differ, through rounding that flips downstream;
   benchmarks/quant_accuracy.py measures the chosen kernel's accuracy on a longer text.)
It takes the kernel with the smallest mean time over the two row counts. The choice and every
figure go to `<int8 state>.kernel-<hash of CPU kind, torch, candidates>.json`, so later starts read it
back; a CPU where no int8 kernel beats float32 is warned about at every start, with the figures.
`KVSTRATA_INT8_KERNEL=<name>` forces a kernel (tests, measurements), skipping the calibration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvstrata.core.machine import machine
from kvstrata.model.formats.base import Projection
from kvstrata.model.formats.dense import DenseLinear, PackedLinear, can_pack
from kvstrata.model.formats.int8_kernels import INT8_KERNELS, Int8Rows, available_kernels, weight_bits

logger = logging.getLogger(__name__)

TIMED_ROWS = (1, 32)
REPEATS = 5
MAX_PERPLEXITY_RATIO = 1.05
TRACEABLE = "int_mm"
CHOICE_VERSION = 1          # bump when the candidates or the rule change: cached choices are then remade
FLOAT = "float32"


@dataclass(frozen=True)
class KernelTrial:
    """One kernel measured on this CPU: ms per pass over every projection, by row count; perplexity."""

    kernel: str
    ms: dict[int, float]
    perplexity: float


@dataclass(frozen=True)
class Int8Choice:
    """The kernel chosen for a model on a CPU kind, with what it was chosen from."""

    kernel: str
    machine_kind: str
    torch_version: str
    trials: list[KernelTrial]            # float32 first, then every int8 kernel tried

    @property
    def kernel_id(self) -> str:
        """The kernel and the bits it multiplies here: what the model fingerprint carries, since
        two kernels round differently."""
        return f"{self.kernel}-w{weight_bits()}a8"

    def trial(self, kernel: str) -> KernelTrial:
        return next(t for t in self.trials if t.kernel == kernel)

    def speedups(self) -> dict[int, float]:
        """float32 ms / chosen kernel ms, by row count (absent when the kernel was forced)."""
        if not any(t.kernel == FLOAT for t in self.trials):
            return {}
        chosen, base = self.trial(self.kernel), self.trial(FLOAT)
        return {rows: base.ms[rows] / chosen.ms[rows] for rows in chosen.ms}

    def summary(self) -> str:
        parts = ", ".join(f"{rows} row{'s' * (rows > 1)} {s:.2f}x" for rows, s in self.speedups().items())
        return f"int8 kernel {self.kernel_id} ({parts or 'forced'} against float32)"

    def to_json(self) -> dict:
        return {"version": CHOICE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> Int8Choice:
        trials = [KernelTrial(t["kernel"], {int(r): ms for r, ms in t["ms"].items()}, t["perplexity"])
                  for t in data["trials"]]
        return cls(data["kernel"], data["machine_kind"], data["torch_version"], trials)


def choice_path(state_path: Path, kernels: list[str]) -> Path:
    key = f"{machine().kind}|{torch.__version__}|{CHOICE_VERSION}|{'+'.join(kernels)}"
    return state_path.with_name(f"{state_path.stem}.kernel-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json")


def candidates(traceable: bool) -> list[str]:
    """The kernels to choose from: `available_kernels`, or under `--compile` those dynamo traces
    (`_int_mm`; FBGEMM's and oneDNN's packed weights are opaque objects that break the graphs
    around every projection), when this CPU has one."""
    kernels = available_kernels()
    if traceable and TRACEABLE in kernels:
        return [TRACEABLE]
    if traceable:
        logger.warning("--compile with --quantization int8: %s needs VNNI, which this CPU lacks; the int8 "
                       "projections break the compiled graphs around them", TRACEABLE)
    return kernels


def cached_or_chosen(rows: list[Int8Rows], perplexity_of: Callable[[list[Projection]], float],
                     state_path: Path, kernels: list[str]) -> Int8Choice:
    """The forced kernel, else the choice cached for this CPU kind, else a new one (then cached)."""
    forced = os.environ.get("KVSTRATA_INT8_KERNEL")
    if forced:
        if forced not in available_kernels():
            raise ValueError(f"KVSTRATA_INT8_KERNEL={forced!r}: this CPU and torch have {', '.join(available_kernels())}")
        return Int8Choice(forced, machine().kind, torch.__version__, [])
    path = choice_path(state_path, kernels)
    if path.is_file():
        choice = Int8Choice.from_json(json.loads(path.read_text()))
    else:
        choice = choose_kernel(rows, perplexity_of, kernels)
        try:
            _write_atomically(path, json.dumps(choice.to_json(), indent=2) + "\n")
        except OSError as exc:                  # a full or read-only cache costs the next start a calibration
            logger.warning("could not cache the int8 kernel choice in %s (%s); the next start measures again", path, exc)
    _report(choice)
    return choice


def choose_kernel(rows: list[Int8Rows], perplexity_of: Callable[[list[Projection]], float],
                  kernels: list[str]) -> Int8Choice:
    """Measure float32 and each of `kernels` on `rows` (all projections, in call order);
    `perplexity_of(projections)` runs the model with them installed."""
    start = time.perf_counter()
    builders: dict[str, Callable[[Int8Rows], Projection]] = {FLOAT: _float_projection}
    builders.update({name: INT8_KERNELS[name] for name in kernels})
    trials = []
    for name, build in builders.items():
        try:
            projections = [build(r) for r in rows]
            trials.append(KernelTrial(name, {n: _time_pass(projections, rows, n) for n in TIMED_ROWS},
                                      perplexity_of(projections)))
        except RuntimeError as exc:             # a library that cannot pack or run on this CPU is no candidate
            if name == FLOAT:
                raise
            logger.warning("int8 kernel %s does not run here (%s); not a candidate", name, exc)
        projections = None
    base = trials[0]
    accurate = [t for t in trials[1:] if t.perplexity <= base.perplexity * MAX_PERPLEXITY_RATIO]
    if not accurate:
        raise ValueError(f"--quantization int8: no int8 kernel keeps perplexity within {MAX_PERPLEXITY_RATIO - 1:.0%} "
                         f"of float32 on this CPU; serve without --quantization ({_table(trials)})")
    best = min(accurate, key=lambda t: sum(t.ms.values()) / len(t.ms))
    choice = Int8Choice(best.kernel, machine().kind, torch.__version__, trials)
    logger.info("int8 kernels measured in %.1fs on %s: %s", time.perf_counter() - start, machine().kind,
                _table(trials))
    return choice


def _report(choice: Int8Choice) -> None:
    speedups = choice.speedups()
    slower = [rows for rows, s in speedups.items() if s < 1.0]
    if slower:
        logger.warning("--quantization int8 on this CPU (%s): %s; float32 is faster here at %s rows%s "
                       "(measured: %s)", machine().kind, choice.summary(), "/".join(map(str, slower)),
                       "; serve without --quantization for speed" if len(slower) == len(speedups) else "",
                       _table(choice.trials))
    else:
        logger.info("%s", choice.summary())


def _table(trials: list[KernelTrial]) -> str:
    return "; ".join(f"{t.kernel} " + " / ".join(f"{ms:.1f}" for ms in t.ms.values())
                     + f" ms at {'/'.join(map(str, t.ms))} rows, perplexity {t.perplexity:.3f}" for t in trials)


def _float_projection(rows: Int8Rows) -> Projection:
    """The float32 reference: the int8 rows dequantized, packed as the fp32 model's are."""
    dense = DenseLinear(rows.dequantized(), rows.bias)
    return PackedLinear.from_dense(dense) if can_pack(dense.weight) else dense


def _time_pass(projections: list[Projection], rows: list[Int8Rows], n: int) -> float:
    """ms of the fastest of REPEATS passes over every projection at n rows."""
    gen = torch.Generator().manual_seed(n)
    inputs = [torch.randn(n, r.weight.shape[1], generator=gen) for r in rows]
    best = math.inf
    with torch.inference_mode():
        for proj, x in zip(projections, inputs):        # warm every kernel's code path once
            proj(x)
        for _ in range(REPEATS):
            start = time.perf_counter()
            for proj, x in zip(projections, inputs):
                proj(x)
            best = min(best, time.perf_counter() - start)
    return round(best * 1000, 3)


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp(mean NLL) of each next token under the logits (T, vocab) of the positions before it."""
    nll = F.cross_entropy(logits[:-1].float(), torch.tensor(token_ids[1:]), reduction="mean")
    return round(math.exp(nll.item()), 4)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
