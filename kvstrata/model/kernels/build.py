"""Building and loading our C++ libraries: one policy for every kernel.

A library is compiled with the system's C++ compiler, once per source change and ISA level (`isa.py`), into
`$KVSTRATA_KERNEL_DIR` (default `<cache root>/kernels`) under a name made of the sources' and the flags' hash, so
a changed source rebuilds and concurrent first uses do not clash (each writes a temporary file and renames it);
`make install` builds this machine's level ahead. It is linked against `libgomp.so.1`, the OpenMP runtime torch
itself loads, so its parallel loops run on torch's own thread team (one team spinning, not two).

The policy, the same for every library: our kernels are off only by choice (`KVSTRATA_KERNELS=0`) or where they
cannot exist (a CPU that is not x86-64, no C++ compiler on PATH); then `library` answers None and each caller
takes its torch path, `off_reason` saying why. Anywhere else a library that fails to build or load is an error,
with the compiler's own message: it is a bug to fix, never a quiet fall back to a slower path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from kvstrata.core.config import cache_dir
from kvstrata.model.kernels.abi import HEADER, Library, abi_hash
from kvstrata.model.kernels.isa import COMPILER_FLAGS, Level, level

logger = logging.getLogger(__name__)

CSRC = HEADER.parent
SOURCES = {name: CSRC / f"{name}.cpp" for name in ("paged_attention", "norm_act", "lora", "gguf_matmul",
                                                   "decoder_layers")}
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-Wno-psabi")


class KernelBuildError(RuntimeError):
    """A library that should build here did not: the message holds the compiler's."""


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def off_reason() -> str | None:
    """Why our kernels do not run here (by choice, or where they cannot), or None when they do."""
    if os.environ.get("KVSTRATA_KERNELS", "1") == "0":
        reason = "KVSTRATA_KERNELS=0"
    elif platform.machine() not in ("x86_64", "AMD64"):
        reason = f"the kernels are x86-64 code and this CPU is {platform.machine()}"
    elif compiler() is None:
        reason = "no C++ compiler (g++) on PATH"
    else:
        return None
    if reason not in _told:
        _told.add(reason)
        logger.warning("kvstrata's C++ kernels are off (%s): attention and norms take torch's paths, and a GGUF "
                       "is widened", reason)
    return reason


_told: set[str] = set()


def kernel_dir() -> Path:
    return Path(os.environ.get("KVSTRATA_KERNEL_DIR") or cache_dir() / "kernels")


@cache
def load(name: str, at: Level) -> Library:
    """Library `name` built for ISA level `at` and loaded; KernelBuildError if it cannot be (never when off)."""
    assert off_reason() is None, f"the kernels are off here ({off_reason()})"
    try:
        return Library(_build(SOURCES[name], at), name, int(at))
    except subprocess.CalledProcessError as e:
        raise KernelBuildError(f"{name}.cpp did not build for {at.label}: {' '.join(e.cmd)}\n"
                               f"{e.stderr.strip()[-4000:]}") from None
    except (OSError, ImportError) as e:
        raise KernelBuildError(f"{name} ({at.label}) could not be loaded: {e}") from e


def library(name: str, at: Level | None = None) -> Library | None:
    """Library `name` at this machine's level (or `at`), or None when the kernels are off here."""
    return None if off_reason() is not None else load(name, level() if at is None else at)


def _build(source: Path, at: Level) -> Path:
    cxx = compiler()
    flags = [*FLAGS, *COMPILER_FLAGS[at], f"-DKVS_LEVEL={int(at)}", f"-DKVS_ABI_HASH={abi_hash()}LL"]
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    tag = hashlib.sha256(text + " ".join([cxx, *flags]).encode()).hexdigest()[:16]
    root = kernel_dir()
    target = root / f"{source.stem}-{at.label}-{tag}.so"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    logger.info("building %s for %s into %s (once per source change)", source.name, at.label, root)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
    os.close(fd)
    try:
        subprocess.run([cxx, *flags, str(source), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built %s", target)
    return target
