"""Chained, process-stable hashes of full KV blocks.

A block's hash covers its own token ids and, through its parent's hash, every
token before it, so equal hashes mean equal prefixes. The chain is rooted in
(model fingerprint, cache salt): KV computed by another model, or for another
tenant, can never match. A request under a LoRA adapter chains from that root
salted by the digest of the adapter's files (`adapter_root`), never by its name,
so two adapters loaded under one name (a reload with new weights) never share a
block, and whoever knows a base root and a digest (a router, a decode engine, the
simulator) derives the adapter's root.

Stores are shared by many engines on many machines, so the hash must be the same
everywhere: xxh3-128 over a canonical byte encoding (little-endian uint32 token
ids), never Python's `hash()` and never a random seed. A hash is only a lookup
key: every hit also compares token ids, so a collision can never serve wrong KV.

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]        (block_size 16)
    hashes:  h0 = H(root, t0..15)
             h1 = H(h0, t16..31)                        the partial block has no hash
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

BlockHash = bytes  # 16 bytes

HASH_FORMAT_VERSION = b"kvstrata-block-hash/1"


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Canonical bytes of token ids: little-endian uint32, the same on every machine."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def chain_root(model_fingerprint: str, cache_salt: str = "") -> BlockHash:
    """The parent hash of a sequence's first block."""
    material = b"\0".join((HASH_FORMAT_VERSION, model_fingerprint.encode(), cache_salt.encode()))
    return hashlib.sha256(material).digest()[:16]


def adapter_root(base_root: BlockHash, adapter_digest: str) -> BlockHash:
    """The parent hash of the first block of a sequence under a LoRA adapter: the base model's root
    salted by the digest of the adapter's files."""
    assert adapter_digest, "an adapter is keyed by its digest"
    return hashlib.sha256(b"\0".join((HASH_FORMAT_VERSION, base_root, b"lora", adapter_digest.encode()))).digest()[:16]


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    return xxhash.xxh3_128_digest(parent + encode_tokens(token_ids))


@dataclass(frozen=True)
class BlockHasher:
    """Extends a sequence's list of block hashes as its tokens fill blocks."""

    block_size: int
    root: BlockHash

    @classmethod
    def create(cls, block_size: int, model_fingerprint: str, cache_salt: str = "") -> BlockHasher:
        return cls(block_size, chain_root(model_fingerprint, cache_salt))

    def for_adapter(self, adapter_digest: str) -> BlockHasher:
        """This hasher for requests under the LoRA adapter with this digest."""
        return BlockHasher(self.block_size, adapter_root(self.root, adapter_digest))

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int]) -> None:
        """Append the hash of every block of `token_ids` that is full but not yet hashed."""
        size = self.block_size
        for index in range(len(hashes), len(token_ids) // size):
            parent = hashes[-1] if hashes else self.root
            hashes.append(hash_block(parent, token_ids[index * size:(index + 1) * size]))
