"""`kvstrata calibrate` on the user's machine (issue 63): the engine it times is the one `serve` runs, the
grid runs until the fit settles within a budget, and the fresh profile is checked on slices it never saw.

Fast: the grid's passes are fakes built from a shipped profile's measured steps (no engine)."""

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from kvstrata.calibration import calibrate as calibration
from kvstrata.calibration.fitted_on import FittedOnError, check_same_clock
from kvstrata.calibration.self_check import check_slices, seconds_for
from kvstrata.calibration.validation import TIMING, verdict
from kvstrata.entrypoints.cli.calibrate import engine_timing
from kvstrata.sim.batch_shape import BatchShape
from kvstrata.sim.cost_model import CostModel, Link

SHIPPED = Path(__file__).resolve().parents[2] / "benchmarks/profiles/cpu-2core-smollm2.json"


def _measured() -> tuple[list[BatchShape], list[float]]:
    rows = json.loads(SHIPPED.read_text())["measurements"]["rows"]
    return [BatchShape(*row[:-1]) for row in rows], [row[-1] for row in rows]


class _FakeGrid:
    """Stands in for `_grid_run`: pass k returns the measured steps times noise[k] (one factor per step)."""

    def __init__(self, noise: list[np.ndarray]):
        self.shapes, self.seconds = _measured()
        self.noise, self.passes = noise, 0

    def __call__(self, engine, recorder, timer, seed):
        assert seed == self.passes + 1, "each pass gets fresh prompts"
        factors = self.noise[self.passes]
        self.passes += 1
        return [(shape, t * f) for shape, t, f in zip(self.shapes, self.seconds, factors)]


def _grid(monkeypatch, noise, repeat, deadline):
    fake = _FakeGrid(noise)
    monkeypatch.setattr(calibration, "_grid_run", fake)
    recorder = argparse.Namespace(runner=argparse.Namespace(decodes_in_place=True))
    shapes, medians, passes = calibration._grid_medians(None, recorder, None, repeat, deadline)
    assert passes == fake.passes and len(medians) == len(shapes) == len(fake.shapes)
    return passes


def test_the_grid_runs_until_the_fit_stops_moving_then_stops(monkeypatch):
    rng = np.random.default_rng(0)
    steps = len(_measured()[0])
    noisy = [1 + rng.normal(0, 0.15, steps) for _ in range(12)]
    quiet = [np.ones(steps)] * 12
    never = lambda fit: float("inf")
    # identical passes: the third moves nothing, so the minimum is all that runs
    assert _grid(monkeypatch, quiet, 3, never) == 3
    # 15% noise per step: more passes, until one moves the fit by under SETTLED
    noisy_passes = _grid(monkeypatch, noisy, 3, never)
    assert 3 < noisy_passes <= 12
    # no time left: the minimum, however noisy; no deadline at all: exactly the minimum
    assert _grid(monkeypatch, noisy, 3, lambda fit: 0.0) == 3
    assert _grid(monkeypatch, noisy, 2, None) == 2


def test_the_deadline_is_asked_with_the_fit_so_far(monkeypatch):
    rng = np.random.default_rng(1)
    steps = len(_measured()[0])
    asked: list[CostModel] = []

    def deadline(fit: CostModel) -> float:
        asked.append(fit)
        return 0.0 if len(asked) == 2 else float("inf")

    assert _grid(monkeypatch, [1 + rng.normal(0, 0.3, steps) for _ in range(6)], 2, deadline) == 3
    shapes, seconds = _measured()
    errors = np.abs([asked[-1].step_seconds(s) / t - 1 for s, t in zip(shapes, seconds)])
    assert np.median(errors) < 0.3, "the fit so far prices the grid's steps"


def test_moved_is_how_far_a_pass_moves_the_fitted_step_times():
    shapes, seconds = _measured()
    fitted = calibration._fit_alone(shapes, seconds)
    assert calibration._moved(shapes, None, fitted) is None
    assert calibration._moved(shapes, fitted, fitted) == pytest.approx(0.0, abs=1e-9)
    slower = calibration._fit_alone(shapes, [t * 1.1 for t in seconds])
    assert calibration._moved(shapes, fitted, slower) == pytest.approx(0.1, rel=1e-6)


