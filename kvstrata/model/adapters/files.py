"""An adapter's two files, read from a path a client chose, trusting neither the path nor the bytes.

POST /v1/load_lora_adapter names a folder on the server; before this module the engine thread read
whatever was there, whole: a 3 GB sparse file named `adapter_model.safetensors` paused every request
for 28 s. Here nothing is read before its size is known and judged:

    path     at most MAX_PATH_CHARS, no NUL, encodable; with `roots`, each file's realpath (symlinks
             resolved) must lie beneath one of them, and it is opened from that root one component at
             a time without following links (openat + O_NOFOLLOW), so a link swapped in after the
             check leads nowhere; a regular file, opened O_NONBLOCK (a FIFO cannot hang the reader)
    config   at most MAX_CONFIG_BYTES, read to its size
    weights  the file is at most 8 + MAX_HEADER_BYTES + `max_data_bytes` long (the caller's bound for
             this model); the safetensors header (its length, then at most MAX_HEADER_BYTES of JSON)
             declares each tensor's dtype, shape and byte range; the caller's `check` judges those
             before any data is read, the ranges must tile the data, and header + data must be the
             file's size exactly. Then exactly that many bytes are read, once.

The digest is taken over the bytes read, the same bytes the tensors are made from (nothing is read
twice, so the files cannot change between the two). Every refusal is an AdapterError whose message
names the reason and never the files' contents; it says nothing of the path itself (the caller logs
that), and an HTTP client gets one fixed message whatever it was.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_PATH_CHARS = 4096              # Linux's PATH_MAX
MAX_CONFIG_BYTES = 2**20           # PEFT writes about 1 KB
MAX_HEADER_BYTES = 16 * 2**20      # 2 tensors x 7 targets x layers, ~150 bytes each: 16 MiB is 5,000+ layers
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
WIDEST = 8                         # bytes an element of the widest dtype takes
_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class AdapterError(ValueError):
    """An adapter that cannot be served here; the message names the problem (a 4xx for a client)."""


@dataclass(frozen=True)
class TensorSpec:
    """What a safetensors header declares of one tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter's files as read: its config, its tensors (views of the bytes read) and their digest."""

    config: dict
    tensors: dict[str, torch.Tensor]
    digest: str          # sha256 over both files' bytes: equal digests, equal adapters


Check = Callable[[dict, dict[str, TensorSpec]], None]


def read_adapter_files(folder: str | os.PathLike, roots: Sequence[str], max_data_bytes: int,
                       check: Check) -> AdapterFiles:
    """Read and check the adapter in `folder` (beneath one of `roots`, when any): `check(config, specs)`
    judges the config and the declared tensors before their data is read. AdapterError if refused."""
    folder = _checked_path(folder)
    try:
        with _opened(os.path.join(folder, CONFIG_FILE), roots) as config_fd, \
                _opened(os.path.join(folder, WEIGHTS_FILE), roots) as weights_fd:
            config_bytes = _read_exactly(config_fd, 0, _size(config_fd, MAX_CONFIG_BYTES, CONFIG_FILE))
            config = _parse_config(config_bytes)
            size = _size(weights_fd, 8 + MAX_HEADER_BYTES + max_data_bytes, WEIGHTS_FILE)
            head, specs, ranges = _read_header(weights_fd, size)
            check(config, specs)
            data = bytearray(size - len(head))
            _read_into(weights_fd, len(head), data)
    except OSError as exc:        # an I/O error while reading: its errno, never the path
        raise AdapterError(f"cannot read the adapter's files ({_reason(exc)})") from None
    digest = hashlib.sha256()
    for name, parts in ((CONFIG_FILE, (config_bytes,)), (WEIGHTS_FILE, (head, data))):
        digest.update(name.encode() + b"\0" + sum(map(len, parts)).to_bytes(8, "little"))
        for part in parts:
            digest.update(part)
    tensors = {key: torch.frombuffer(data, dtype=spec.dtype, count=math.prod(spec.shape), offset=ranges[key])
               .view(spec.shape) for key, spec in specs.items()}
    return AdapterFiles(config, tensors, digest.hexdigest())


def _checked_path(folder: str | os.PathLike) -> str:
    """The folder as a str the OS can take, before any system call sees it."""
    folder = os.fspath(folder)
    if not isinstance(folder, str) or not folder or len(folder) > MAX_PATH_CHARS or "\0" in folder:
        raise AdapterError("the path is empty, too long or holds a NUL")
    try:
        os.fsencode(folder)
    except UnicodeError:
        raise AdapterError("the path cannot be encoded for this file system") from None
    return folder


