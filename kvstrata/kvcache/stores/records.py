"""The byte format of one block in a store: a checked header, the block's token ids, raw KV bytes.

Never pickle: a record is read by other engines, other versions, other machines, so every field
has an explicit little-endian layout, and nothing in it is executed.

    offset  size       field
    0       8          magic b"KVSTRATA"
    8       4   u32    format version (RECORD_VERSION)
    12      16         xxh3-128 of the model fingerprint (utf-8)
    28      16         block hash (the store key, repeated: a record under the wrong key is refused)
    44      16         dtype name, ascii, NUL-padded ("float32", "bfloat16")
    60      4x4 u32    num_layers, num_kv_heads, head_dim, block_size
    76      8   u64    payload length
    84      4*bs u32   token ids of the block (block_size of them)
    ...     0..15      zero padding, so the payload starts 16-byte aligned
    P       len        payload: the block's (L, 2, KVH, bs, D) slab, C order (KVCacheSpec.block_shape)
    end-8   8   u64    xxh3-64 of every byte before it

Decoding checks in this order, and the first failure names the `RecordError.reason`:
structure ("length", "magic", "version"), then integrity ("checksum"), then identity
("fingerprint", "layout", "hash"). So a flipped bit anywhere reads as "checksum" (or as
"magic"/"version"/"length" where it breaks the structure), while a sound record of another model,
spec or key reads as the identity it fails. The token ids are returned, not checked: the caller
compares them with the request's tokens, so a hash collision can never serve the wrong KV.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from kvstrata.core.hashing import encode_tokens

if TYPE_CHECKING:                 # a type only: the stores import this module, and must not import torch
    from kvstrata.kvcache.buffers import KVCacheSpec

MAGIC = b"KVSTRATA"
RECORD_VERSION = 1
HEADER = struct.Struct("<8sI16s16s16sIIIIQ")
CHECKSUM = struct.Struct("<Q")
PAYLOAD_ALIGN = 16

REASONS = ("length", "magic", "version", "checksum", "fingerprint", "layout", "hash", "tokens")   # metric labels


class RecordError(ValueError):
    """A record that must not be used; `reason` (one of REASONS) is fit for a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, f"unknown record error reason {reason!r}"
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _payload_offset(block_size: int) -> int:
    end = HEADER.size + 4 * block_size
    return -(-end // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def _dtype_name(spec: KVCacheSpec) -> bytes:
    return str(spec.dtype).removeprefix("torch.").encode("ascii")


def _fingerprint_digest(model_fingerprint: str) -> bytes:
    return xxhash.xxh3_128_digest(model_fingerprint.encode())


def declared_size(head: bytes | bytearray | memoryview) -> int:
    """The length in bytes of the record that begins with `head` (its first HEADER.size bytes or more),
    as its header declares it. A store reads this much of a value, and checks that the value is this
    long, before it reads the rest: so a foreign or torn value is never read whole.

    Raises RecordError ("length", "magic", "version") if `head` is no header of this format.
    """
    view = memoryview(head).cast("B")
    if view.nbytes < HEADER.size:
        raise RecordError("length", f"{view.nbytes} bytes is shorter than a header")
    magic, version, *_, block_size, payload_len = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise RecordError("magic", "not a kvstrata record")
    if version != RECORD_VERSION:
        raise RecordError("version", f"record format {version}, this build reads {RECORD_VERSION}")
    return _payload_offset(block_size) + payload_len + CHECKSUM.size


def record_size(spec: KVCacheSpec) -> int:
    """Bytes of one record for `spec` (what a store holds per block)."""
    return _payload_offset(spec.block_size) + spec.bytes_per_block + CHECKSUM.size


def encode_record(spec: KVCacheSpec, model_fingerprint: str, block_hash: bytes, token_ids: Sequence[int],
                  payload: bytes | bytearray | memoryview) -> bytes:
    """One record; ValueError if the block does not match `spec` (a caller bug, not bad data)."""
    if len(block_hash) != 16:
        raise ValueError(f"a block hash has 16 bytes, not {len(block_hash)}")
    if len(token_ids) != spec.block_size:
        raise ValueError(f"a record holds one full block of {spec.block_size} tokens, not {len(token_ids)}")
    payload = memoryview(payload).cast("B")
    if payload.nbytes != spec.bytes_per_block:
        raise ValueError(f"block payload has {payload.nbytes} bytes, expected {spec.bytes_per_block}")
    header = HEADER.pack(MAGIC, RECORD_VERSION, _fingerprint_digest(model_fingerprint), bytes(block_hash),
                         _dtype_name(spec), spec.page_layers, spec.num_kv_heads, spec.head_dim,
                         spec.block_size, payload.nbytes)
    tokens = encode_tokens(token_ids)
    padding = bytes(_payload_offset(spec.block_size) - HEADER.size - len(tokens))
    checksum = xxhash.xxh3_64()
    for part in (header, tokens, padding, payload):
        checksum.update(part)
    return b"".join((header, tokens, padding, payload, CHECKSUM.pack(checksum.intdigest())))


def decode_record(data: bytes | bytearray | memoryview, spec: KVCacheSpec, model_fingerprint: str,
                  block_hash: bytes) -> tuple[list[int], memoryview]:
    """(token ids, payload) of a record, the payload a zero-copy view into `data`.

    Raises RecordError if the record is damaged or is not this model's block `block_hash` in `spec`.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER.size + CHECKSUM.size:
        raise RecordError("length", f"{view.nbytes} bytes is shorter than a header")
    size = declared_size(view)
    if view.nbytes != size:
        raise RecordError("length", f"{view.nbytes} bytes, the header says {size}")
    (_, _, fingerprint, stored_hash, dtype, num_layers, num_kv_heads, head_dim, block_size,
     payload_len) = HEADER.unpack_from(view)
    offset = _payload_offset(block_size)
    body = view[:-CHECKSUM.size]
    (checksum,) = CHECKSUM.unpack_from(view, body.nbytes)
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise RecordError("checksum", "record bytes do not match their checksum")
    if fingerprint != _fingerprint_digest(model_fingerprint):
        raise RecordError("fingerprint", "record written by another model")
    layout = (dtype.rstrip(b"\0"), num_layers, num_kv_heads, head_dim, block_size, payload_len)
    expected = (_dtype_name(spec), spec.page_layers, spec.num_kv_heads, spec.head_dim, spec.block_size,
                spec.bytes_per_block)
    if layout != expected:
        raise RecordError("layout", f"record layout {layout} differs from the cache's {expected}")
    if stored_hash != block_hash:
        raise RecordError("hash", "record stored under another block's key")
    token_ids = list(struct.unpack_from(f"<{block_size}I", view, HEADER.size))
    return token_ids, view[offset:offset + payload_len]
