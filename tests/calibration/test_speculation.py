"""The speculative validation: what an engine replay counts of its drafts, the acceptance the
simulator takes from those counts, and (slow) the whole comparison on the real engine."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstrata.calibration.engine_replay import DraftCounts, EngineRun, ShapeRecorder
from kvstrata.calibration.speculation import drafted_step_times, measured_acceptance
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.sim.batch_shape import BatchShape
from tests.calibration.test_validation import _profile


def _chunk(drafts=(), lookahead=4, max_tokens=10, output=0, start=20, prefill=0, forks=()):
    request = SimpleNamespace(num_lookahead_tokens=lookahead, sampling=SamplingParams(max_tokens=max_tokens),
                              num_output_tokens=output)
    return SimpleNamespace(request=request, start=start, token_ids=list(range(1 + prefill + len(drafts))),
                           block_ids=[0, 1], sample=True, forks=forks, draft_token_ids=tuple(drafts),
                           num_tokens=1 + prefill + len(drafts))


def test_the_shape_recorder_counts_decodes_that_could_draft_and_how_far_drafts_reach():
    runner = SimpleNamespace(block_size=16, decodes_in_place=True, execute=lambda output: "ran")
    recorder = ShapeRecorder(runner)
    chunks = [_chunk(drafts=(5, 6, 7)), _chunk(drafts=(5,)), _chunk(),             # three could, two did
              _chunk(lookahead=0), _chunk(output=9), _chunk(prefill=30, start=0),  # no lookahead, no room, a prompt
              _chunk(forks=("sample",))]                                           # a family's first token
    assert recorder.execute(SimpleNamespace(chunks=chunks, is_empty=False)) == "ran"
    assert recorder.could_draft == 3 and recorder.drafted_per_pos == [2, 1, 1] and recorder.last_drafted


def test_the_acceptance_is_read_from_the_replays_counts_and_drafted_steps_are_timed():
    drafts = DraftCounts(num_drafts=4, num_draft_tokens=9, num_accepted_tokens=5, accepted_per_pos=[3, 2, 0],
                         drafted_per_pos=[4, 3, 2], could_draft=5, drafted_steps=[1])
    run = EngineRun([], {}, [(BatchShape(decode_seqs=1), 0.5), (BatchShape(prefill_tokens=4), 0.25)], 0.0, 0, drafts)
    acceptance = measured_acceptance(run)
    assert acceptance.per_position == (0.75, 0.5, 0.0) and acceptance.draft_lengths == (1.0, 0.75, 0.5)
    assert acceptance.draft_rate == 0.8
    cost = _profile()           # 10 ms a step + 1 ms a prefill token
    assert drafted_step_times(run, cost) == pytest.approx(
        {"steps": 1, "engine_s": 0.25, "profile_s": 0.014, "error": 0.014 / 0.25 - 1})


@pytest.mark.slow
def test_speculative_validation_on_the_real_engine_compares_the_speedups():
    from kvstrata.calibration.slices import Slice
    from kvstrata.calibration.speculation import validate_speculation
    from kvstrata.core.config import SpeculativeConfig

    trace = Path(__file__).resolve().parents[3] / "shared/data/traces/conversation_trace.jsonl"
    if not trace.exists():
        pytest.skip("the conversation trace is not here")
    small = Slice("speculative", skip=505, requests=3, max_input_tokens=64, max_output_tokens=24)
    spec = SpeculativeConfig.parse('{"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}')
    report = validate_speculation(trace, small, spec, _profile(), threads=1, clock="cpu", time_scales={"given": 1.0})
    level = report["levels"]["given"]
    assert set(level["speedup"]) == {"throughput", "tpot_p50", "tpot_p99"}
    assert level["acceptance"]["engine"]["num_drafts"] >= level["drafted_steps"]["steps"] > 0
    assert level["steps"]["with"]["engine"] < level["steps"]["without"]["engine"]
