"""`kvstrata serve --allocator`: when the server re-executes itself on jemalloc, and what it reports then."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstrata.entrypoints.cli.allocator import ENV_DONE, ENV_LIBRARY, find_jemalloc, reexec_environ


def test_the_choice(tmp_path):
    library = tmp_path / "libjemalloc.so.2"
    library.write_bytes(b"")
    named = {ENV_LIBRARY: str(library), "MALLOC_CONF": "narenas:2"}
    env = reexec_environ("auto", named)
    assert env["LD_PRELOAD"] == str(library) and env["MALLOC_CONF"] == "narenas:2" and env[ENV_DONE] == "1"
    assert reexec_environ("glibc", named) is None
    assert reexec_environ("auto", env) is None                      # never twice
    with pytest.raises(ValueError, match="is not a file"):
        reexec_environ("auto", {ENV_LIBRARY: str(tmp_path / "missing.so")})


def test_jemalloc_preloaded_reports_its_own_heap():
    """Where jemalloc is found, a process that preloads it reads jemalloc's figures (glibc's would be ~0)."""
    library = find_jemalloc({})
    if library is None:
        pytest.skip("no libjemalloc.so.2 here (make install unpacks one where apt-get is)")
    code = ("import torch; from kvstrata.engine.heap_trim import heap_stats; x = torch.ones(10**7); "
            "print(heap_stats().in_use)")
    out = subprocess.run([sys.executable, "-c", code], env={"LD_PRELOAD": str(library), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout
    assert int(out) >= 4 * 10**7
