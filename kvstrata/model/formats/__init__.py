"""The weight formats room: how a checkpoint's matrices are held and multiplied, one module a format.

    base.py         the seam: `WeightFormat` (what a format is asked), `Projection` (what the decoder calls),
                    `Checkpoint` / `PackContext` (what `pack` is given), `WeightFootprint`
    dense.py        `none`: the dtype's own floats (oneDNN-packed on CPU)
    gguf.py         `gguf`: a GGUF file's own blocks through our kernel; the types are the kernel header's table
    int8.py         `int8`: SmoothQuant rows (smoothquant.py) through the fastest int8 kernel here
                    (int8_choice.py; the kernels: int8_kernels.py)
    onednn.py       oneDNN's kernel caches, bounded

`resolve` is the one place `--quantization`, `--dtype` and `--device` become a format, a dtype and a device.
A new format is a module here, a `WeightFormat` subclass and its line in `FORMATS` (docs/design/model.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.core.config import ModelConfig
from kvstrata.model.arch import ModelArch
from kvstrata.model.formats.base import Projection, Target, WeightFootprint, WeightFormat
from kvstrata.model.formats.dense import DenseFormat
from kvstrata.model.formats.gguf import GGUFFormat
from kvstrata.model.formats.int8 import Int8Format

__all__ = ["FORMATS", "Projection", "Resolved", "WeightFootprint", "WeightFormat", "resolve", "resolve_device"]

FORMATS: dict[str, type[WeightFormat]] = {"none": DenseFormat, "int8": Int8Format, "gguf": GGUFFormat}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Resolved:
    """What the flags came to: the format (never `auto`), the activations' dtype and the device."""

    format: WeightFormat
    dtype: torch.dtype
    device: torch.device
    target: Target
    why: str                        # how `auto` came to the format, for the start-up log ("" when it was asked)


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu. CUDA comes back with its index ('cuda:0'), so it
    compares equal to the device of the tensors made on it."""
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def resolve(config: ModelConfig, arch: ModelArch, gguf_types: dict[str, str] | None) -> Resolved:
    """The format, dtype and device `config` asks for, for a model of `arch` whose matrices are in `gguf_types`
    (None: no GGUF's); ValueError, saying why, for a combination that cannot run.

    `--quantization auto`: an explicit `--dtype float32` gets float32 math (`none`); otherwise a GGUF file on
    the CPU runs at its own bits (`gguf`: a decode step reads a quarter to a half of bf16's bytes, and the kernel
    keeps up with oneDNN's bf16 GEMM at a batch too: docs/design/model.md) wherever that can run; else `none`.
    `--dtype auto`: the format's choice (`WeightFormat.auto_dtype`)."""
    if config.dtype not in ("auto", *DTYPES):
        raise ValueError(f"dtype must be auto, float32 or bfloat16, not {config.dtype!r}")
    on_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    cpu = torch.device("cpu")
    target = Target(arch, cpu if not on_cuda else resolve_device(config.device), config.dtype, gguf_types,
                    config.load_format == "dummy", config.compile)
    name, why = config.quantization, ""
    if name == "auto":
        name, why = _auto(target, on_cuda, config.dtype)
    fmt = FORMATS[name]()
    device = resolve_device("cpu" if fmt.cpu_only and config.device == "auto" else config.device)
    if fmt.cpu_only and device.type != "cpu":
        raise ValueError(f"--quantization {name} runs on CPU only, not on {device}")
    target = Target(arch, device, config.dtype, gguf_types, target.dummy, target.compile)
    reason = fmt.unavailable(target)
    if reason is not None:
        raise ValueError(reason)
    dtype = DTYPES[config.dtype] if config.dtype != "auto" else fmt.auto_dtype(target)
    return Resolved(fmt, dtype, device, target, why)


def _auto(target: Target, on_cuda: bool, dtype: str) -> tuple[str, str]:
    """What `--quantization auto` comes to, and why."""
    if target.gguf_types is None or target.dummy:
        return "none", ""
    if on_cuda:
        return "none", "auto: a GGUF on CUDA is widened (kvstrata's GGUF kernel is a CPU kernel)"
    if dtype == "float32":
        return "none", "auto: --dtype float32 asks for float32 math, so the GGUF is widened"
    reason = GGUFFormat().unavailable(target)
    if reason is not None:
        return "none", f"auto: the GGUF is widened ({reason})"
    return "gguf", "auto: the GGUF file at its own bits"
