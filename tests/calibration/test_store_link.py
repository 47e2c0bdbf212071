"""The profile's store link timed against the store disaggregated engines share (`kvstrata calibrate --store`)."""

from __future__ import annotations

import pytest

from kvstrata.calibration.calibrate import _store_link, _store_name
from tests.kvcache.stores.store_helpers import RedisServer, record_of, redis_server  # noqa: F401

RECORD = record_of(368_640)                # a 16-token block of SmolLM2-135M's size (a store reads only records)


@pytest.mark.parametrize("spec", ["disk", "redis"])
def test_the_store_link_times_loads_from_the_named_store(redis_server: RedisServer, spec):  # noqa: F811
    steps = []
    link = _store_link(RECORD, lambda: steps.append(1), redis_server.url if spec == "redis" else spec, repeat=2)
    assert link.bandwidth > 0 and link.latency_s >= 0
    assert link.seconds(len(RECORD)) < 1.0
    if spec == "redis":       # the records it wrote are there, under keys of their own
        assert len(redis_server.client().keys("kvstrata:*")) == 2 * (1 + 32)


def test_the_profile_names_the_store_without_its_password():
    assert _store_name("redis://:secret@10.0.0.5:6390/0") == "redis at 10.0.0.5:6390/0"
    assert _store_name("disk").startswith("a disk store in ")


def test_calibration_refuses_no_store():
    with pytest.raises(ValueError, match="store link"):
        _store_link(RECORD, lambda: None, "none")
