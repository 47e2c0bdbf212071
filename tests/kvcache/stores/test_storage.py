"""Store records and the two stores: disk (one file per block, LRU budget) and Redis (real server)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.core.hashing import BlockHasher
from kvstrata.kvcache.buffers import KVCacheSpec
from kvstrata.kvcache.stores import DiskStore, RedisStore, open_store
from kvstrata.kvcache.stores.base import StoreError
from kvstrata.kvcache.stores.records import HEADER, RecordError, decode_record, encode_record, record_size
from tests.kvcache.stores.store_helpers import (RedisServer, free_port, hammer_disk_store, record_of,  # noqa: F401
                                               redis_server)

SPEC = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
FINGERPRINT = "f" * 64
TOKENS = list(range(1000, 1016))
HASH = BlockHasher.create(16, FINGERPRINT).root
PAYLOAD = torch.arange(SPEC.bytes_per_block // 4, dtype=torch.float32).numpy().tobytes()
RECORD = encode_record(SPEC, FINGERPRINT, HASH, TOKENS, PAYLOAD)
PAYLOAD_OFFSET = len(RECORD) - len(PAYLOAD) - 8
SIZE_FIELDS = range(72, HEADER.size)          # block_size, payload length: they move the end of the record
TWO = record_of(106, fill=2)                  # the shortest record


def decode(data: bytes, spec: KVCacheSpec = SPEC, fingerprint: str = FINGERPRINT, block_hash: bytes = HASH):
    return decode_record(data, spec, fingerprint, block_hash)


def reason_of(data: bytes, **kwargs) -> str:
    with pytest.raises(RecordError) as caught:
        decode(data, **kwargs)
    return caught.value.reason


# ---- records ----------------------------------------------------------------------------------------

def test_record_round_trip_is_zero_copy():
    assert len(RECORD) == record_size(SPEC) == 168 + SPEC.bytes_per_block
    tokens, payload = decode(RECORD)
    assert tokens == TOKENS
    assert payload.obj is RECORD and payload.nbytes == len(PAYLOAD)     # a view, not a copy
    assert payload == PAYLOAD
    assert PAYLOAD_OFFSET % 16 == 0


def test_record_round_trip_bfloat16():
    spec = replace(SPEC, dtype=torch.bfloat16, num_layers=2)
    payload = bytes(range(256)) * (spec.bytes_per_block // 256)
    tokens, view = decode(encode_record(spec, FINGERPRINT, HASH, TOKENS, payload), spec=spec)
    assert (tokens, bytes(view)) == (TOKENS, payload)


def expected_reason(position: int) -> set[str]:
    if position < 8:
        return {"magic"}
    if position < 12:
        return {"version"}
    if position in SIZE_FIELDS:
        return {"length", "checksum"}     # a block size that keeps the payload offset leaves the length right
    return {"checksum"}                   # any other header field, token ids, padding, payload, checksum


@settings(max_examples=150, deadline=None)
@given(position=st.one_of(st.integers(0, PAYLOAD_OFFSET - 1), st.integers(PAYLOAD_OFFSET, len(RECORD) - 1)),
       xor=st.integers(1, 255))
def test_any_flipped_byte_is_refused_with_its_reason(position, xor):
    damaged = bytearray(RECORD)
    damaged[position] ^= xor
    assert reason_of(bytes(damaged)) in expected_reason(position)


@settings(max_examples=50, deadline=None)
@given(length=st.integers(0, len(RECORD) - 1))
def test_truncated_record_is_refused(length):
    assert reason_of(RECORD[:length]) == "length"


def test_extended_record_is_refused():
    assert reason_of(RECORD + b"\0") == "length"


def test_sound_record_of_another_identity_is_refused():
    assert reason_of(RECORD, fingerprint="another model") == "fingerprint"
    assert reason_of(RECORD, block_hash=bytes(16)) == "hash"
    for change in ({"num_layers": 29}, {"num_kv_heads": 2}, {"head_dim": 32}, {"block_size": 32},
                   {"dtype": torch.bfloat16}):
        assert reason_of(RECORD, spec=replace(SPEC, **change)) == "layout", change


def test_record_refuses_a_block_that_does_not_fit_the_spec():
    with pytest.raises(ValueError, match="bytes"):
        encode_record(SPEC, FINGERPRINT, HASH, TOKENS, PAYLOAD[:-4])
    with pytest.raises(ValueError, match="tokens"):
        encode_record(SPEC, FINGERPRINT, HASH, TOKENS[:-1], PAYLOAD)
    with pytest.raises(ValueError, match="16 bytes"):
        encode_record(SPEC, FINGERPRINT, HASH[:8], TOKENS, PAYLOAD)


# ---- disk store -------------------------------------------------------------------------------------

def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def folder_bytes(store: DiskStore) -> int:
    return sum(path.stat().st_size for path in store.root.glob("*/*"))


def test_disk_put_get_exists_delete(tmp_path):
    store = DiskStore(str(tmp_path / "store"), capacity_bytes=10 * len(RECORD))
    store.put([(key(1), RECORD), (key(2), TWO)])
    assert store.exists([key(1), key(2), key(3)]) == [True, True, False]
    assert store.get([key(1), key(3), key(2)]) == [RECORD, None, TWO]
    store.delete([key(2), key(3)])
    assert store.exists([key(1), key(2)]) == [True, False]
    stats = store.stats()
    assert (stats.reads, stats.hits, stats.misses, stats.writes, stats.deletions) == (3, 2, 1, 2, 1)
    assert (stats.bytes_read, stats.bytes_written) == (len(RECORD) + len(TWO), len(RECORD) + len(TWO))
    store.close()
    with pytest.raises(StoreError) as caught:
        store.get([key(1)])
    assert caught.value.kind == "closed"


def test_disk_store_survives_a_restart_and_keeps_its_budget(tmp_path):
    path = str(tmp_path / "store")
    first = DiskStore(path, capacity_bytes=100_000)
    first.put([(key(i), record_of(10_000)) for i in range(8)])
    first.close()
    again = DiskStore(path, capacity_bytes=100_000)
    assert again.get([key(0), key(7)]) == [record_of(10_000)] * 2
    smaller = DiskStore(path, capacity_bytes=50_000)     # a smaller budget applies at open
    assert folder_bytes(smaller) <= 50_000 and smaller.stats().evictions > 0


def test_disk_deletes_least_recently_read_first(tmp_path):
    store = DiskStore(str(tmp_path / "store"), capacity_bytes=3500)
    for i in range(3):
        store.put([(key(i), record_of(1000))])
        time.sleep(0.03)                    # file times tick coarsely
    assert store.get([key(0)]) == [record_of(1000)]  # key 0 is now the most recently read
    time.sleep(0.03)
    store.put([(key(3), record_of(1000))])  # 4000 > 3500: evict down to 3150, i.e. one record
    assert store.exists([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    assert store.stats().evictions == 1


def test_disk_stays_within_budget_under_many_puts(tmp_path):
    store = DiskStore(str(tmp_path / "store"), capacity_bytes=10 * 4096)
    for i in range(60):
        store.put([(key(i), record_of(4096))])
        assert folder_bytes(store) <= 10 * 4096
    assert store.exists([key(59)]) == [True]
    assert store.stats().evictions >= 50


def test_disk_record_removed_between_exists_and_get_is_a_miss(tmp_path):
    store = DiskStore(str(tmp_path / "store"), capacity_bytes=1 << 20)
    store.put([(key(1), TWO)])
    assert store.exists([key(1)]) == [True]
    for path in store.root.glob("*/*.kvr"):
        path.unlink()                       # another engine deleted it
    assert store.get([key(1)]) == [None]
    assert store.stats().misses == 1


def test_disk_ignores_and_removes_temp_files_of_crashed_writers(tmp_path):
    store = DiskStore(str(tmp_path / "store"), capacity_bytes=1 << 20)
    shard = store.root / key(1)[:1].hex()
    stale, fresh = shard / f".tmp-{key(1).hex()}", shard / ".tmp-inprogress"
    stale.write_bytes(RECORD[:1000])        # a writer died mid-record
    fresh.write_bytes(b"partial")           # another engine is writing right now
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    assert store.exists([key(1)]) == [False] and store.get([key(1)]) == [None]
    DiskStore(str(store.root), capacity_bytes=1 << 20)     # the next sweep (here: at open) cleans up
    assert not stale.exists() and fresh.exists()


def test_disk_failures_are_store_errors(tmp_path):
    store = DiskStore(str(tmp_path / "store"), capacity_bytes=1 << 20)
    unwritable = b"\x02" * 16
    (store.root / "02").rmdir()
    (store.root / "02").write_bytes(b"")                         # a shard that cannot hold files
    with pytest.raises(StoreError):
        store.put([(unwritable, TWO)])
    shutil.rmtree(store.root)
    store.root.write_bytes(b"")                                  # a folder that cannot be read
    with pytest.raises(StoreError) as caught:
        store.get([unwritable])
    assert caught.value.kind == "io"
    assert store.stats().errors == {"io": 2} and store.stats().reads == 1


def test_disk_store_recreates_a_folder_removed_under_it(tmp_path):
    store = DiskStore(str(tmp_path / "store"), capacity_bytes=1 << 20)
    (store.root / key(1)[:1].hex()).rmdir()        # a user clearing the cache while the engine runs
    store.put([(key(1), TWO)])
    assert store.get([key(1)]) == [TWO]
    shutil.rmtree(store.root)                       # the whole folder
    assert store.get([key(1)]) == [None] and store.exists([key(1)]) == [False]
    store.put([(key(1), TWO)])
    assert store.get([key(1)]) == [TWO]


def test_disk_store_under_a_thread_pool(tmp_path):
    store = DiskStore(str(tmp_path / "store"), capacity_bytes=6 * 10_000)
    records = {key(i): record_of(10_000, fill=i) for i in range(8)}

    def work(i: int) -> int:
        k = key(i % 8)
        store.put([(k, records[k])])
        return sum(got is not None and got != records[k] for got in store.get([k]))

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(work, range(200))) == 0
    assert store.stats().writes == 200 and store.stats().reads == 200
    assert folder_bytes(store) <= 6 * 10_000


def test_two_processes_on_one_folder_never_see_a_torn_record(tmp_path):
    valid = {key(i): [encode_record(SPEC, FINGERPRINT, key(i), TOKENS, payload)
                      for payload in (PAYLOAD, bytes(len(PAYLOAD)))] for i in range(4)}
    capacity = 3 * len(RECORD)              # small: sweeps evict while the other process reads
    path = str(tmp_path / "store")
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(hammer_disk_store, [(path, capacity, valid, 1.0, seed) for seed in (1, 2)])
    gets, hits, bad = (sum(column) for column in zip(*results))
    assert bad == 0
    assert hits > 20 and gets > hits        # both hits and misses (deletes, evictions) happened
    for k, record in zip(valid, DiskStore(path, capacity).get(list(valid))):
        if record is not None:
            assert decode(record, block_hash=k)[0] == TOKENS


# ---- redis store ------------------------------------------------------------------------------------

def test_redis_batch_ops(redis_server: RedisServer):
    store = RedisStore(redis_server.url, timeout_s=1.0)
    store.put([(key(1), RECORD), (key(2), TWO)])
    assert store.exists([key(1), key(2), key(3)]) == [True, True, False]
    assert store.get([key(2), key(3), key(1)]) == [TWO, None, RECORD]
    store.delete([key(2), key(3)])
    assert store.exists([key(1), key(2)]) == [True, False]
    assert store.exists([]) == [] and store.get([]) == []
    assert redis_server.client().keys("*") == [f"kvstrata:{key(1).hex()}".encode()]
    stats = store.stats()
    assert (stats.reads, stats.hits, stats.misses, stats.writes, stats.deletions) == (3, 2, 1, 2, 1)
    assert stats.bytes_read == stats.bytes_written == len(RECORD) + len(TWO) and stats.errors == {}
    store.close()
    with pytest.raises(StoreError):
        store.exists([key(1)])


def test_redis_capacity_is_its_maxmemory_policy(redis_server: RedisServer):
    client = redis_server.client()
    # room for a few records above what the server holds now (with room for three, the evicting policy still
    # refused once in a full suite run: the server's own memory moves between calls)
    client.config_set("maxmemory", client.info("memory")["used_memory"] + 6 * len(RECORD))
    store = RedisStore(redis_server.url, timeout_s=1.0)
    with pytest.raises(StoreError) as caught:           # the default noeviction policy refuses
        for i in range(8):
            store.put([(key(i), RECORD)])
    assert caught.value.kind == "full"
    client.config_set("maxmemory-policy", "allkeys-lru")
    for i in range(8, 16):
        store.put([(key(i), RECORD)])                   # the documented policy evicts instead
    assert store.exists([key(15)]) == [True] and sum(store.exists([key(i) for i in range(16)])) < 8


def test_redis_store_under_a_thread_pool(redis_server: RedisServer):
    store = RedisStore(redis_server.url, timeout_s=1.0)

    def work(i: int) -> bool:
        store.put([(key(i), record_of(1000, fill=i % 256))])
        return store.get([key(i)]) == [record_of(1000, fill=i % 256)]

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(100)))


def test_redis_restart_between_calls_is_invisible(redis_server: RedisServer):
    store = RedisStore(redis_server.url, timeout_s=1.0)
    store.put([(key(1), TWO)])
    redis_server.kill()
    redis_server.start()                    # the pooled connection is now stale
    assert store.get([key(1)]) == [None]    # retried on a fresh connection; the data went with the server
    assert store.stats().errors == {}


def test_redis_down_fails_fast_then_recovers(redis_server: RedisServer):
    store = RedisStore(redis_server.url, timeout_s=1.0)
    store.put([(key(1), TWO)])
    redis_server.kill()
    start = time.monotonic()
    for attempt in range(20):
        with pytest.raises(StoreError) as caught:
            store.get([key(1)])
        assert caught.value.kind == "connection"
        assert ("next try in" in str(caught.value)) == (attempt > 0)    # the breaker answers, not Redis
    assert time.monotonic() - start < 0.5
    redis_server.start()
    time.sleep(1.1)                         # the breaker's cooldown
    store.put([(key(2), record_of(200))])         # the same store object works again
    assert store.get([key(2)]) == [record_of(200)]
    assert store.stats().errors == {"connection": 20}


def test_redis_hung_server_times_out(redis_server: RedisServer):
    store = RedisStore(redis_server.url, timeout_s=0.2)
    os.kill(redis_server.process.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(StoreError) as caught:
            store.put([(key(1), TWO)])
        assert caught.value.kind == "timeout"
        for _ in range(5):
            with pytest.raises(StoreError, match="next try in"):
                store.exists([key(1)])      # fails fast: no more waits on the timeout
        assert time.monotonic() - start < 0.6     # not 6 * 0.2 s
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)


def test_redis_unreachable_at_start_still_opens():
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    with pytest.raises(StoreError):
        store.get([key(1)])


# ---- open_store -------------------------------------------------------------------------------------

def test_open_store(tmp_path):
    assert open_store("none", str(tmp_path), 1 << 20, 1.0) is None
    disk = open_store("disk", str(tmp_path / "store"), 1 << 20, 1.0)
    assert isinstance(disk, DiskStore) and disk.root == tmp_path / "store"
    assert isinstance(open_store(f"redis://127.0.0.1:{free_port()}/0", str(tmp_path), 1 << 20, 0.5), RedisStore)
    with pytest.raises(ValueError, match="none, disk, a redis://host:port/db URL or a redis\\+cluster://"):
        open_store("s3://bucket", str(tmp_path), 1 << 20, 1.0)