def _report(errors_by_load: dict[str, list[float]], runs: int = 2) -> dict:
    """A validation report whose simulator is off the mean of `runs` engine runs by the given errors."""
    levels = {}
    for load, errors in errors_by_load.items():
        figures = {}
        for name, error in zip(TIMING, errors):
            engine = [1.0 - 0.1 * (runs > 1), 1.0 + 0.1 * (runs > 1)][:runs]
            figures[name] = {"engine": engine, "simulator": 1.0 + error}
        figures["hit_rate_device"] = {"engine": [0.5], "simulator": 0.9}      # not a timing figure
        levels[load] = {"figures": figures}
    return {"levels": levels}


def test_the_verdict_counts_timing_figures_against_the_engines_mean():
    report = _report({"light": [0.01, -0.04, 0.049, 0.0, 0.0], "near": [0.06, 0.0, 0.0, 0.0, -0.02],
                      "overload": [0.0, 0.0, -0.12, 0.0, 0.0]})
    judged = verdict(report)
    assert (judged.within, judged.total) == (13, 15)
    assert judged.worst[:2] == ("overload", "ttft_p99_s") and judged.worst[2] == pytest.approx(-0.12)
    assert "13 of 15 timing figures within 5%" in judged.line() and "-12.0%" in judged.line()
    assert verdict(report, tolerance=0.2).within == 15
    assert judged.within_noise == 0
    report["levels"]["near"]["figures"]["ttft_p50_s"]["engine_spread"] = 0.25       # its runs 1.0 and 1.25 apart
    assert verdict(report).within_noise == 1 and "1 more within the engine's own spread" in verdict(report).line()


def test_the_self_check_replays_as_often_as_the_time_left_allows():
    from kvstrata.calibration.self_check import replays_within

    assert replays_within(100.0, 30.0) == 3 and replays_within(65.0, 30.0) == 2
    assert replays_within(10.0, 30.0) == 1 and replays_within(-5.0, 30.0) == 1      # one at least, late or not
    assert replays_within(1000.0, 30.0) == 3 and replays_within(1000.0, 30.0, most=5) == 5


def test_check_slices_refuses_unknown_slices_and_those_fitted_on():
    assert check_slices("plain,sessions", ()) == ("plain", "sessions") and check_slices("", ()) == ()
    with pytest.raises(ValueError, match="not nonsense"):
        check_slices("plain,nonsense", ())
    with pytest.raises(ValueError, match="also in --fit-slices"):
        check_slices("plain", ("plain",))


def test_the_clock_follows_the_threads_unless_named(monkeypatch):
    import torch

    def timing(threads, clock):
        return engine_timing(argparse.Namespace(threads=threads, clock=clock))

    assert timing(1, None) == (1, "cpu") and timing(2, None) == (2, "wall") and timing(2, "cpu") == (2, "cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert timing(None, None) == (None, "cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert timing(None, None) == (None, "wall")


def test_a_profile_is_validated_by_the_clock_it_was_timed_by():
    def profile(fitted_on):
        return CostModel(source="t", kv_bytes_per_token=1, host_link=Link(0, 1), store_link=Link(0, 1),
                         compute=(0.01,) + (0.0,) * 11, fitted_on=fitted_on)

    check_same_clock(profile(({"kind": "grid", "clock": "wall"},)), "wall")
    check_same_clock(profile(({"kind": "grid"},)), "cpu")              # before profiles recorded it
    with pytest.raises(FittedOnError, match="validate with --clock wall"):
        check_same_clock(profile(({"kind": "grid", "clock": "wall"},)), "cpu")


def _flat_trace(path: Path, output_length: int) -> Path:
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": output_length,
                                        "hash_ids": [0, i + 1]}) + "\n" for i in range(560)))
    return path


def test_the_self_check_is_priced_before_the_grid_ends(tmp_path):
    from kvstrata.calibration.self_check import ENGINE_START_S

    cost = CostModel.load(SHIPPED)
    short = seconds_for(_flat_trace(tmp_path / "short.jsonl", 4), ("plain",), cost)
    long = seconds_for(_flat_trace(tmp_path / "long.jsonl", 16), ("plain",), cost)
    assert 3 * ENGINE_START_S < short < long, "the replays are priced by the work in the slice"
    # 12 more decodes for each of 40 requests at each of three loads, each at least a step's fixed cost
    assert long - short > 3 * 40 * 12 * cost.compute[0]
    assert seconds_for(tmp_path / "short.jsonl", (), cost) == 0.0
