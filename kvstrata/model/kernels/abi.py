"""The kernels' C interface, read from the one header that declares it (csrc/kvs_abi.h).

Each C source includes the header, so the compiler holds every definition to its declaration; this module reads
the same text and makes the ctypes signatures and structs from it, so the Python side cannot drift from the C
side either (through raw pointers a drift is memory corruption, not an error). A library's `kvs_abi()` answers the
hash of the header it was built from, and `kvs_sizeof_*` the sizes of the structs it uses: `bind` checks both
and refuses, loudly, a library that does not match.

The header's forms (kept simple on purpose, so that a few regular expressions read them whole): one
`KVS_API <type> <name>(<parameters>);` per entry point, `struct Kvs<Name> { <type> <field>, <field>; ... };`, and
the GGUF type table `X(kind, name, weights a block, bytes a block)`. Any pointer, function pointer or
`decltype(&...)` is an address (`c_void_p`).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

HEADER = Path(__file__).with_name("csrc") / "kvs_abi.h"

_SCALARS = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
            "double": ctypes.c_double}
_DECLARATION = re.compile(r"KVS_API\s+(\w+)\s+(kvs_\w+)\s*\(([^)]*)\)\s*;")
_STRUCT = re.compile(r"struct\s+(Kvs\w+)\s*\{(.*?)\};", re.S)
_GGUF_TYPE = re.compile(r"X\((\d+),\s*(\w+),\s*(\d+),\s*(\d+)\)")


@dataclass(frozen=True)
class GGUFType:
    """One row of the header's GGUF type table."""

    kind: int           # the kernel's number for it
    name: str           # the GGUF type's name (Q4_0, ...)
    block_weights: int  # weights in one block of the file
    block_bytes: int    # bytes of one block in the file


def _text() -> str:
    """The header without its comments."""
    return re.sub(r"//[^\n]*", "", HEADER.read_text())


def abi_hash() -> int:
    """The header's hash as a positive int64: what `kvs_abi()` must answer (build.py compiles it in)."""
    return int.from_bytes(hashlib.sha256(HEADER.read_bytes()).digest()[:8], "little") & (2**63 - 1)


def _ctype(declaration: str, structs: dict[str, type]) -> object:
    """A C type (with or without a parameter name) as ctypes: scalars by name, any pointer an address."""
    words = declaration.replace("const ", "").split()
    if "*" in declaration or "(" in declaration:
        return ctypes.c_void_p
    assert words, f"an empty type in {HEADER.name}"
    if words[0] in structs:
        return structs[words[0]]
    assert words[0] in _SCALARS, f"{HEADER.name}: a type abi.py does not read: {declaration!r}"
    return _SCALARS[words[0]]


@cache
def structs() -> dict[str, type]:
    """Every struct of the header as a ctypes.Structure class, by its C name (KvsStep, ...), in header order."""
    made: dict[str, type] = {}
    for name, body in _STRUCT.findall(_text()):
        fields: list[tuple[str, object]] = []
        for line in filter(None, (part.strip() for part in body.split(";"))):
            if line.startswith("decltype("):           # a function pointer: decltype(&kvs_x) name
                fields.append((line.split(")")[-1].strip(), ctypes.c_void_p))
                continue
            first, *more = (part.strip() for part in line.split(","))     # "type name", then more names
            kind, field = re.fullmatch(r"(.*?[\s*])(\w+)", first).groups()
            assert all(re.fullmatch(r"\w+", n) for n in more), f"{HEADER.name}: one pointer a line: {line!r}"
            fields += [(n, _ctype(kind, made)) for n in (field, *more)]
        made[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    return made


@cache
def signatures() -> dict[str, tuple[object, list[object]]]:
    """Every entry point: name -> (restype, argtypes)."""
    found = {}
    for restype, name, parameters in _DECLARATION.findall(_text()):
        args = [p.strip() for p in parameters.split(",") if p.strip()]
        found[name] = (_SCALARS[restype], [_ctype(arg, structs()) for arg in args])
    return found


@cache
def gguf_types() -> tuple[GGUFType, ...]:
    """The GGUF types the kernel runs at their own bits, in the header's order."""
    table = _text()[_text().index("KVS_GGUF_TYPES(X)"):]
    return tuple(GGUFType(int(k), name, int(w), int(b))
                 for k, name, w, b in _GGUF_TYPE.findall(table[:table.index("\n\n")]))


class Library:
    """A kernel library loaded with ctypes, its entry points typed from the header: `lib.kvs_name(...)`."""

    def __init__(self, path: Path, name: str, level: int) -> None:
        self.path = path
        self.name = name
        self.level = level
        self.cdll = ctypes.CDLL(str(path))
        self._check()

    def __getattr__(self, entry: str):
        if not entry.startswith("kvs_"):
            raise AttributeError(entry)
        restype, argtypes = signatures()[entry]
        fn = getattr(self.cdll, entry)
        fn.restype, fn.argtypes = restype, argtypes
        setattr(self, entry, fn)
        return fn

    def address(self, entry: str) -> int:
        """Where an entry point lives, for a C caller (kvs_decoder_layers calls the others by address)."""
        assert entry in signatures(), f"{entry} is not declared in {HEADER.name}"
        return ctypes.cast(getattr(self.cdll, entry), ctypes.c_void_p).value

    def _check(self) -> None:
        built = self.kvs_abi()
        if built != abi_hash():
            raise ImportError(f"{self.path} was built from another {HEADER.name} (abi {built:x}, expected "
                              f"{abi_hash():x}); remove it and let it rebuild")
        if self.kvs_level() != self.level:
            raise ImportError(f"{self.path} is built for ISA level {self.kvs_level()}, not {self.level}")
        for struct, size in (("KvsStep", "kvs_sizeof_step"), ("KvsLayer", "kvs_sizeof_layer")):
            if hasattr(self.cdll, size) and getattr(self, size)() != ctypes.sizeof(structs()[struct]):
                raise ImportError(f"{self.path}: sizeof({struct}) is {getattr(self, size)()} in C and "
                                  f"{ctypes.sizeof(structs()[struct])} as abi.py read {HEADER.name}")