@contextmanager
def _opened(path: str, roots: Sequence[str]) -> Iterator[int]:
    """A regular file opened for reading (beneath one of `roots`, when any), closed after."""
    try:
        fd = _open_beneath(path, roots) if roots else os.open(path, _FLAGS)
    except OSError as exc:
        raise AdapterError(f"cannot open {os.path.basename(path)} ({_reason(exc)})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise AdapterError(f"{os.path.basename(path)} is not a regular file")
        yield fd
    finally:
        os.close(fd)


def _open_beneath(path: str, roots: Sequence[str]) -> int:
    """Open `path` from the root its realpath lies beneath, one component at a time, following no link:
    what was checked is what is opened, whatever is swapped in meanwhile."""
    real = os.path.realpath(path)
    for root in map(os.path.realpath, roots):
        if real != root and os.path.commonpath([real, root]) == root:
            break
    else:
        raise AdapterError(f"{os.path.basename(path)} resolves outside every --lora-root")
    *folders, name = os.path.relpath(real, root).split(os.sep)
    fd = os.open(root, os.O_RDONLY | _DIRECTORY)
    try:
        for part in folders:
            inner = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        return os.open(name, _FLAGS | _NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)


def _reason(exc: OSError) -> str:
    """What went wrong, by its errno alone (an OSError's text holds the path)."""
    return os.strerror(exc.errno) if exc.errno else type(exc).__name__


def _size(fd: int, limit: int, name: str) -> int:
    size = os.fstat(fd).st_size
    if size > limit:
        raise AdapterError(f"{name} is {size} bytes, over the {limit} an adapter of this model can take")
    return size


def _read_into(fd: int, offset: int, buffer: bytearray) -> None:
    """Fill `buffer` from `offset`; AdapterError if the file ends first (it shrank since its size was taken)."""
    view, done = memoryview(buffer), 0
    while done < len(buffer):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise AdapterError("a file of the adapter ended before its declared size")
        done += got


def _read_exactly(fd: int, offset: int, count: int) -> bytes:
    buffer = bytearray(count)
    _read_into(fd, offset, buffer)
    return bytes(buffer)


def _parse_config(data: bytes) -> dict:
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    return config


def _read_header(fd: int, size: int) -> tuple[bytes, dict[str, TensorSpec], dict[str, int]]:
    """The header's bytes (its length included), each tensor's spec and data offset; AdapterError unless
    the declared ranges tile the data and the data ends where the file does."""
    if size < 8:
        raise AdapterError(f"{WEIGHTS_FILE} is too short to be safetensors")
    length = int.from_bytes(_read_exactly(fd, 0, 8), "little")
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise AdapterError(f"{WEIGHTS_FILE} declares a header of {length} bytes (at most "
                           f"{min(MAX_HEADER_BYTES, size - 8)} here)")
    head = _read_exactly(fd, 0, 8 + length)
    try:
        header = json.loads(head[8:])
    except (ValueError, RecursionError):
        raise AdapterError(f"{WEIGHTS_FILE} has no valid safetensors header") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{WEIGHTS_FILE} has no valid safetensors header")
    header.pop("__metadata__", None)
    specs, ranges, end = {}, {}, 0
    for key, entry in sorted(header.items(), key=lambda item: _offsets(item[1])[0]):
        spec, (begin, stop) = _spec(entry), _offsets(entry)
        if begin != end or stop - begin != math.prod(spec.shape) * spec.dtype.itemsize:
            raise AdapterError(f"{WEIGHTS_FILE}'s tensors do not tile its data")
        specs[key], ranges[key], end = spec, begin, stop
    if 8 + length + end != size:
        raise AdapterError(f"{WEIGHTS_FILE} is {size} bytes; its header declares {8 + length + end}")
    return head, specs, ranges


def _offsets(entry: object) -> tuple[int, int]:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise AdapterError(f"{WEIGHTS_FILE} declares a tensor without valid data_offsets")
    return offsets[0], offsets[1]


def _spec(entry: dict) -> TensorSpec:
    name, shape = entry.get("dtype"), entry.get("shape")
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise AdapterError(f"{WEIGHTS_FILE} holds a tensor of a dtype other than {', '.join(DTYPES)}")
    if not (isinstance(shape, list) and len(shape) <= 8 and all(type(d) is int and d >= 0 for d in shape)):
        raise AdapterError(f"{WEIGHTS_FILE} declares a tensor without a valid shape")
    return TensorSpec(dtype, tuple(shape))
