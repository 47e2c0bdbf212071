"""What CPU this is: its model, cores and the ISA extensions that decide which kernels are fast.

Every figure kvstrata prints names its machine with `Machine.describe()`, and everything chosen by
CPU (the dtype `auto` picks, the int8 kernel, whether a simulator profile applies) keys on
`Machine.kind`, because the same wheel runs on AVX2-only EPYCs and on AVX-512 + VNNI + bf16 Xeons
and the fastest path differs between them by up to 16x (BENCHMARKS.md).

`KVSTRATA_CPU_ISA=avx2` (or `avx512`, `avx512_vnni`) caps what kvstrata believes the CPU has, to
test a smaller machine's choices on a bigger one; the kernel libraries are capped with their own
variables (`ONEDNN_MAX_CPU_ISA`, `FBGEMM_ENABLE_INSTRUCTIONS`, `ATEN_CPU_CAPABILITY`), which
`isa_cap_environ` returns for a child process.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# The extensions kernels are chosen by, in the order they are printed.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "amx_tile", "amx_int8", "amx_bf16")

# What each cap leaves: a capped CPU reports only the flags of its level.
ISA_CAPS = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl"),
    "avx512_vnni": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
}

# The same cap in the libraries' own words (oneDNN, FBGEMM, ATen's vectorized kernels).
_LIBRARY_CAPS = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512",
               "ATEN_CPU_CAPABILITY": "avx512"},
    "avx512_vnni": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512_E1",
                    "ATEN_CPU_CAPABILITY": "avx512"},
}


@dataclass(frozen=True)
class Machine:
    """This host's CPU as the kernels see it."""

    cpu: str                        # /proc/cpuinfo's model name
    cores: int                      # CPUs this process may run on
    isa: tuple[str, ...]            # the ISA_FLAGS present, in ISA_FLAGS order
    isa_cap: str | None             # KVSTRATA_CPU_ISA, when set
    memory_gib: float

    def has(self, flag: str) -> bool:
        assert flag in ISA_FLAGS, f"unknown ISA flag {flag!r}"
        return flag in self.isa

    @property
    def kind(self) -> str:
        """What decides kernel speed, as one key: CPU model, cores and ISA (profiles and caches key on it)."""
        return f"{self.cpu} | {self.cores} cores | {'+'.join(self.isa) or 'baseline x86-64'}"

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls in hardware (AVX512-BF16 or AMX); elsewhere oneDNN emulates them, slower than fp32."""
        return self.has("avx512_bf16") or self.has("amx_bf16")

    @property
    def int8_dot(self) -> bool:
        """int8 dot products that accumulate straight into int32 (VNNI): without them, u8 x s8 pairs
        sum in int16 first and can saturate (FBGEMM's AVX2 kernels), so activations keep 7 bits."""
        return self.has("avx512_vnni") or self.has("avx_vnni") or self.has("amx_int8")

    def describe(self) -> str:
        """One line for a benchmark's header."""
        cap = f" (capped at {self.isa_cap})" if self.isa_cap else ""
        return (f"{self.cpu}, {self.cores} cores, {self.memory_gib:.0f} GiB, ISA {'+'.join(self.isa) or 'none'}{cap}, "
                f"torch {_torch_version()}")

    def as_dict(self) -> dict:
        return {"cpu": self.cpu, "cores": self.cores, "isa": list(self.isa), "isa_cap": self.isa_cap,
                "memory_gib": round(self.memory_gib, 1), "kind": self.kind, "torch": _torch_version(),
                "python": platform.python_version(), "platform": platform.platform()}


@cache
def machine() -> Machine:
    """This host, read once per process."""
    cpu, flags = _cpuinfo()
    cap = os.environ.get("KVSTRATA_CPU_ISA") or None
    if cap is not None:
        if cap not in ISA_CAPS:
            raise ValueError(f"KVSTRATA_CPU_ISA must be one of {', '.join(ISA_CAPS)}, not {cap!r}")
        flags &= set(ISA_CAPS[cap])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Machine(cpu, cores, tuple(f for f in ISA_FLAGS if f in flags), cap, _memory_gib())


def isa_cap_environ(cap: str) -> dict[str, str]:
    """The environment a child process needs to run as if its CPU stopped at `cap`."""
    assert cap in ISA_CAPS, f"unknown ISA cap {cap!r}"
    return {"KVSTRATA_CPU_ISA": cap, **_LIBRARY_CAPS[cap]}


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; elsewhere the platform's name and no flags."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return platform.processor() or platform.machine(), set()
    cpu, flags = platform.machine(), set()
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            cpu = value.strip()
        elif key == "flags":
            flags = set(value.split())
            break
    return cpu, flags


def _torch_version() -> str:
    """torch's version as installed, without importing it (benchmarks name it; the simulator never loads torch)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError):
        return 0.0


def available_memory() -> int:
    """Bytes this process could still take before the OOM killer acts: the kernel's MemAvailable, or
    less where a cgroup (a container's memory limit) leaves less. Read each time: it changes."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if available is None:
        available = int(_memory_gib() * 1024**3)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(available, 0)
