"""Rotary position embeddings in the HF "rotate half" layout, with tables computed once.

The frequencies follow transformers' formulas (plain, `linear`, `llama3`) so logits match it
bit for bit in float32; a GGUF's Llama 3 scaling comes as llama.cpp stores it, one factor per
frequency (`freq_factors`, the same frequencies to float32 rounding). Each forward looks its positions up in the tables once; every layer then
applies them with three elementwise ops.
"""

from __future__ import annotations

import math

import torch

from kvstrata.model.arch import ModelArch


def inv_frequencies(arch: ModelArch) -> torch.Tensor:
    """(head_dim / 2,) float32 inverse frequencies, scaled as the config asks."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "freq_factors":          # a GGUF's rope_freqs: each frequency divided by its own
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    low_ff = float(scaling.get("low_freq_factor", 1.0))
    high_ff = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTables:
    """cos and signed-sin tables of shape (max_positions, head_dim), in the model dtype.

    `sin_signed` is [-sin, sin], so rotate_half(x) * sin == flip_halves(x) * sin_signed and
    the rotation needs no negation at run time.
    """

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = inv_frequencies(arch)
        positions = torch.arange(arch.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]               # (P, D/2) float32
        self.cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1).to(device, dtype)         # (P, D)
        self.sin_signed = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(device, dtype)  # (P, D)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T,) positions -> cos, sin_signed of shape (T, 1, D), broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D) -> rotated copy; cos / sin_signed (T, 1, D)."""
    t, heads, dim = x.shape
    swapped = x.view(t, heads, 2, dim // 2).flip(2).view(t, heads, dim)   # (T, heads, D): [x2, x1]
    return torch.addcmul(x * cos, swapped, sin_signed)
