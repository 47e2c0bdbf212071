"""BlockPool on tiny pools: exact block ids, refcounts and LRU order after each operation."""

import pytest

from kvstrata.core.hashing import BlockHasher
from kvstrata.kvcache.block_pool import AuditError, BlockPool, BlockState

HASHER = BlockHasher.create(4, "pool-test")


def hashes_of(tokens):
    out = []
    HASHER.extend(out, tokens)
    return out


def fill(pool, blocks, tokens):
    """Register `blocks` as holding consecutive 4-token blocks of `tokens`."""
    for i, (block, block_hash) in enumerate(zip(blocks, hashes_of(tokens))):
        assert pool.register(block, block_hash, tokens[4 * i:4 * i + 4])


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocate_takes_lowest_ids_and_sets_refcount():
    pool = BlockPool(11)
    blocks, evicted = pool.allocate(3)
    assert ids(blocks) == [0, 1, 2] and evicted == []
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.counts().used == 3 and pool.num_free == 8
    pool.audit({0: 1, 1: 1, 2: 1})


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    before = pool.snapshot()
    assert pool.allocate(2) is None
    assert pool.snapshot() == before


def test_free_tail_first_orders_the_lru():
    pool = BlockPool(11)
    tokens = list(range(12))
    blocks, _ = pool.allocate(3)
    fill(pool, blocks, tokens)
    pool.free(reversed(blocks))                 # tail first
    assert pool.lru_order() == [2, 1, 0]        # the chain's tail is evicted first
    assert all(b.state is BlockState.CACHED and b.ref_cnt == 0 for b in blocks)
    pool.audit({})


def test_unhashed_blocks_go_back_to_the_free_list():
    pool = BlockPool(4)
    blocks, _ = pool.allocate(2)
    pool.free(blocks)
    assert pool.free_order() == [2, 3, 0, 1] and pool.num_cached == 0


def test_hit_touches_cached_block_and_removes_it_from_lru():
    pool = BlockPool(11)
    tokens = list(range(8))
    blocks, _ = pool.allocate(2)
    fill(pool, blocks, tokens)
    pool.free(reversed(blocks))
    h0, h1 = hashes_of(tokens)
    hit = pool.lookup(h0, tokens[:4])
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.state is BlockState.USED and hit.ref_cnt == 1
    assert pool.lru_order() == [1]
    pool.touch([hit])                            # a second request shares it
    assert hit.ref_cnt == 2
    pool.audit({0: 2})


def test_lookup_compares_token_ids_not_only_the_hash():
    pool = BlockPool(4)
    tokens = [1, 2, 3, 4]
    blocks, _ = pool.allocate(1)
    fill(pool, blocks, tokens)
    (h0,) = hashes_of(tokens)
    assert pool.lookup(h0, tokens) is blocks[0]
    assert pool.lookup(h0, [1, 2, 3, 5]) is None   # a forged collision never hits


def test_eviction_takes_free_blocks_before_cached_ones_then_lru():
    pool = BlockPool(5)
    a, _ = pool.allocate(2)
    fill(pool, a, list(range(8)))
    b, _ = pool.allocate(2)
    fill(pool, b, list(range(100, 108)))
    pool.free(reversed(a))       # LRU: 1, 0
    pool.free(reversed(b))       # LRU: 1, 0, 3, 2
    assert pool.lru_order() == [1, 0, 3, 2] and pool.free_order() == [4]
    got, evicted = pool.allocate(3)
    assert ids(got) == [4, 1, 0]                 # the free block first, then the LRU head
    assert [e.block_id for e in evicted] == [1, 0]
    assert got[1].block_hash is None and not pool.contains(evicted[0].block_hash)
    assert pool.lru_order() == [3, 2]
    pool.audit({4: 1, 1: 1, 0: 1})


def test_register_duplicate_leaves_block_unhashed():
    pool = BlockPool(4)
    tokens = [7, 7, 7, 7]
    (h,) = hashes_of(tokens)
    first, _ = pool.allocate(1)
    second, _ = pool.allocate(1)
    assert pool.register(first[0], h, tokens)
    assert not pool.register(second[0], h, tokens)
    assert second[0].block_hash is None
    pool.free(second)
    assert second[0].state is BlockState.FREE     # the duplicate does not linger in the cache
    pool.audit({0: 1})


def test_double_free_is_caught():
    pool = BlockPool(4)
    blocks, _ = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks)


def test_transfer_lifecycle():
    pool = BlockPool(4)
    targets, _ = pool.start_transfer(2)
    assert [b.state for b in targets] == [BlockState.IN_FLIGHT] * 2
    assert pool.counts().in_flight == 2
    pool.audit({}, in_flight=[0, 1])
    (h0, h1) = hashes_of(list(range(8)))
    assert pool.end_transfer(targets[0], BlockState.USED, h0, range(4))
    assert pool.end_transfer(targets[1], BlockState.CACHED, h1, range(4, 8))
    assert targets[0].ref_cnt == 1 and pool.lru_order() == [1]
    pool.audit({0: 1})


def test_unevict_restores_cached_blocks_at_lru_head():
    pool = BlockPool(3)
    blocks, _ = pool.allocate(3)
    fill(pool, blocks, list(range(12)))
    pool.free(reversed(blocks))
    before = pool.snapshot()
    got, evicted = pool.allocate(2)
    pool.free(reversed(got))
    pool.unevict(evicted)
    assert pool.snapshot(with_order=False) == before[:2]
    assert pool.lru_order() == [2, 1, 0]


@pytest.mark.parametrize("corrupt, problem, bad", [
    (lambda p: setattr(p.blocks[2], "ref_cnt", 2), "refcount differs", [2]),
    (lambda p: p._free.append(p.blocks[5]), "listed twice", [5]),
    (lambda p: setattr(p.blocks[6], "state", BlockState.USED), "state disagrees", [6]),
    (lambda p: setattr(p.blocks[0], "block_hash", b"x" * 16), "hash index", [0]),
    (lambda p: setattr(p.blocks[7], "state", BlockState.IN_FLIGHT), "state disagrees", [7]),
])
def test_audit_names_the_offending_blocks(corrupt, problem, bad):
    pool = BlockPool(8)
    blocks, _ = pool.allocate(3)
    fill(pool, blocks[:1], [1, 2, 3, 4])
    corrupt(pool)
    with pytest.raises(AuditError, match=problem) as info:
        pool.audit({0: 1, 1: 1, 2: 1})
    assert info.value.block_ids == bad


def test_audit_catches_a_leaked_block():
    """A block taken out of the pool's lists but owned by nobody: the FastDeploy leak."""
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(AuditError, match="refcount differs") as info:
        pool.audit({})               # no request table holds block 0
    assert info.value.block_ids == [0]


def test_scatter_free_lays_a_fresh_pool_out_as_after_traffic():
    import random

    pool = BlockPool(64)
    pool.scatter_free(random.Random(0))
    blocks, _ = pool.allocate(64)
    ids = [b.block_id for b in blocks]
    assert sorted(ids) == list(range(64)) and ids != list(range(64)), "every block, not in order"
    pool.audit({i: 1 for i in ids})
    pool.free(blocks[:1])
    with pytest.raises(AssertionError, match="every block free"):
        pool.scatter_free(random.Random(0))                  # a pool in use keeps its layout
