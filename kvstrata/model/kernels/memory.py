"""Buffers for packed weights on transparent huge pages.

A decode step streams every weight once, and with 4 KiB pages each page costs a TLB miss, a two-dimensional
page walk inside a VM: packed weights read +7-10% faster from 2 MiB pages on the Zen 4 VM at the 1B shape
(docs/design/model.md). Linux's default THP mode honours only `madvise(MADV_HUGEPAGE)`, so that is asked for.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


@cache
def _madvise() -> ctypes._CFuncPtr | None:
    """libc's madvise on Linux, else None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def huge_page_bytes(n: int) -> torch.Tensor:
    """An uninitialized uint8 tensor of n bytes, its whole 2 MiB pages marked for transparent huge pages. Below
    4 MiB, or where madvise is missing or refused, a plain allocation."""
    madvise = _madvise()
    if n < 2 * HUGE_PAGE or madvise is None:
        return torch.empty(n, dtype=torch.uint8)
    buffer = torch.empty(n + HUGE_PAGE, dtype=torch.uint8)           # room to start on a page boundary
    address = buffer.data_ptr()
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    madvise(start, (n // HUGE_PAGE) * HUGE_PAGE, MADV_HUGEPAGE)       # a hint: refused, the pages stay 4 KiB
    return buffer[start - address:start - address + n]
