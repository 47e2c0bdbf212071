"""The kernels room: our C++ kernels (csrc/), how they are built and loaded, and a checked Python face for each.

    csrc/kvs_abi.h      every entry point and struct, declared once (abi.py reads it; the sources include it)
    isa.py              the one choice of ISA level for every library
    build.py            compile and load; the one policy for a library that cannot be had
    paged.py, norm_act.py, lora.py, gguf.py, layers.py    each library's entry points with their checks
    memory.py           packed weights on transparent huge pages

`face(PagedDecode)` (or NormAct, LoRAApply, GGUFMatmul, DecoderLayers) answers a library's Python face at this
machine's level (or a given one, for tests that compare levels), or None where the kernels are off
(`build.off_reason`); a build that fails is an error.
The rooms above (formats, network, adapters) call these and never ctypes. `python -m kvstrata.model.kernels`
builds every library for this machine and says where each is.
"""

from __future__ import annotations

from functools import cache
from typing import TypeVar

from kvstrata.model.kernels import isa
from kvstrata.model.kernels.build import KernelBuildError, library, off_reason
from kvstrata.model.kernels.gguf import GGUFMatmul
from kvstrata.model.kernels.isa import Level, level
from kvstrata.model.kernels.layers import DecoderLayers
from kvstrata.model.kernels.lora import LoRAApply
from kvstrata.model.kernels.norm_act import NormAct
from kvstrata.model.kernels.paged import PagedDecode

__all__ = ["DecoderLayers", "GGUFMatmul", "KernelBuildError", "Level", "LoRAApply", "NormAct", "PagedDecode", "face",
           "isa", "level", "off_reason"]

T = TypeVar("T")

# Bumped whenever a change to a library moves any bit of its results: the model fingerprint carries them
# (kvstrata.model.fingerprint), so an engine never loads KV that another revision computed.
PAGED_REVISION = 3            # 3: a sliding layer's prefill rows in the kernel (float64 SDPA before, for exact sums)
NORM_ACT_REVISION = 2         # 2: Gemma's norms (a float32 1 + w) in the kernel, not in torch
GGUF_REVISION = 2             # 2: BF16 matrices at their bits


LIBRARIES: dict[type, str] = {PagedDecode: "paged_attention", NormAct: "norm_act", LoRAApply: "lora",
                              GGUFMatmul: "gguf_matmul", DecoderLayers: "decoder_layers"}


@cache
def face(kind: type[T], at: Level | None = None) -> T | None:
    """The Python face of a library (`kind`: PagedDecode, NormAct, LoRAApply, GGUFMatmul or DecoderLayers) at this
    machine's ISA level or `at`, or None where the kernels are off (`off_reason`); a build that fails raises."""
    lib = library(LIBRARIES[kind], at)
    return None if lib is None else kind(lib)
