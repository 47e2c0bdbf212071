"""The paged-attention kernel (csrc/paged_attention.cpp), its arguments checked: it reads raw pointers.

`kvs_paged_decode` attends a few query rows per sequence (decodes) and `kvs_paged_rows` rows by block table
(prefill chunks, and speculative verifications, which it reads in place as decodes); a row gets the same bits
from either, whatever else is in its batch. kvstrata.model.network.attention plans the calls.
"""

from __future__ import annotations

import torch

from kvstrata.model.kernels.abi import Library


class PagedDecode:
    def __init__(self, lib: Library) -> None:
        self.lib = lib
        self.max_group = lib.kvs_max_group()
        self.lanes = lib.kvs_lanes()

    def supports(self, kv_dtype: torch.dtype, group: int, head_dim: int, block_size: int,
                 device: torch.device) -> bool:
        """Whether a cache of these shapes can be read by the kernel (else: the torch path)."""
        return (device.type == "cpu" and kv_dtype in (torch.float32, torch.bfloat16)
                and group <= self.max_group and bool(self.lib.kvs_supports_head_dim(head_dim))
                and (block_size % self.lanes == 0 or self.lanes % block_size == 0))

    def __call__(self, q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, first: torch.Tensor,
                 lens: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Attention of q (n, KVH, G, D) float32 over keys [first, lens) of each sequence's blocks in
        kv_layer (2, KVH, N, bs, D) into out (n, KVH, G, D) and lse (n, KVH, G), both float32."""
        n = q.shape[0]
        _check(q, kv_layer, tables, out, lse)
        assert first.dtype == lens.dtype == torch.int64 and first.shape == lens.shape == (n,) and tables.shape[0] == n
        assert first.is_contiguous() and lens.is_contiguous()
        self.lib.kvs_paged_decode(q.data_ptr(), kv_layer.data_ptr(), int(kv_layer.dtype == torch.bfloat16),
                                  tables.data_ptr(), tables.stride(0), first.data_ptr(), lens.data_ptr(), *q.shape,
                                  kv_layer.shape[2], kv_layer.shape[3], scale, out.data_ptr(), lse.data_ptr())

    def rows(self, q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor,
             lens: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor, window: int = 0) -> None:
        """Attention of q (T, KVH, G, D) float32, in segments of positions: segment s is rows
        [starts[s], starts[s + 1]) and reads the blocks tables[s]; position i of its n sees keys
        [0, lens[s] - n + 1 + i), or with `window` the last `window` of them (only their blocks need be in
        the table). Into out (T, KVH, G, D) and lse (T, KVH, G), float32; starts (S + 1,) and lens (S,) int64."""
        segments = lens.shape[0]
        _check(q, kv_layer, tables, out, lse)
        assert starts.dtype == lens.dtype == torch.int64 and tables.shape[0] == segments
        assert starts.shape == (segments + 1,) and int(starts[-1]) <= q.shape[0]
        assert starts.is_contiguous() and lens.is_contiguous() and window >= 0
        self.lib.kvs_paged_rows(q.data_ptr(), kv_layer.data_ptr(), int(kv_layer.dtype == torch.bfloat16),
                                tables.data_ptr(), tables.stride(0), starts.data_ptr(), lens.data_ptr(), segments,
                                window, *q.shape[1:], kv_layer.shape[2], kv_layer.shape[3], scale, out.data_ptr(),
                                lse.data_ptr())


def _check(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """What both kernels read through raw pointers: shapes, dtypes and contiguity of their shared arguments."""
    kvh, d = q.shape[1], q.shape[3]
    two, kvh_, _, _, d_ = kv_layer.shape
    assert (two, kvh_, d_) == (2, kvh, d) and kv_layer.is_contiguous()
    assert q.dtype == out.dtype == lse.dtype == torch.float32 and q.is_contiguous()
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == q.shape[:3] and lse.is_contiguous()
    assert tables.dtype == torch.int64 and tables.stride(1) == 1
