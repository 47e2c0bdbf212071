"""Our C++ kernels (kvstrata/model/csrc): built with the system C++ compiler at first use, cached, loaded with ctypes.

Five libraries: paged attention (`paged_decode()`), bf16 RMSNorm, SiLU-and-multiply and RoPE with the
K/V write (`norm_act()`, which a decode step calls ~120 times in place of ~1,200 torch ops), the LoRA
updates of a projection for all of a step's adapters at once (`lora_apply()`, kvstrata.model.lora), and
a GGUF's matrices at their own bits (`gguf_matmul()`, kvstrata.model.gguf_bits), and a step's decoder layers
calling the others from C++ (`decoder_layers()`, kvstrata.model.fused_layers).

Why a plain shared library and not a torch extension: it needs no torch headers and loads without
a build system. It takes raw pointers, so
the callers here check every shape, dtype and stride it relies on. It is compiled with `-fopenmp`
and so needs `libgomp.so.1`, the soname of the OpenMP runtime torch itself loads: the kernel's
parallel loops run on torch's own thread team (one team spinning, not two; see AsyncLLMEngine).

The build lands in `$KVSTRATA_CACHE_DIR/kernels` (default `~/.cache/kvstrata/kernels`) under a name
made of the source's and the flags' hash, so a changed source rebuilds (once, tens of seconds: the
AVX2 and plain x86-64 builds of the kernel's unrolled tile loops are most of it) and concurrent first
uses do not clash (each writes a temporary file and renames it); `make install` builds it ahead.
Without a compiler, or with `KVSTRATA_KERNELS=0`, `paged_decode()` returns None and attention keeps
its torch path. `python -m kvstrata.model.kernels` builds it and says where it is.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from kvstrata.core.config import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "paged_attention.cpp"
NORM_ACT_SOURCE = CSRC / "norm_act.cpp"
LORA_SOURCE = CSRC / "lora.cpp"
GGUF_SOURCE = CSRC / "gguf_matmul.cpp"
DECODER_LAYERS_SOURCE = CSRC / "decoder_layers.cpp"
HEADERS = [CSRC / "vec16.h", CSRC / "bf16_tiles.h"]     # included by the sources: part of every build's tag
# Bumped whenever a change to the source moves any bit of its results: exact engines' model
# fingerprints carry it, so they never load KV that an older kernel computed (kvstrata.model.loader).
REVISION = 2
NORM_ACT_REVISION = 1             # the same for norm_act.cpp, in the fingerprint of every model using it
GGUF_REVISION = 2                 # the same for gguf_matmul.cpp, in the fingerprint of a GGUF served at its bits
#                                   (2: BF16 matrices at their bits)
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-Wno-psabi"]


class PagedDecode:
    """`kvs_paged_decode` (a few query rows per sequence: decodes) and `kvs_paged_rows` (rows per
    block table: prefill chunks, and speculative verifications, which it reads in place as decodes)
    with their arguments checked. See the C++ source for what they compute;
    a row gets the same bits from either."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn = lib.kvs_paged_decode
        self._fn.restype = None
        self._fn.argtypes = [ptr, ptr, ctypes.c_int, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64,
                             ctypes.c_float, ptr, ptr]
        self._rows = lib.kvs_paged_rows
        self._rows.restype = None
        self._rows.argtypes = [ptr, ptr, ctypes.c_int, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64,
                               ctypes.c_float, ptr, ptr]
        self.max_group = lib.kvs_max_group()
        self._head_dim_ok = lib.kvs_supports_head_dim
        self.lanes = lib.kvs_lanes()

    def supports(self, kv_dtype: torch.dtype, group: int, head_dim: int, block_size: int,
                 device: torch.device) -> bool:
        """Whether a cache of these shapes can be read by the kernel (else: the torch path)."""
        return (device.type == "cpu" and kv_dtype in (torch.float32, torch.bfloat16)
                and group <= self.max_group and bool(self._head_dim_ok(head_dim))
                and (block_size % self.lanes == 0 or self.lanes % block_size == 0))

    def __call__(self, q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, first: torch.Tensor,
                 lens: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Attention of q (n, KVH, G, D) float32 over keys [first, lens) of each sequence's blocks in
        kv_layer (2, KVH, N, bs, D) into out (n, KVH, G, D) and lse (n, KVH, G), both float32."""
        n = q.shape[0]
        _check(q, kv_layer, tables, out, lse)
        assert first.dtype == lens.dtype == torch.int64 and first.shape == lens.shape == (n,) and tables.shape[0] == n
        assert first.is_contiguous() and lens.is_contiguous()
        self._fn(q.data_ptr(), kv_layer.data_ptr(), int(kv_layer.dtype == torch.bfloat16), tables.data_ptr(),
                 tables.stride(0), first.data_ptr(), lens.data_ptr(), *q.shape, kv_layer.shape[2], kv_layer.shape[3],
                 scale, out.data_ptr(), lse.data_ptr())

    def rows(self, q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor,
             lens: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Attention of q (T, KVH, G, D) float32, in segments of positions: segment s is rows
        [starts[s], starts[s + 1]) and reads the blocks tables[s]; position i of its n sees keys
        [0, lens[s] - n + 1 + i). Into out (T, KVH, G, D) and lse (T, KVH, G), float32; starts (S + 1,)
        and lens (S,) int64."""
        segments = lens.shape[0]
        _check(q, kv_layer, tables, out, lse)
        assert starts.dtype == lens.dtype == torch.int64 and tables.shape[0] == segments
        assert starts.shape == (segments + 1,) and int(starts[-1]) <= q.shape[0]
        assert starts.is_contiguous() and lens.is_contiguous()
        self._rows(q.data_ptr(), kv_layer.data_ptr(), int(kv_layer.dtype == torch.bfloat16), tables.data_ptr(),
                   tables.stride(0), starts.data_ptr(), lens.data_ptr(), segments, *q.shape[1:],
                   kv_layer.shape[2], kv_layer.shape[3], scale, out.data_ptr(), lse.data_ptr())


def _check(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """What both kernels read through raw pointers: shapes, dtypes and contiguity of their shared arguments."""
    kvh, d = q.shape[1], q.shape[3]
    two, kvh_, _, _, d_ = kv_layer.shape
    assert (two, kvh_, d_) == (2, kvh, d) and kv_layer.is_contiguous()
    assert q.dtype == out.dtype == lse.dtype == torch.float32 and q.is_contiguous()
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == q.shape[:3] and lse.is_contiguous()
    assert tables.dtype == torch.int64 and tables.stride(1) == 1


class NormAct:
    """`kvs_rms_norm`, `kvs_silu_mul` and `kvs_rope_store` (csrc/norm_act.cpp): bf16 rows on the CPU, as wide
    as `takes` says."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._norm = lib.kvs_rms_norm
        self._norm.restype = None
        self._norm.argtypes = [ptr, i64, ptr, ptr, i64, i64, ctypes.c_float]
        self._silu_mul = lib.kvs_silu_mul
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [ptr, ptr, i64, i64]
        self._rope = lib.kvs_rope_store
        self._rope.restype = None
        self._rope.argtypes = [ptr, i64, ctypes.c_int, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr]
        lib.kvs_rope_max_head_dim.restype = i64
        self.rope_max_head_dim = lib.kvs_rope_max_head_dim()

    @staticmethod
    def takes(dtype: torch.dtype, device: torch.device, *widths: int) -> bool:
        """Whether a model of this dtype on this device, with rows of these widths, can use the kernels."""
        return dtype == torch.bfloat16 and device.type == "cpu" and all(w % 16 == 0 for w in widths)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x (T, E) -> LlamaRMSNorm(x) (T, E), float32 statistics; x and weight (E,) bf16, contiguous."""
        assert x.dtype == weight.dtype == torch.bfloat16 and x.is_contiguous() and x.shape[1:] == weight.shape
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), x.shape[1], weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                   kv_layer: torch.Tensor, q: torch.Tensor) -> None:
        """A layer's attention inputs in one call, the bits of `apply_rotary` and `PagedKVCache.write`: qkv (T,
        (H + 2 KVH) D) with unit column stride, cos and sin (T, 1, D) (`RotaryTables.lookup`) in its dtype;
        RoPE'd queries into q (T, KVH, G, D) float32 (the paged kernel's, widened from the model dtype), RoPE'd
        keys and the values into kv_layer (2, KVH, N, bs, D) at the flat slots (T,)."""
        t, kvh, g, d = q.shape
        heads = kvh * g
        two, kvh_, n, bs, d_kv = kv_layer.shape
        assert (two, kvh_, d_kv) == (2, kvh, d) and d % 2 == 0 and d <= self.rope_max_head_dim
        assert qkv.dtype == cos.dtype == sin.dtype == kv_layer.dtype and qkv.dtype in (torch.float32, torch.bfloat16)
        assert qkv.shape == (t, (heads + 2 * kvh) * d) and qkv.stride(1) == 1 and kv_layer.is_contiguous()
        assert cos.shape == sin.shape == (t, 1, d) and cos.is_contiguous() and sin.is_contiguous()
        assert q.dtype == torch.float32 and q.is_contiguous() and slots.dtype == torch.int64 and slots.shape == (t,)
        assert slots.is_contiguous() and cos.device.type == "cpu"
        self._rope(qkv.data_ptr(), qkv.stride(0), int(qkv.dtype == torch.bfloat16), cos.data_ptr(), sin.data_ptr(),
                   slots.data_ptr(), t, heads, kvh, d, kv_layer.data_ptr(), n * bs, q.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up (T, 2 I) bf16, contiguous -> SiLU(gate) * up (T, I) bf16."""
        assert gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous() and gate_up.dim() == 2
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), *out.shape)
        return out


class LoRAApply:
    """`kvs_lora_apply` (csrc/lora.cpp): y[rows] += (x[rows] @ A.T) @ BT per adapter group, bf16 on the CPU.
    Raw pointers: `kvstrata.model.lora.LoRABatch` checks the shapes, dtypes and strides it relies on."""

    MAX_FUSED_RANK = 3 * 1024

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn = lib.kvs_lora_apply
        self._fn.restype = None
        self._fn.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr]

    @staticmethod
    def takes(dtype: torch.dtype, device: torch.device, *widths: int) -> bool:
        return dtype == torch.bfloat16 and device.type == "cpu" and all(w % 16 == 0 for w in widths)

    def __call__(self, y: torch.Tensor, x: torch.Tensor, groups: int, offsets: int, rows: int, a: int, bt: int,
                 ranks: int) -> None:
        """y (T, out) and x (T, in) bf16 rows (unit column stride); the rest are addresses of int64 arrays:
        `offsets` (groups + 1), `rows`, and for each group its A's and BT's addresses and its rank."""
        assert y.dtype == x.dtype == torch.bfloat16 and y.stride(1) == 1 and x.stride(1) == 1
        self._fn(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), x.shape[1], y.shape[1], groups, offsets,
                 rows, a, bt, ranks)


class GGUFMatmul:
    """`kvs_gguf_pack` and `kvs_gguf_matmul` (csrc/gguf_matmul.cpp): a GGUF's Q4_0 / Q4_1 / Q8_0 / Q6_K / BF16 rows
    packed once, then multiplied at their bits. Raw pointers: `kvstrata.model.gguf_bits.GGUFLinear` checks
    what the kernel relies on."""

    KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q6_K": 3, "BF16": 4}

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._bytes = lib.kvs_gguf_packed_bytes
        self._bytes.restype = i64
        self._bytes.argtypes = [c_int, i64, i64]
        self._pack = lib.kvs_gguf_pack
        self._pack.restype = None
        self._pack.argtypes = [c_int, ptr, i64, i64, ptr]
        self._matmul = lib.kvs_gguf_matmul
        self._matmul.restype = None
        self._matmul.argtypes = [c_int, c_int, ptr, i64, i64, ptr, i64, ptr, i64, i64, c_int]

    def pack(self, kind: str, raw: torch.Tensor, n_in: int) -> torch.Tensor:
        """raw (out, blocks * block bytes) uint8, contiguous -> the kernel's layout (uint8, 1-D)."""
        assert raw.dtype == torch.uint8 and raw.is_contiguous() and raw.dim() == 2
        assert n_in % {"Q6_K": 256, "BF16": 2}.get(kind, 32) == 0
        packed = huge_page_bytes(self._bytes(self.KINDS[kind], raw.shape[0], n_in))
        self._pack(self.KINDS[kind], raw.data_ptr(), raw.shape[0], n_in, packed.data_ptr())
        return packed

    def __call__(self, kind: str, level: int, packed: torch.Tensor, n_out: int, x: torch.Tensor,
                 y: torch.Tensor) -> None:
        """y (M, out) = x (M, in) @ W.T, both float32 or both bfloat16 with unit column strides;
        level 3 AVX-512 VNNI + BF16, 2 AVX-512 VNNI, 1 AVX2, 0 plain C++ (each gives the same bits)."""
        self._matmul(self.KINDS[kind], level, packed.data_ptr(), n_out, x.shape[1], x.data_ptr(), x.stride(0),
                     y.data_ptr(), y.stride(0), x.shape[0], int(x.dtype == torch.bfloat16))


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
    """An uninitialized uint8 tensor of n bytes, its whole 2 MiB pages marked for transparent huge pages
    (`madvise(MADV_HUGEPAGE)`, Linux's default THP mode is madvise): a decode step streams every weight once,
    and with 4 KiB pages each page costs a TLB miss, a two-level walk in a VM. Weights read at +7-10% on the
    Zen 4 VM at the 1B shape. Below 4 MiB, or where madvise is missing or refused, a plain allocation."""
    madvise = _madvise()
    if n < 2 * HUGE_PAGE or madvise is None:
        return torch.empty(n, dtype=torch.uint8)
    buffer = torch.empty(n + HUGE_PAGE, dtype=torch.uint8)           # room to start on a page boundary
    address = buffer.data_ptr()
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    madvise(start, (n // HUGE_PAGE) * HUGE_PAGE, MADV_HUGEPAGE)       # a hint: refused, the pages stay 4 KiB
    return buffer[start - address:start - address + n]


@cache
def paged_decode() -> PagedDecode | None:
    """The paged decode kernel, built if need be; None when it cannot be had here (logged once)."""
    lib = _load(SOURCE, "paged attention kernel unavailable (%s); decode attention gathers blocks instead")
    return None if lib is None else PagedDecode(lib)


@cache
def norm_act() -> NormAct | None:
    """The bf16 RMSNorm / SiLU-and-multiply kernels, built if need be; None when they cannot be had here."""
    lib = _load(NORM_ACT_SOURCE, "norm/activation kernels unavailable (%s); the model keeps torch's ops for them")
    return None if lib is None else NormAct(lib)


@cache
def lora_apply() -> LoRAApply | None:
    """The bf16 LoRA kernel, built if need be; None when it cannot be had here (adapters then use torch's ops)."""
    lib = _load(LORA_SOURCE, "LoRA kernel unavailable (%s); adapters apply their updates with torch's ops")
    return None if lib is None else LoRAApply(lib)


@cache
def gguf_matmul() -> GGUFMatmul | None:
    """The GGUF kernel, built if need be; None when it cannot be had here (logged once)."""
    lib = _load(GGUF_SOURCE, "GGUF kernel unavailable (%s); a GGUF cannot be served at its own bits here")
    return None if lib is None else GGUFMatmul(lib)


@cache
def decoder_layers() -> ctypes._CFuncPtr | None:
    """`kvs_decoder_layers` (csrc/decoder_layers.cpp, driven by kvstrata.model.fused_layers), built if need be;
    None when it cannot be had here."""
    lib = _load(DECODER_LAYERS_SOURCE, "decoder-layers kernel unavailable (%s); a step's layers loop in Python")
    if lib is None:
        return None
    fn = lib.kvs_decoder_layers
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def function_address(name: str) -> int:
    """The address of one of the other libraries' entry points, for `kvs_decoder_layers` to call: rms_norm,
    silu_mul, rope_store, gguf_matmul, paged_decode or paged_rows (each library must have loaded)."""
    owners = {"rms_norm": norm_act, "silu_mul": norm_act, "rope_store": norm_act, "gguf_matmul": gguf_matmul,
              "paged_decode": paged_decode, "paged_rows": paged_decode}
    kernel = owners[name]()
    assert kernel is not None, f"the library holding kvs_{name} is unavailable"
    return ctypes.cast(getattr(kernel.lib, f"kvs_{name}"), ctypes.c_void_p).value


def _load(source: Path, unavailable: str) -> ctypes.CDLL | None:
    """`source` built and loaded; None, with `unavailable` logged, when it cannot be (or KVSTRATA_KERNELS=0)."""
    if os.environ.get("KVSTRATA_KERNELS", "1") == "0":
        return None
    try:
        return ctypes.CDLL(str(_build(source)))
    except subprocess.CalledProcessError as e:
        reason = f"{' '.join(e.cmd)} failed: {e.stderr.strip()[-2000:]}"
    except OSError as e:                    # FileNotFoundError (no compiler) included
        reason = str(e)
    logger.warning(unavailable, reason)
    return None


def _build(source: Path) -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (g++) on PATH")
    text = source.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
    tag = hashlib.sha256(text + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    root = cache_dir() / "kernels"
    target = root / f"{source.stem}-{tag}.so"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    logger.info("building %s into %s (once per source change, ~30 s)", source.name, root)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(source), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built %s", target)
    return target


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = {source: kernel() is not None for source, kernel in ((SOURCE, paged_decode), (NORM_ACT_SOURCE, norm_act),
                                                                 (LORA_SOURCE, lora_apply), (GGUF_SOURCE, gguf_matmul),
                                                                 (DECODER_LAYERS_SOURCE, decoder_layers))}
    for source, ok in built.items():
        print(f"{source.stem}: {_build(source) if ok else 'unavailable (KVSTRATA_KERNELS=0, or see above)'}")
    raise SystemExit(0 if all(built.values()) else 1)
