"""What a model's weights take in memory, known from its shape before anything is allocated.

An 8B model in bfloat16 is 16 GB, and its int8 form is made from a float32 copy of 32 GB: on a 24 GiB
machine the OOM killer would end such a load halfway, minutes in. So the engine asks this module
first (`kvstrata.worker.memory_check`) and refuses, with these figures and a way out, what cannot fit.

Counted, by the code paths of `kvstrata.model.loader`:
- float weights (`--quantization none`): every parameter in the dtype; on CPU a tied LM head is
  packed for oneDNN as a copy of the embeddings (`LlamaModel.pack_projections`), and packing a
  projection briefly holds it twice.
- int8 (`kvstrata.model.quantize`): the model loads in float32, calibration keeps a smoothed float32
  copy of the head, and the int8 rows (one byte a weight) are made beside the float ones: at the peak
  five bytes a projection weight. Once installed, the rows and the float32 embeddings stay.
- a GGUF's own bits (`kvstrata.model.gguf_bits`): the model loads in the dtype, then each projection
  and the head are swapped for their 4-bit terms (two int32 copies of a Q8_0 matrix while packing);
  once loaded, at most 1.25 bytes a weight (Q8_0: two terms of half a byte, a bf16 scale and zero per
  32) and the embeddings in the dtype.
Activations, the tokenizer and Python are not counted here; the check leaves headroom for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.model.arch import ModelArch


@dataclass(frozen=True)
class WeightFootprint:
    """Bytes of weights at the worst moment of loading, and once loaded."""

    peak: int
    resident: int
    parameters: int
    peak_reason: str                # what the peak is, in a few words, for the error a user reads


def weight_footprint(arch: ModelArch, dtype: torch.dtype, quantization: str, device: torch.device) -> WeightFootprint:
    """The weights of `arch` loaded as `kvstrata.model.loader` loads them (see the module docstring)."""
    e, i = arch.hidden_size, arch.intermediate_size
    per_layer = e * (arch.q_size + 2 * arch.kv_size) + arch.q_size * e + 3 * e * i      # qkv, o, gate|up, down
    linear = arch.num_layers * per_layer
    embed = arch.vocab_size * e
    head = 0 if arch.tie_word_embeddings else embed
    parameters = linear + embed + head
    largest = max(per_layer, embed)
    if quantization == "int8":
        head_rows = embed                                   # the LM head is quantized, tied or not
        float_model = parameters * 4
        peak = float_model + embed * 4 + linear + head_rows
        return WeightFootprint(peak, embed * 4 + linear + head_rows, parameters,
                               "float32 weights before int8")
    size = torch.empty((), dtype=dtype).element_size()
    if quantization == "gguf":
        head_rows = embed
        return WeightFootprint(parameters * size + largest * 8, embed * size + (linear + head_rows) * 5 // 4,
                               parameters, f"{str(dtype).removeprefix('torch.')} weights before packing GGUF blocks")
    packed_head = embed * size if arch.tie_word_embeddings and device.type == "cpu" else 0
    resident = parameters * size + packed_head
    return WeightFootprint(resident + largest * 4, resident, parameters,
                           f"{str(dtype).removeprefix('torch.')} weights")
