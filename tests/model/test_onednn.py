"""oneDNN's kernel caches are bounded (kvstrata.model.formats.onednn): the variables do bound them in this torch,
and kvstrata sets them before its first kernel."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.model.formats.onednn import CACHE_VARIABLES, KERNEL_CACHE_ENTRIES

# A fresh process (each library reads its variable at its first kernel): a small packed projection
# called with 400 row counts it has not seen, and malloc's bytes in use before and after.
NEW_ROW_COUNTS = """
import ctypes, json, sys
sys.path.insert(0, {root!r})
import torch
from kvstrata.model.formats.dense import DenseLinear, PackedLinear, can_pack
from kvstrata.model.formats.onednn import bound_kernel_caches
if {bound!r}:
    bound_kernel_caches(32)

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
def in_use():
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd

torch.set_num_threads(1)
dense = DenseLinear(torch.randn(64, 64), None)
assert can_pack(dense.weight)
proj = PackedLinear.from_dense(dense)
proj(torch.randn(1, 64))
before = in_use()
for rows in range(2, 402):
    proj(torch.randn(rows, 64))
print(json.dumps({{"grew_mib": (in_use() - before) / 2**20}}))
"""


def _grew_mib(bound: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    script = NEW_ROW_COUNTS.format(root=str(Path(__file__).resolve().parents[2]), bound=bound)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["grew_mib"]


def _can_measure() -> bool:
    import torch
    return torch.backends.mkldnn.is_available() and hasattr(ctypes.CDLL(None), "mallinfo2")


@pytest.mark.skipif(not _can_measure(), reason="needs oneDNN and glibc's mallinfo2")
def test_bounded_caches_keep_the_kernels_of_new_row_counts_bounded():
    # Measured: 400 new row counts kept ~219 MiB with torch's defaults, ~12.5 MiB at 32 entries.
    bounded = _grew_mib(bound=True)
    assert bounded < 40, f"400 new row counts kept {bounded:.0f} MiB with 32-entry caches"
    unbounded = _grew_mib(bound=False)
    assert unbounded > 3 * bounded, f"the defaults kept {unbounded:.0f} MiB: do the variables still bound anything?"


def test_kvstrata_sets_the_bound_before_its_first_kernel(monkeypatch):
    import torch

    from kvstrata.entrypoints.cli.main import main
    from kvstrata.model.formats.dense import DenseLinear, PackedLinear, can_pack

    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert {name: os.environ.get(name) for name in CACHE_VARIABLES} == dict.fromkeys(CACHE_VARIABLES,
                                                                                     str(KERNEL_CACHE_ENTRIES))
    dense = DenseLinear(torch.randn(8, 8), None)
    if not can_pack(dense.weight):
        return
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    PackedLinear.from_dense(dense)
    assert all(os.environ.get(name) == str(KERNEL_CACHE_ENTRIES) for name in CACHE_VARIABLES)


def test_an_operators_setting_wins(monkeypatch):
    from kvstrata.model.formats.onednn import bound_kernel_caches

    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    bound_kernel_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(KERNEL_CACHE_ENTRIES)
