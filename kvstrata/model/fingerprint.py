"""The model fingerprint: what keys the cache. Block hashes and store records both carry it, so engines whose
KV would differ in any bit never exchange blocks (docs/design/tiers-and-stores.md, "The record format").

It is made in one place from what decides a model's K/V: the weights' content ids, the description, the weight
format (with what it adds: the GGUF kernel's revision, the int8 kernel chosen), the KV cache's format (a record
of another format is another key: a miss, never a record read as the wrong format nor deleted as bad), exact
sums (`--batch-invariant` on 16 bits), our norm kernel, and exact attention's path (the paged kernel with its
revision, or float64 in torch). A key is present only where it matters, so adding one leaves other fingerprints
as they were.
"""

from __future__ import annotations

import hashlib
import json
import torch

from kvstrata.model import kernels as kernel_room
from kvstrata.model.arch import ModelArch
from kvstrata.model.formats import WeightFormat
from kvstrata.model.network.decoder import Kernels

# The paged kernel reads any power-of-two block size the same way, so 16 stands for all of them.
ANY_BLOCK_SIZE = 16


def identity(weight_ids: list[tuple[str, str]], arch: ModelArch, fmt: WeightFormat, kernels: Kernels,
             exact_norms: bool, exact_attention: bool, dtype: torch.dtype, device: torch.device) -> dict:
    """What the fingerprint hashes, before the format adds what its `pack` chose (`WeightFormat.identity`)."""
    found: dict = {"weights": weight_ids, "arch": arch.identity(), "quantization": fmt.name,
                   "kv_cache_dtype": str(dtype).removeprefix("torch.")}     # the cache holds K/V in the model's dtype
    if exact_norms:
        found["exact_sums"] = True             # a batch-invariant engine must not take another's last bits
    if kernels.norm_act is not None:
        found["norm_act"] = kernel_room.NORM_ACT_REVISION
    group = arch.num_heads // arch.num_kv_heads
    if exact_attention and kernels.paged is not None and kernels.paged.supports(dtype, group, arch.head_dim,
                                                                                ANY_BLOCK_SIZE, device):
        # exact attention in the kernel gives other last bits than in float64, and the baseline x86-64 build
        # (no FMA) others than the rest
        fma = "" if kernels.paged.lib.level >= kernel_room.Level.AVX2 else "-no-fma"
        found["attention"] = f"paged-kernel-{kernel_room.PAGED_REVISION}{fma}"
    return found


def digest(found: dict) -> str:
    """The fingerprint: sha256 hex of an identity."""
    return hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()
