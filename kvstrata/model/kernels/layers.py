"""`kvs_decoder_layers` (csrc/decoder_layers.cpp): a step's decoder layers in one C++ call that calls the other
libraries' entry points by their addresses. Its structs are the header's (`abi.structs`), so the Python side
cannot drift from the C one; kvstrata.model.network.fused fills them for a model and a step."""

from __future__ import annotations

import ctypes

from kvstrata.model.kernels.abi import Library, structs
from kvstrata.model.kernels.build import load
from kvstrata.model.kernels.isa import Level

KvsKernels, KvsProjection, KvsLayer, KvsStep = (structs()[name] for name in ("KvsKernels", "KvsProjection",
                                                                             "KvsLayer", "KvsStep"))


# The library holding each entry point `KvsKernels` names.
CALLEES = {"rms_norm": "norm_act", "silu_mul": "norm_act", "rope_store": "norm_act", "gguf_matmul": "gguf_matmul",
           "paged_decode": "paged_attention", "paged_rows": "paged_attention"}


class DecoderLayers:
    def __init__(self, lib: Library) -> None:
        """The other libraries it calls are loaded at its own ISA level."""
        self.lib = lib
        self.kernels = KvsKernels(**{field: load(CALLEES[field], Level(lib.level)).address(f"kvs_{field}")
                                     for field, _ in KvsKernels._fields_})

    def __call__(self, layers: ctypes.Array, step: KvsStep, h: int) -> None:
        """Every layer of `layers` (KvsLayer, their caches set) over the step, the residual stream at address h."""
        self.lib.kvs_decoder_layers(ctypes.byref(self.kernels), layers, len(layers), ctypes.byref(step), h)
