"""Greedy outputs are identical whether a prefix comes from device, host, disk or Redis, and the
disk store survives a restart. Every engine step is audited."""

import pytest

from kvstrata.core.config import EngineConfig
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = ("The history of the Loire valley is long: castles, vineyards and rivers shaped it. " * 3
          + "Summarise it in one line:")
FILLERS = [f"Unrelated text number {i}: " + "lorem ipsum dolor sit amet " * 8 for i in range(6)]


def engine(smollm2, **options):
    options = dict(dict(block_size=16, num_device_blocks=24, kv_cache_memory="64MiB"), **options)
    return LLMEngine(EngineConfig.from_options(audit_every_step=True, **options), loaded=smollm2)


@pytest.fixture(scope="module")
def reference(smollm2):
    e = engine(smollm2, enable_prefix_caching=False, num_device_blocks=64)
    return e.generate([PROMPT], GREEDY)[0].new_token_ids


def run_evicted(e):
    """Serve PROMPT, push it out of device memory with fillers, then serve it again."""
    e.generate([PROMPT], GREEDY)
    for filler in FILLERS:
        e.generate([filler], GREEDY)
    again = e.generate([PROMPT], GREEDY)[0]
    while e.has_work:
        e.step()
    counts = e.tiers.audit()
    assert all(c.used == 0 and c.in_flight == 0 for c in counts.values())
    return again


def test_device_hit(smollm2, reference):
    e = engine(smollm2, num_device_blocks=64)
    e.generate([PROMPT], GREEDY)
    again = e.generate([PROMPT], GREEDY)[0]
    assert again.new_token_ids == reference and e.tiers.stats.hit_tokens["device"] > 0


def test_host_load_back(smollm2, reference):
    e = engine(smollm2, num_host_blocks=64)
    again = run_evicted(e)
    assert again.new_token_ids == reference
    assert e.tiers.stats.hit_tokens["host"] >= 48 and again.num_cached_tokens >= 48


def test_disk_load_back(smollm2, reference, tmp_path):
    e = engine(smollm2, num_host_blocks=4, store="disk", store_path=str(tmp_path))
    again = run_evicted(e)
    assert again.new_token_ids == reference
    assert e.tiers.stats.hit_tokens["store"] >= 32 and e.tiers.stats.loaded_blocks["store"] >= 2
    e.close()


def test_disk_store_survives_a_restart(smollm2, reference, tmp_path):
    first = engine(smollm2, store="disk", store_path=str(tmp_path), write_policy="write_through")
    first.generate([PROMPT], GREEDY)
    first.close()
    second = engine(smollm2, store="disk", store_path=str(tmp_path))
    out = second.generate([PROMPT], GREEDY)[0]
    assert out.new_token_ids == reference and second.tiers.stats.hit_tokens["store"] >= 48
    second.close()


def test_corrupted_disk_record_is_a_miss_and_deleted(smollm2, reference, tmp_path):
    first = engine(smollm2, store="disk", store_path=str(tmp_path), write_policy="write_through")
    first.generate([PROMPT], GREEDY)
    first.close()
    records = sorted(tmp_path.rglob("*.kvr"))
    assert records
    for path in records:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    second = engine(smollm2, store="disk", store_path=str(tmp_path))
    out = second.generate([PROMPT], GREEDY)[0]
    while second.has_work:
        second.step()
    assert out.new_token_ids == reference
    assert second.tiers.stats.load_failures.get("checksum", 0) >= 1
    second.close()
