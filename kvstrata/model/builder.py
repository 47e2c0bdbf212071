"""The one builder: a model assembled from its description (kvstrata.model.arch), its weight format
(kvstrata.model.formats), its KV format and the kernels enabled (kvstrata.model.kernels), once.

    checkpoint -> embeddings, norms         taken by their names (kvstrata.model.arch.tensors)
               -> the format's projections  `WeightFormat.pack`
    + the kernels this model can use        norms/activation and RoPE (bf16 on the CPU), the paged kernel,
                                            the fused layers (every projection at a GGUF's bits)
    = DecoderModel(ModelParts, Kernels)     which picks its step loop once; nothing changes it afterwards

The fingerprint (kvstrata.model.fingerprint) is made from the same choices.
"""

from __future__ import annotations

import logging

import torch

from kvstrata.model import fingerprint, kernels
from kvstrata.model.arch import ModelArch
from kvstrata.model.arch import tensors as names
from kvstrata.model.formats import Resolved
from kvstrata.model.formats.base import Checkpoint, Norms, PackContext, Packed
from kvstrata.model.network.compiled import warm_up
from kvstrata.model.network.decoder import DecoderModel, Kernels, ModelParts
from kvstrata.model.sources import Opened, Source

logger = logging.getLogger(__name__)


def enabled_kernels(arch: ModelArch, dtype: torch.dtype, device: torch.device, exact_norms: bool,
                    traceable: bool) -> Kernels:
    """Our kernels for a model of `arch` in `dtype` on `device`: the paged kernel on the CPU (each step checks it
    can read the cache's shapes); norms, activation and RoPE for a bf16 model they take, but not under
    `--compile` (dynamo cannot trace a ctypes call) nor with exact sums (float64 statistics stay torch's, so an
    exact engine's bits are what they were); the fused layers' library with them."""
    if device.type != "cpu" or kernels.off_reason() is not None:
        return Kernels(compiled=traceable)
    norm_act = kernels.face(kernels.NormAct)
    if traceable or exact_norms or not norm_act.takes(dtype, device, arch.hidden_size, arch.intermediate_size):
        norm_act = None
    return Kernels(kernels.face(kernels.PagedDecode), norm_act,
                   None if norm_act is None else kernels.face(kernels.DecoderLayers),
                   traceable)


def take_norms(checkpoint: Checkpoint, arch: ModelArch) -> Norms:
    """Every norm weight of the checkpoint. A Gemma norm's w scales by 1 + w in float32 (transformers'
    Gemma3RMSNorm), so it is kept as that float32 sum: `rms_norm` then scales in float32 and rounds once."""
    def take(name: str) -> torch.Tensor:
        w = checkpoint.take(name)
        return 1.0 + w.float() if arch.norm_style == "gemma" else w

    layers = [{role: take(name) for role, name in names.norms(i, arch).items()} for i in range(arch.num_layers)]
    return Norms([n.pop("input_norm") for n in layers], [n.pop("post_norm") for n in layers],
                 take(names.FINAL_NORM), layers)


def build(resolved: Resolved, arch: ModelArch, source: Source, opened: Opened, batch_invariant: bool,
          traceable: bool) -> tuple[DecoderModel, str]:
    """The model and its fingerprint, from the `opened` files of `source`. `batch_invariant`: `--batch-invariant`
    (exact sums on 16 bits); `traceable`: `--compile`."""
    fmt, dtype, device = resolved.format, resolved.dtype, resolved.device
    exact_norms = batch_invariant and dtype.itemsize < 4
    exact_attention = exact_norms or fmt.exact_attention
    checkpoint = Checkpoint(opened.tensors, dtype, device)
    embeddings = checkpoint.take(names.EMBEDDINGS)
    norms = take_norms(checkpoint, arch)
    if arch.tie_word_embeddings:
        checkpoint.skip([names.LM_HEAD])                # tied checkpoints may still store a copy
    enabled = enabled_kernels(arch, dtype, device, exact_norms, traceable)
    found = fingerprint.identity(source.weight_ids, arch, fmt, enabled, exact_norms, exact_attention, dtype, device)

    def parts(packed: Packed) -> ModelParts:
        return ModelParts(arch, dtype, device, embeddings, norms, packed, exact_attention, exact_norms)

    def run(packed: Packed, token_ids: list[int]) -> torch.Tensor:
        """Logits of `token_ids` through a scratch model of these projections (int8's calibration and choice)."""
        return DecoderModel(parts(packed), Kernels(paged=enabled.paged)).prefill_alone(token_ids)

    packed = fmt.pack(checkpoint, PackContext(arch, dtype, device, embeddings, norms, exact_attention, traceable,
                                              source.folder, fingerprint.digest(found), opened.tokenizer, run))
    leftover = checkpoint.leftover()
    if leftover:
        raise ValueError(f"the checkpoint has {len(leftover)} tensors kvstrata does not use, e.g. {leftover[:3]}")
    model = DecoderModel(parts(packed), enabled)
    if traceable:
        warm_up(model)
    return model, fingerprint.digest({**found, **fmt.identity()})


