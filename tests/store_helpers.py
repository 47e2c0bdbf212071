"""Store test helpers: a real redis-server on a free loopback port, and a disk-store worker process.

Importing this module must stay light (no torch): the worker runs in spawned processes.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from kvstrata.kvcache.storage import DiskStore

INSTALL_REDIS = ("redis-server is not installed; the Redis store tests need it: "
                 "apt-get install -y --no-install-recommends redis-server "
                 "(or set KVSTRATA_SKIP_REDIS=1 to skip them)")


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

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory)],
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
    """A running redis-server; fails (does not skip) when redis-server is missing."""
    if os.environ.get("KVSTRATA_SKIP_REDIS") == "1":
        pytest.skip("KVSTRATA_SKIP_REDIS=1")
    if shutil.which("redis-server") is None:
        pytest.fail(INSTALL_REDIS)
    server = RedisServer(free_port(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.process.kill()
        server.process.wait()


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
