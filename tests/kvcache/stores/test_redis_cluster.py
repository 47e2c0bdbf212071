"""The Redis Cluster store on a real 3-master cluster: keys spread over the masters, batches per
node, a dead master costs misses and counted errors, never an exception."""

from __future__ import annotations

import time

import pytest

from kvstrata.kvcache.stores import open_store
from kvstrata.kvcache.stores.base import BREAKER_COOLDOWN_S
from kvstrata.kvcache.stores.redis_cluster import RedisClusterStore, parse_cluster_url
from tests.kvcache.stores.store_helpers import record_of, redis_cluster  # noqa: F401  (fixture)


def test_parse_cluster_url():
    assert parse_cluster_url("redis+cluster://a:7000,b:7001") == [("a", 7000), ("b", 7001)]
    for bad in ("redis://a:7000", "redis+cluster://", "redis+cluster://a:x"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)


def test_keys_spread_and_a_dead_master_costs_misses(redis_cluster):  # noqa: F811
    store = open_store(redis_cluster.url, None, 1, 0.5)
    assert isinstance(store, RedisClusterStore)
    items = [(i.to_bytes(16, "little"), record_of(200, fill=i)) for i in range(120)]
    keys = [key for key, _ in items]
    store.put(items)
    assert store.get(keys) == [record for _, record in items]
    assert store.exists(keys) == [True] * len(keys)
    per_master = [master.client().dbsize() for master in redis_cluster.masters]
    assert sum(per_master) == len(items) and min(per_master) > 10, per_master     # spread over all three
    assert store.stats().errors == {}

    victim = redis_cluster.masters[1]
    victim.kill()
    records = store.get(keys)                                 # no exception: the dead master's keys miss
    missing = sum(record is None for record in records)
    assert missing == per_master[1]
    assert [r for r in records if r is not None] == [rec for (_, rec), r in zip(items, records) if r is not None]
    store.put([(b"x" * 16, record_of(200))] + items[:10])    # writes to the dead master are dropped
    assert store.get(keys[:10]).count(None) == sum(r is None for r in records[:10])
    errors = store.stats().errors
    assert sum(errors.values()) >= 2 and set(errors) <= {"connection", "timeout"}, errors

    victim.start()                      # back, empty (no persistence), same node id: it owns its slots again
    deadline = time.monotonic() + 10
    while store.get(keys) != [record for _, record in items]:       # once its breaker lets a probe through
        assert time.monotonic() < deadline, "the restarted master was not written to within 10 s"
        time.sleep(BREAKER_COOLDOWN_S / 4)
        store.put(items)
    store.close()


def test_two_engines_share_prefixes_through_the_cluster_and_survive_a_dead_master(smollm2, redis_cluster):  # noqa: F811
    """Engine B hits what engine A wrote (store hits through the cluster); with a master killed,
    every request still completes, and the failed store operations are counted."""
    from tests.entrypoints.server_helpers import running_server, scrape
    from tests.router.router_helpers import chat

    def store_hits(base: str) -> float:
        return scrape(base).get('kvstrata_prompt_tokens_total{source="store"}', 0.0)

    def wait_written(engine) -> None:
        deadline = time.monotonic() + 20
        while engine.tiers.has_transfers or engine.tiers.num_unpersisted:
            assert time.monotonic() < deadline, "writes to the cluster did not finish"
            time.sleep(0.05)

    options = dict(store=redis_cluster.url, store_timeout=0.5, write_policy="write_through", threads=1)
    with running_server(smollm2, **options) as (url_a, engine_a), running_server(smollm2, **options) as (url_b, _):
        openings = [f"Story {i}: " + " ".join(f"tale{i}w{k}" for k in range(40)) for i in range(6)]
        for text in openings:
            assert chat(url_a, [{"role": "user", "content": text}]).status_code == 200
        wait_written(engine_a)
        before = store_hits(url_b)
        for text in openings[:3]:
            reply = chat(url_b, [{"role": "user", "content": text}])
            assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert store_hits(url_b) > before                                  # shared through the cluster

        redis_cluster.masters[0].kill()                                    # mid-run
        for base in (url_a, url_b):
            for text in openings[3:] + [f"A new story {base}: " + "word " * 60]:
                assert chat(base, [{"role": "user", "content": text}]).status_code == 200
        errors = {k: v for base in (url_a, url_b) for k, v in scrape(base).items()
                  if k.startswith("kvstrata_store_backend_errors")}
        assert sum(errors.values()) > 0, errors
