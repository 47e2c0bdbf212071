"""Block hashes are chained, rooted in (model, salt), and identical in every process."""

import subprocess
import sys

from kvstrata.core.hashing import BlockHasher, chain_root, encode_tokens, hash_block

TOKENS = list(range(100, 140))


def hashes(hasher, tokens):
    out = []
    hasher.extend(out, tokens)
    return out


def test_only_full_blocks_are_hashed_and_extension_is_incremental():
    hasher = BlockHasher.create(16, "m")
    out = hashes(hasher, TOKENS)                 # 40 tokens: 2 full blocks
    assert len(out) == 2
    grown = list(out)
    hasher.extend(grown, TOKENS + list(range(8)))
    assert grown[:2] == out and len(grown) == 3


def test_hash_chains_through_the_prefix():
    hasher = BlockHasher.create(4, "m")
    a = hashes(hasher, [1, 2, 3, 4, 5, 6, 7, 8])
    b = hashes(hasher, [9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]                          # same block tokens, different prefix
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])


def test_root_depends_on_model_and_salt():
    roots = {chain_root("model-a"), chain_root("model-b"), chain_root("model-a", "tenant-1")}
    assert len(roots) == 3


def test_canonical_encoding_is_little_endian_uint32():
    assert encode_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_hashes_are_stable_across_processes():
    """A fresh interpreter (new hash seed) computes the same bytes: stores can be shared."""
    code = ("from kvstrata.core.hashing import BlockHasher\n"
            "out = []\nBlockHasher.create(16, 'm', 'salt').extend(out, list(range(100, 140)))\n"
            "print(','.join(h.hex() for h in out))")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345"})
    assert child.stdout.strip() == ",".join(h.hex() for h in hashes(BlockHasher.create(16, "m", "salt"), TOKENS))


def test_hash_format_is_pinned():
    """Changing the hash scheme orphans every record in every store: do it on purpose only."""
    out = hashes(BlockHasher.create(4, "fingerprint", "salt"), [1, 2, 3, 4])
    assert out[0].hex() == GOLDEN


GOLDEN = "2c29402e361525775e442231a73c50d8"   # xxh3-128, format kvstrata-block-hash/1
