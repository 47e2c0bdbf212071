"""`RedisClusterStore`: the store over a Redis Cluster (`--store redis+cluster://host:port,host:port`).

Keys (`kvstrata:<hash hex>`, no hash tags) spread over the cluster's 16384 hash slots, so blocks
spread over its masters. Every batch is split by the node that owns each key's slot and sent as one
pipeline per node (redis-py's cluster client maps keys to nodes; its own multi-key commands would
refuse keys of different slots). Each node has its own circuit breaker, so a master that dies costs
misses (gets) and dropped writes (puts) for the keys it owned, counted as errors, while the other
masters go on answering: a batch never fails as a whole, and nothing reaches the engine's clients.
A get is two such rounds, so a value is read only once it is a record of its length, and no further
(kvstrata.kvcache.stores.redis_reads).

Run the cluster with `cluster-require-full-coverage no`, or every master refuses every key while
one master is down; a cluster whose slots moved (MOVED replies) is re-read on the next batch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kvstrata.kvcache.stores.base import REDIS_PREFIX, Breaker, Counters, StoreError, StoreStats, guard
from kvstrata.kvcache.stores.redis_reads import Command, checked, grouped, plan, probe, value

logger = logging.getLogger(__name__)

SCHEME = "redis+cluster://"


def parse_cluster_url(url: str) -> list[tuple[str, int]]:
    """'redis+cluster://h1:7000,h2:7001' -> [('h1', 7000), ('h2', 7001)]; ValueError for anything else."""
    if not url.startswith(SCHEME):
        raise ValueError(f"a Redis Cluster store URL starts with {SCHEME}, not {url!r}")
    nodes = []
    for part in url[len(SCHEME):].split("/")[0].split(","):
        parsed = urlsplit(f"redis://{part}")
        if not parsed.hostname:
            raise ValueError(f"{url!r}: {part!r} is not host:port")
        try:
            nodes.append((parsed.hostname, parsed.port or 6379))
        except ValueError as exc:          # a port that is not a number
            raise ValueError(f"{url!r}: {part!r} is not host:port") from exc
    return nodes


class RedisClusterStore:
    """Records in a Redis Cluster shared by engines; see the module docstring."""

    def __init__(self, url: str, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"a store timeout must be positive, not {timeout_s}")
        import redis  # here, so a server without Redis never pays for the import

        self._redis = redis
        self.startup_nodes = parse_cluster_url(url)
        self.address = ",".join(f"{host}:{port}" for host, port in self.startup_nodes)
        self.timeout_s = timeout_s
        self._counters = Counters()
        self._breakers: defaultdict[str, Breaker] = defaultdict(Breaker)   # per node, and "cluster" to connect
        self._lock = threading.Lock()
        self._client: Any = None
        self._stale = True               # the slot map must be (re)read before the next batch
        self._closed = False
        try:
            self._cluster()
            logger.info("redis cluster store at %s (%d masters)", self.address,
                        len(self._client.get_primaries()))
        except StoreError as exc:        # the cluster may come up later: the store still opens
            logger.warning("redis cluster store at %s is unreachable for now (%s)", self.address, exc)

    # ---- the cluster and its nodes --------------------------------------------------------------
    def _cluster(self) -> Any:
        """The cluster client with a current slot map (connects, or re-reads the map, when needed)."""
        with self._lock:
            if not self._stale:
                return self._client
            with guard(self._counters, self._closed):
                breaker = self._breakers["cluster"]
                breaker.admit()
                try:
                    self._connect()
                except self._redis.RedisError:
                    breaker.tripped()
                    raise
                breaker.succeeded()
            self._stale = False
            return self._client

    def _connect(self) -> None:
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        if self._client is not None:
            self._client.nodes_manager.initialize()
            return
        self._client = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in self.startup_nodes],
            socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0), require_full_coverage=False)     # no retries: the breakers decide

    def _by_node(self, keys: Sequence[bytes]) -> dict[str, tuple[Any, list[int]]]:
        """Key positions grouped by the master that owns their slot."""
        cluster = self._cluster()
        groups: dict[str, tuple[Any, list[int]]] = {}
        for index, key in enumerate(keys):
            node = cluster.get_node_from_key(self._key(key))
            groups.setdefault(node.name, (node, []))[1].append(index)
        return groups

    def _pipeline(self, node: Any, commands: list[Command], reads: int) -> list | None:
        """One pipeline to one node behind its breaker; None (counted as an error) if it failed."""
        breaker = self._breakers[node.name]
        try:
            with guard(self._counters, self._closed, reads):
                breaker.admit()
                pipe = self._client.get_redis_connection(node).pipeline(transaction=False)
                for command in commands:
                    pipe.execute_command(*command)
                try:
                    results = checked(pipe.execute(raise_on_error=False))
                except (self._redis.ConnectionError, self._redis.TimeoutError, TimeoutError, ConnectionError):
                    breaker.tripped()
                    raise
                except (self._redis.exceptions.MovedError, self._redis.exceptions.AskError):
                    self._stale = True
                    raise
                breaker.succeeded()
                return results
        except StoreError as exc:
            logger.debug("redis cluster node %s: %s", node.name, exc)
            return None

    def _each_node(self, keys: Sequence[bytes], commands: Sequence[list[Command]],
                   reads: bool = False) -> tuple[list[list | None], int]:
        """Each key's `commands`, one pipeline per node: (each key's replies, None where its node failed;
        how many keys were answered)."""
        results: list[list | None] = [None] * len(keys)
        answered = 0
        if not keys:
            return results, answered
        for node, indices in self._by_node(keys).values():
            sent = [commands[i] for i in indices]
            replies = self._pipeline(node, [command for each in sent for command in each],
                                     len(indices) if reads else 0)
            if replies is None:
                continue
            answered += len(indices)
            for index, replied in zip(indices, grouped(replies, sent)):
                results[index] = replied
        return results, answered

    @staticmethod
    def _key(key: bytes) -> str:
        return REDIS_PREFIX + key.hex()

    # ---- the Store protocol ---------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        counts, _ = self._each_node(keys, [[("EXISTS", self._key(k))] for k in keys])
        return [bool(count and count[0]) for count in counts]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Records, None for a miss; keys of a failed node are misses (their reads counted by the guard)."""
        names = [self._key(k) for k in keys]
        probes, _ = self._each_node(keys, [probe(name) for name in names], reads=True)
        asked = [i for i, replies in enumerate(probes) if replies is not None]
        reads = {i: plan(names[i], probes[i]) for i in asked}
        bodies, answered = self._each_node([keys[i] for i in asked], [reads[i].commands for i in asked], reads=True)
        records: list[bytes | None] = [None] * len(keys)
        for i, replies in zip(asked, bodies):
            records[i] = value(reads[i], replies)
        found = [record for record in records if record is not None]
        self._counters.add(reads=answered, hits=len(found), misses=answered - len(found),
                           bytes_read=sum(len(record) for record in found),
                           refused=sum(read.refused for read in reads.values()))
        return records

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Writes to a failed node are dropped (counted as errors), the others stored."""
        done, _ = self._each_node([key for key, _ in items], [[("SET", self._key(k), r)] for k, r in items])
        stored = [record for (_, record), ok in zip(items, done) if ok]
        self._counters.add(writes=len(stored), bytes_written=sum(len(record) for record in stored))

    def delete(self, keys: Sequence[bytes]) -> None:
        removed, _ = self._each_node(keys, [[("DEL", self._key(k))] for k in keys])
        self._counters.add(deletions=sum(count[0] for count in removed if count))

    def stats(self) -> StoreStats:
        return self._counters.snapshot()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(Exception):         # closing a dead connection must not raise either
            if self._client is not None:
                self._client.close()
