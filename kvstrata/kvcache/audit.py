"""The tier manager's audit (DESIGN.md §4): every pool checked against what holds its blocks.

A pool checks itself (conservation, states, the hash index) but cannot know who holds a block;
that is counted here from the block tables, the samples' places and the load records, and passed
to its `audit`. The announced hashes are checked against the tables they were announced from.

The audit runs between steps, when no speculative step is in progress: no table holds a slot for a
draft token, nor any block past those its request's known tokens fill.
"""

from __future__ import annotations

import math

from kvstrata.core.hashing import BlockHash
from kvstrata.core.request import RequestStatus
from kvstrata.kvcache.block_pool import BlockPool, PoolCounts
from kvstrata.kvcache.block_tables import BlockTables, RequestBlocks
from kvstrata.kvcache.kv_groups import KVGroups
from kvstrata.kvcache.transfers import LoadTransfer


def pool_counts(device: BlockPool, host: BlockPool | None) -> dict[str, PoolCounts]:
    counts = {"device": device.counts()}
    if host is not None:
        counts["host"] = host.counts()
    return counts


def audit_tiers(tables: BlockTables, orphans: list[LoadTransfer], device: BlockPool,
                host: BlockPool | None, block_size: int, groups: KVGroups | None = None) -> dict[str, PoolCounts]:
    """Check every pool against the block tables and transfer records; raise AuditError naming blocks."""
    for rid, rb in tables.by_request.items():
        assert rb.num_draft_tokens == 0, f"{rid} still holds {rb.num_draft_tokens} draft slots after its step"
        assert len(rb.blocks) <= math.ceil(rb.request.num_tokens / block_size), \
            f"{rid} holds {len(rb.blocks)} blocks for {rb.request.num_tokens} tokens"
        _check_groups(rb, tables, groups, block_size)
    holders, in_flight, announced = _holdings(tables)
    for load in orphans:
        assert load.orphaned, "an orphaned load still names a request"
        in_flight.extend(block.block_id for block in load.targets)
    assert len(in_flight) == len(set(in_flight)), "a block is the target of two loads"
    assert {rid for rid, rb in tables.by_request.items() if rb.load} == set(tables.loading), "loading index is stale"
    assert set(tables.restarts) <= set(tables.by_request).difference(tables.loading), "a restart holds nothing or loads"
    assert announced == tables.computing, "announced block hashes disagree with the block tables"
    counts = {"device": device.audit(holders, in_flight)}
    if host is not None:
        counts["host"] = host.audit({})
    return counts


def _check_groups(rb: RequestBlocks, tables: BlockTables, groups: KVGroups | None, block_size: int) -> None:
    """Every group's table is as long as group 0's; a sliding group holds no page before the window of the first
    token to compute (once its load lands), but while samples wait to fork from the request's prompt, and every
    page from it on. A request to start over holds what it took until it is preempted."""
    rid, num_groups = rb.request.request_id, 1 if groups is None else groups.num_groups
    assert len(rb.extra) == num_groups - 1, f"{rid} holds {1 + len(rb.extra)} block tables for {num_groups} KV groups"
    if rid in tables.restarts:
        return
    position = rb.request.num_computed_tokens + (rb.load.num_group0 * block_size if rb.load is not None else 0)
    for group, table in enumerate(rb.extra, 1):
        assert len(table) == len(rb.blocks), f"{rid}: group {group}'s table is {len(table)} long, not {len(rb.blocks)}"
        first = groups.first_needed(group, position, block_size)
        assert all(block is not None for block in table[first:]), f"{rid}: group {group} lost a page of its window"
        assert tables.leads_forks(rb.request) or all(block is None for block in table[:first]), \
            f"{rid}: group {group} holds a page before its window (block {first})"


def _holdings(tables: BlockTables) -> tuple[dict[int, int], list[int], dict[BlockHash, int]]:
    """What the tables and the samples' places hold: holders per device block, the blocks their
    loads hold IN_FLIGHT, and the hashes they announce (with how many announce each)."""
    holders: dict[int, int] = {}
    in_flight: list[int] = []
    announced: dict[BlockHash, int] = {}
    for rb in tables.by_request.values():
        assert not rb.request.is_finished, f"finished request {rb.request.request_id} still holds blocks"
        assert rb.num_registered <= rb.num_announced <= len(rb.blocks), f"{rb.request.request_id} announcements"
        for block_hash in rb.request.block_hashes[rb.num_registered:rb.num_announced]:
            announced[block_hash] = announced.get(block_hash, 0) + 1
        loading = {id(b) for b in rb.load.targets} if rb.load else set()
        assert rb.load is None or rb.load.request is rb.request, "a load record lost its request"
        for block in rb.held():
            if id(block) in loading:
                in_flight.append(block.block_id)
            else:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
    for sample_id, pending in tables.forks.items():
        leader = pending.request.family.leader
        assert pending.request.status is RequestStatus.AWAITING_FORK and tables.holds(leader.request_id), \
            f"sample {sample_id} has a place but its leader {leader.request_id} holds no blocks"
        for block in ([pending.block] if pending.block is not None else []) + pending.extra:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
    return holders, in_flight, announced


def snapshot_tiers(tables: BlockTables, device: BlockPool, host: BlockPool | None, with_order: bool = True) -> tuple:
    """Pools and block tables as a value, for tests to compare before and after (a rollback changes nothing)."""
    return (device.snapshot(with_order), host.snapshot(with_order) if host else None,
            tuple(sorted((rid, tuple(rb.block_ids), tuple(map(tuple, rb.extra_ids)))
                         for rid, rb in tables.by_request.items())))
