"""The simulator with a hybrid model's profile: its sliding layers' attention priced by their windows, and every tier
holding pages of one KV group's layers as the engine's do, so the same tokens of memory keep more conversations."""

from __future__ import annotations

import pytest

from kvstrata.sim.batch_shape import BatchShape, layer_mix
from kvstrata.sim.config import SimConfig
from kvstrata.sim.cost_model import CostModel, Link
from kvstrata.sim.simulator import Simulator
from kvstrata.sim.traces import read_mooncake
from tests.sim.test_batch_shape import chunk
from tests.sim.test_simulator import synthetic_trace

WINDOWS = (None, 256, 256, 256, 256, 256)          # Gemma 3's pattern: a global layer, then five sliding ones


def cost(windows=WINDOWS) -> CostModel:
    """10 ms a step, 1 ms a prefill token, 2 ms a decode, and attention: 1 us a key read, 1 ns a pair."""
    return CostModel(source="test: hybrid", kv_bytes_per_token=6 * 64, host_link=Link(0.0, 1e12),
                     store_link=Link(0.01, 1e9), compute=(0.01, 1e-3, 2e-3, 1e-6, 1e-9, 1e-9, 0, 0, 1e-9, 0, 1e-9, 0),
                     decode_in_place=True, layer_windows=windows)


def test_a_sliding_layer_is_priced_for_its_window_only():
    """A decode at 4,001 tokens: the global layer's keys count for a sixth, the sliding ones' windows for the rest."""
    decode = [chunk(4000, 1, list(range(63)))]
    full = BatchShape.of(decode, 64, True)
    mixed = BatchShape.of(decode, 64, True, layer_mix(WINDOWS))
    window = BatchShape.of(decode, 64, True, ((256, 1.0),))
    assert full.decode_pairs == 4016 and window.decode_pairs == 256 + 16       # from the window's first 16-key tile
    assert mixed.decode_pairs == pytest.approx((4016 + 5 * 272) / 6)
    assert cost().step_seconds(mixed) < cost(()).step_seconds(mixed) + 1e-12 < cost(()).step_seconds(full)
    assert layer_mix((None, None)) == layer_mix(()) == ((None, 1.0),)


@pytest.mark.parametrize("tiers", [{}, {"host_cache_tokens": 8192, "store_cache_tokens": None}],
                         ids=["device", "host-and-store"])
def test_kv_groups_keep_more_conversations_in_the_same_tokens(tmp_path, tiers):
    """The same trace (sessions after one shared system prompt) and capacities, audited after every step: with KV
    groups every tier holds pages (a sixth of a block each) and the sliding ones only their windows, so the device
    alone serves more prompt tokens from cache than with every layer at full length (`swa_full`); with a host tier
    and a store below, both serve what an unbounded cache would, the groups' windows coming back from the host."""
    trace = read_mooncake(synthetic_trace(tmp_path / "trace.jsonl", sessions=16, turns=4, max_live=12),
                          max_output_tokens=8)
    runs, stats = {}, {}
    for swa_full in (False, True):
        config = SimConfig(block_size=64, device_cache_tokens=12288, audit=True, swa_full=swa_full, **tiers)
        simulator = Simulator(trace, config, cost())
        runs[swa_full] = simulator.run().to_json()
        stats[swa_full] = simulator.engines[0].tiers.stats
        pages = 1 if swa_full else 6
        assert simulator.engines[0].tiers.device.num_blocks == 12288 // 64 * pages
    assert runs[False]["requests"] == runs[True]["requests"] == len(trace)
    grouped, full = runs[False]["hit_rate"]["total"], runs[True]["hit_rate"]["total"]
    if tiers:
        assert grouped == full == runs[False]["ideal_hit_rate"] and stats[False].group_loads["host"] > 0
    else:
        assert grouped > full + 0.1 and stats[False].window_hits > 0
