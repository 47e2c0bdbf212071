"""The one place the ISA of every kernel is chosen: a level, from what `kvstrata.core.machine` says the CPU has.

Each library is built once per level it runs at (`build.py` gives each level its compiler flags), and its code
picks its paths by the compiler's own macros, so the choice is made here, once, for all of them: never by GCC's
`target_clones` resolver (which reads the CPU itself and ignores `KVSTRATA_CPU_ISA`), nor a level passed per
call. `KVSTRATA_CPU_ISA=avx2` (or `avx512`, `avx512_vnni`) caps the level as it caps the rest of the engine, so a
smaller machine's paths run, whole, on a bigger one; tests load any level the CPU can run (`levels_here`).
"""

from __future__ import annotations

from enum import IntEnum

from kvstrata.core.machine import machine


class Level(IntEnum):
    """ISA levels, each a superset of the one before."""

    X86_64 = 0          # baseline x86-64 (SSE2): correct anywhere
    AVX2 = 1            # + AVX2, FMA, F16C
    AVX512 = 2          # + AVX-512 F, BW, VL
    AVX512_VNNI = 3     # + AVX-512 VNNI (int8 dot products into int32)
    AVX512_BF16 = 4     # + AVX512-BF16 (bf16 dot products)

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-") if self is Level.X86_64 else self.name.lower()


# What each level needs of the CPU (`Machine.has` flags), and the flags it is compiled with.
NEEDS: dict[Level, tuple[str, ...]] = {
    Level.X86_64: (),
    Level.AVX2: ("avx2", "fma"),
    Level.AVX512: ("avx2", "fma", "avx512f", "avx512bw", "avx512vl"),
    Level.AVX512_VNNI: ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    Level.AVX512_BF16: ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"),
}
COMPILER_FLAGS: dict[Level, tuple[str, ...]] = {
    Level.X86_64: (),
    Level.AVX2: ("-mavx2", "-mfma", "-mf16c"),
    Level.AVX512: ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl"),
    Level.AVX512_VNNI: ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    Level.AVX512_BF16: ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                        "-mavx512bf16"),
}


def levels_here() -> list[Level]:
    """Every level this CPU (as capped) can run, lowest first."""
    cpu = machine()
    return [level for level in Level if all(cpu.has(flag) for flag in NEEDS[level])]


def level() -> Level:
    """The level every kernel runs at here: the highest this CPU (as capped) can run."""
    return levels_here()[-1]
