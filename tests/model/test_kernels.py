"""The kernel room: one declared interface (kernels/csrc/kvs_abi.h, read by abi.py), one ISA choice, one build
policy. A library built from another header is refused; every declared entry point is some library's; a kernel
that cannot be built is an error, the kernels off only by choice or where they cannot exist."""

from __future__ import annotations

import ctypes
import subprocess

import pytest

from kvstrata.model import kernels
from kvstrata.model.kernels import abi, build
from kvstrata.model.kernels.layers import KvsLayer, KvsStep
from tests.model.model_helpers import kernels_on


@kernels_on
def test_every_declared_entry_point_is_a_librarys_and_the_structs_agree():
    libraries = [build.library(name) for name in build.SOURCES]
    for entry in abi.signatures():
        owners = [lib.name for lib in libraries if hasattr(lib.cdll, entry)]
        assert owners, f"{entry} is declared in kvs_abi.h but no library defines it"
        assert len(owners) == 1 or entry in ("kvs_abi", "kvs_level"), (entry, owners)
    layers = build.library("decoder_layers")
    assert layers.kvs_sizeof_step() == ctypes.sizeof(KvsStep) and layers.kvs_sizeof_layer() == ctypes.sizeof(KvsLayer)
    assert all(lib.kvs_abi() == abi.abi_hash() and lib.kvs_level() == kernels.level() for lib in libraries)


@kernels_on
def test_a_library_built_from_another_header_is_refused(tmp_path):
    source = tmp_path / "stale.cpp"
    source.write_text('#include <cstdint>\nextern "C" int64_t kvs_abi() { return 12345; }\n'
                      'extern "C" int64_t kvs_level() { return 0; }\n')
    subprocess.run([build.compiler(), "-shared", "-fPIC", str(source), "-o", str(tmp_path / "stale.so")], check=True)
    with pytest.raises(ImportError, match="was built from another kvs_abi.h"):
        abi.Library(tmp_path / "stale.so", "stale", 0)


def test_kernels_off_by_choice_leave_the_torch_paths(monkeypatch, caplog):
    kernels.face.cache_clear()
    monkeypatch.setenv("KVSTRATA_KERNELS", "0")
    monkeypatch.setattr(build, "_told", set())            # said once a process: this test hears it again
    try:
        with caplog.at_level("WARNING"):
            assert kernels.face(kernels.PagedDecode) is None and kernels.off_reason() == "KVSTRATA_KERNELS=0"
    finally:
        kernels.face.cache_clear()
    assert "kernels are off (KVSTRATA_KERNELS=0)" in caplog.text


def test_a_failing_build_is_an_error_with_the_compilers_message(monkeypatch, tmp_path):
    """On x86-64 with a compiler, a library that does not build fails loudly (nothing cached); only a missing
    compiler turns the kernels off, and says so."""
    monkeypatch.setenv("KVSTRATA_KERNEL_DIR", str(tmp_path))
    bad = tmp_path / "g++"
    bad.write_text("#!/bin/sh\necho 'error: this compiler is broken' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CXX", str(bad))
    build.load.cache_clear()
    try:
        with pytest.raises(build.KernelBuildError, match="this compiler is broken"):
            build.load("paged_attention", kernels.level())
    finally:
        build.load.cache_clear()
    assert not list(tmp_path.glob("*.so"))
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert kernels.off_reason() == "no C++ compiler (g++) on PATH"
