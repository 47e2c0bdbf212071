"""Hostile things in a store's place (issue 61): the store never leaves its folder, never reads a value
that is not a record of its length, never writes a byte of one into a log line, and never hangs on one.

Each is a miss (the engine recomputes), counted as `refused`; nothing outside the folder is opened,
touched, created or deleted.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import redis

from kvstrata.kvcache.stores import DiskStore, RedisStore, open_store
from kvstrata.kvcache.stores.base import StoreError
from kvstrata.kvcache.stores.records import HEADER
from tests.kvcache.stores.store_helpers import (RedisServer, record_of, redis_cluster,  # noqa: F401  (fixtures)
                                               redis_server)

SECRET = b"root:x:0:0:the secret of /etc/passwd\n" * 8
LONG_AGO = (1_000_000_000, 1_000_000_000)          # atime, mtime of the files outside, so a touch shows


def key(i: int) -> bytes:
    return bytes([i]) * 16


def record_path(store: DiskStore, k: bytes) -> Path:
    return store.root / k[:1].hex() / f"{k.hex()}.kvr"


def snapshot(folder: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file under `folder`: its bytes and times (ns), to show nothing there changed."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_atime_ns, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def store(tmp_path) -> DiskStore:
    return DiskStore(str(tmp_path / "store"), capacity_bytes=1 << 20)


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder beside the store's: a passwd-like file, and a sound record that a link could pass off as ours."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "passwd").write_bytes(SECRET)
    (folder / f"{key(1).hex()}.kvr").write_bytes(record_of(200))
    for path in folder.iterdir():
        os.utime(path, LONG_AGO)
    return folder


# ---- disk: links ------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["passwd", "record"])
def test_a_record_that_links_outside_is_a_miss_never_followed(store, outside, target, caplog):
    path = record_path(store, key(1))
    path.symlink_to(outside / ("passwd" if target == "passwd" else f"{key(1).hex()}.kvr"))
    before = snapshot(outside)
    with caplog.at_level(logging.DEBUG):
        assert store.exists([key(1)]) == [False]
        assert store.get([key(1)]) == [None]
    assert snapshot(outside) == before                  # not read (atime), not touched (mtime), still there
    assert SECRET[:8].decode() not in caplog.text and key(1).hex() in caplog.text    # the name, never the bytes
    assert not os.path.lexists(path) and store.stats().refused == 1     # the link is removed, as a bad record is
    path.symlink_to(outside / "passwd")
    store.delete([key(1)])                              # removes the link, never what it points to
    store.put([(key(1), record_of(300))])               # replaces the link, never writes through it
    assert store.get([key(1)]) == [record_of(300)]
    assert snapshot(outside) == before


def test_a_shard_that_links_outside_is_never_entered(tmp_path, outside):
    store = DiskStore(str(tmp_path / "store"), capacity_bytes=2000)
    shard = store.root / key(1)[:1].hex()
    shard.rmdir()
    shard.symlink_to(outside, target_is_directory=True)
    (outside / ".tmp-crashed").write_bytes(b"x")
    os.utime(outside / ".tmp-crashed", LONG_AGO)        # what a sweep would remove, were it in the folder
    before = snapshot(outside)
    assert store.exists([key(1)]) == [False] and store.get([key(1)]) == [None]
    store.delete([key(1)])
    with pytest.raises(StoreError):                     # a write that has nowhere to go is refused
        store.put([(key(1), record_of(200))])
    for i in range(2, 6):
        store.put([(key(i), record_of(600))])           # over the budget: sweeps, which skip the link
    assert store.stats().evictions > 0
    assert snapshot(outside) == before and sorted(p.name for p in outside.iterdir()) == sorted(before)
    with pytest.raises(ValueError, match="cannot use"):
        DiskStore(str(store.root), capacity_bytes=2000)  # a store does not open on it


def test_a_shard_swapped_for_a_link_mid_put_cannot_redirect_the_write(store, outside, monkeypatch):
    shard = store.root / key(1)[:1].hex()
    real_replace = os.replace

    def swap_then_replace(*args, **kwargs):
        shard.rename(shard.with_name("moved"))
        shard.symlink_to(outside, target_is_directory=True)
        return real_replace(*args, **kwargs)

    before = snapshot(outside)
    monkeypatch.setattr(os, "replace", swap_then_replace)
    store.put([(key(1), record_of(400))])
    assert snapshot(outside) == before                  # the record went to the folder the put had opened
    assert (shard.with_name("moved") / f"{key(1).hex()}.kvr").read_bytes() == record_of(400)


# ---- disk: values that are not a record of their length ---------------------------------------------

@pytest.fixture
def bytes_read(monkeypatch) -> list[int]:
    """Counts every byte os.read and os.pread return from now on."""
    counted = [0]
    for name in ("read", "pread"):
        real = getattr(os, name)

        def counting(*args, _real=real):
            data = _real(*args)
            counted[0] += len(data)
            return data

        monkeypatch.setattr(os, name, counting)
    return counted


@pytest.mark.parametrize("head", ["zeros", "a record's"])
def test_a_sparse_giant_in_a_records_place_is_not_read(store, head, bytes_read):
    path = record_path(store, key(1))
    path.write_bytes(b"" if head == "zeros" else record_of(200))
    os.truncate(path, 1 << 30)                          # 1 GB, sparse: its header (if any) says 200
    bytes_read[0] = 0
    assert store.get([key(1)]) == [None]
    assert bytes_read[0] <= HEADER.size                 # its header at most, never its body
    assert store.stats().refused == 1 and not path.exists()


def test_a_record_shorter_than_its_header_says_is_a_miss(store):
    path = record_path(store, key(1))
    path.write_bytes(record_of(200)[:-1])
    assert store.get([key(1)]) == [None] and store.stats().refused == 1


def test_a_fifo_or_a_folder_in_a_records_place_is_a_miss_without_a_hang(store, caplog):
    fifo, folder = record_path(store, key(1)), record_path(store, key(2))
    os.mkfifo(fifo)
    folder.mkdir()
    got: list = []
    reader = threading.Thread(target=lambda: got.append(store.get([key(1), key(2)])), daemon=True)
    reader.start()
    reader.join(timeout=10)
    try:
        assert not reader.is_alive(), "a get blocked on a FIFO in a record's place"
    finally:
        if reader.is_alive():                           # let the blocked open return, so the thread ends
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert got == [[None, None]] and store.stats().refused == 2
    assert store.exists([key(1), key(2)]) == [False, False]
    assert not os.path.lexists(fifo) and folder.is_dir()    # a FIFO is removed; a folder is left
    assert "refused" in caplog.text


# ---- redis ------------------------------------------------------------------------------------------

def write_hostile(client, k: bytes, kind: int) -> None:
    """Under our key: a record with bytes after it, a torn record, a passwd file, 8 MB of junk, or a list."""
    name, good = f"kvstrata:{k.hex()}", record_of(200)
    if kind == 4:
        client.rpush(name, good)
    else:
        client.set(name, (good + b"and more", good[:-1], SECRET, os.urandom(8 << 20))[kind])


def test_redis_values_not_of_their_records_length_are_misses_never_read(redis_server: RedisServer, caplog):
    client = redis_server.client()
    store = RedisStore(redis_server.url, timeout_s=1.0)
    hostile = [key(i) for i in range(1, 6)]
    for kind, k in enumerate(hostile):
        write_hostile(client, k, kind)
    store.put([(key(9), record_of(300))])
    sent = client.info("stats")["total_net_output_bytes"]
    records = store.get([*hostile, key(9)])
    assert records == [None] * 5 + [record_of(300)]
    assert client.info("stats")["total_net_output_bytes"] - sent < 64 << 10    # not the 8 MB, nor any tail
    assert store.exists(hostile) == [False] * 5         # deleted, as a bad record is
    stats = store.stats()
    assert (stats.refused, stats.hits, stats.misses, stats.errors) == (5, 1, 5, {})
    assert SECRET[:8].decode() not in caplog.text and hostile[2].hex() in caplog.text


def test_redis_cluster_values_not_of_their_records_length_are_misses(redis_cluster):  # noqa: F811
    store = open_store(redis_cluster.url, None, 1, 0.5)
    client = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.masters[0].port)
    hostile = [key(i) for i in range(1, 6)]
    for kind, k in enumerate(hostile):
        write_hostile(client, k, kind)
    client.close()
    store.put([(key(9), record_of(300))])
    assert store.get([*hostile, key(9)]) == [None] * 5 + [record_of(300)]
    assert store.exists(hostile) == [False] * 5
    assert store.stats().refused == 5 and store.stats().errors == {}
