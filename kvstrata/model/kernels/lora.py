"""`kvs_lora_apply` (csrc/lora.cpp): y[rows] += (x[rows] @ A.T) @ BT per adapter group, bf16 on the CPU, all of
a projection's groups in one call. Raw pointers: kvstrata.model.adapters.lora checks what it relies on."""

from __future__ import annotations

import torch

from kvstrata.model.kernels.abi import Library


class LoRAApply:
    MAX_FUSED_RANK = 3 * 1024

    def __init__(self, lib: Library) -> None:
        self.lib = lib

    @staticmethod
    def takes(dtype: torch.dtype, device: torch.device, *widths: int) -> bool:
        return dtype == torch.bfloat16 and device.type == "cpu" and all(w % 16 == 0 for w in widths)

    def __call__(self, y: torch.Tensor, x: torch.Tensor, groups: int, offsets: int, rows: int, a: int, bt: int,
                 ranks: int) -> None:
        """y (T, out) and x (T, in) bf16 rows (unit column stride); the rest are addresses of int64 arrays:
        `offsets` (groups + 1), `rows`, and for each group its A's and BT's addresses and its rank."""
        assert y.dtype == x.dtype == torch.bfloat16 and y.stride(1) == 1 and x.stride(1) == 1
        self.lib.kvs_lora_apply(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), x.shape[1], y.shape[1], groups,
                                offsets, rows, a, bt, ranks)
