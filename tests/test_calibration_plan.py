"""What a calibration plans and how it reports: profiled sequences capped at the model's
positions, the time left from token-steps per phase (not a count of units), and an implausible
step predictor warned about, or refused with --strict."""

from __future__ import annotations

import json

import pytest

from dilaserve.calibration import run
from dilaserve.calibration.plan import PROFILE, TRAJECTORIES, create_plan
from dilaserve.calibration.progress import Progress, Unit, expected_steps, trajectory_cost
from dilaserve.calibration.run import CalibrateConfig
from dilaserve.cli import main
from dilaserve.protocol import KVCacheMode
from dilaserve.training.random_checkpoint import write_random_dream


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_time_left_follows_the_cost_of_the_units_left():
    clock, lines = Clock(), []
    units = [Unit(PROFILE, 100), Unit(PROFILE, 900), Unit(TRAJECTORIES, 1000)]
    progress = Progress(units, lines.append, clock)
    clock.now = 1.0
    progress.advance("first point")
    # 0.01 s per token-step: 9 s for the large point, 10 s for the trajectories (a count of
    # units would have said 2 s)
    assert progress.seconds_left() == pytest.approx(19.0)
    assert lines == ["[1/3] first point (1s elapsed, about 19s left)"]
    clock.now = 10.0
    progress.advance("second point")
    assert progress.seconds_left() == pytest.approx(10.0)


def test_a_phase_once_begun_is_timed_at_its_own_pace():
    clock = Clock()
    units = [Unit(PROFILE, 100), Unit(TRAJECTORIES, 100), Unit(TRAJECTORIES, 100)]
    progress = Progress(units, lambda _: None, clock)
    clock.now = 1.0
    progress.advance("point")
    clock.now = 11.0
    progress.advance("threshold 0.5")
    assert progress.seconds_left() == pytest.approx(10.0)
    progress.revise(TRAJECTORIES, [300])  # the next threshold is expected to take 3x the steps
    assert progress.seconds_left() == pytest.approx(30.0)
    assert units[1].cost == 100  # what is done keeps its cost


def test_loading_counts_as_elapsed_but_not_as_pace():
    clock, lines = Clock(), []
    progress = Progress([Unit(PROFILE, 100), Unit(PROFILE, 100)], lines.append, clock)
    clock.now = 30.0  # an instance starting
    progress.untimed()
    clock.now = 31.0
    progress.advance("point")
    assert lines == ["[1/2] point (31s elapsed, about 1s left)"]


def test_steps_at_higher_thresholds_follow_the_last_two_measured():
    assert expected_steps({0.5: 14.5}, (0.6, 0.7), 32) == [14.5, 14.5]
    assert expected_steps({0.5: 14.0, 0.6: 20.0}, (0.7, 0.8, 0.9), 32) == pytest.approx(
        [26.0, 32.0, 32.0]  # one token a step (32 of a 32-token window) at most
    )
    assert expected_steps({0.5: 20.0, 0.6: 18.0}, (0.7,), 32) == [18.0]  # never fewer


def test_a_trajectory_costs_what_its_cache_runs():
    # 32 prompt tokens, 64 output tokens in 2 blocks of 32, 10 steps
    assert trajectory_cost(KVCacheMode.NONE, 32, 64, 32, 10) == 10 * 96
    assert trajectory_cost(KVCacheMode.DUAL, 32, 64, 32, 10) == 2 * 96 + 8 * 32
    assert trajectory_cost(KVCacheMode.BLOCK, 32, 64, 32, 10) == 32 + 10 * 32


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    """A random Dream checkpoint of 96 positions."""
    return write_random_dream(tmp_path_factory.mktemp("dream"), max_position_embeddings=96)


def test_profiled_sequences_stop_at_the_models_positions(dream):
    plan = create_plan(CalibrateConfig(str(dream), max_tokens=64), with_prompts=False)
    assert (plan.grid.seq_len, plan.grid.gen_len) == (96, 64)  # not twice the window, 128
    with pytest.raises(ValueError, match="no prompt within the model's 96 positions"):
        create_plan(CalibrateConfig(str(dream), max_tokens=96), with_prompts=False)


def test_profile_units_cost_the_tokens_each_point_runs(dream):
    cfg = CalibrateConfig(str(dream), max_tokens=32, requests=(1, 4), repeats=2)
    plan = create_plan(cfg, with_prompts=False)
    costs = [u.cost for u in plan.profile_units((1,))]
    # recompute steps of 64-token sequences, then cache steps (32 tokens) after a recompute;
    # a warm-up and 2 repeats each
    assert costs == [3 * 64, 3 * 4 * 64, 3 * 96, 3 * 4 * 96]


@pytest.mark.parametrize("strict", [False, True])
def test_an_implausible_step_predictor_is_said(dream, tmp_path, monkeypatch, capsys, strict):
    entry = {"tp": 1, "kind": "recompute", "batch_tokens": 64, "num_requests": 1, "ms": 1.0}
    entry |= {"seq_len": 64, "spread": 0.0}
    entries = [entry, {**entry, "kind": "cache", "batch_tokens": 32}]
    monkeypatch.setattr(run, "measure_profile", lambda *a: (entries, []))
    fitted = {"errors": {"full": 0.504}, "refresh_every_tokens": 2}
    monkeypatch.setattr(run, "_fit_predictor", lambda *a: fitted)
    folder = tmp_path / "calibration"
    argv = ["calibrate", str(dream), "--max-tokens", "32", "--calibration", str(folder)]
    assert main(argv + ["--strict"] * strict) == (2 if strict else 0)
    out = capsys.readouterr()
    said = "step predictor held-out error 50.4% is over 35.1%"
    assert said in (out.err if strict else out.out)
    assert any(said in w for w in json.loads((folder / "calibration.json").read_text())["warnings"])


def test_a_new_predictor_clears_the_old_ones_warning(dream, tmp_path, monkeypatch):
    entry = {"tp": 1, "kind": "recompute", "batch_tokens": 64, "num_requests": 1, "ms": 1.0}
    entry |= {"seq_len": 64, "spread": 0.0}
    monkeypatch.setattr(run, "measure_profile", lambda *a: ([entry], ["tp=1 noisy point"]))
    folder = tmp_path / "calibration"
    argv = ["calibrate", str(dream), "--max-tokens", "32", "--calibration", str(folder)]
    for error in (0.504, 0.1):
        fitted = {"errors": {"full": error}, "refresh_every_tokens": 2}
        monkeypatch.setattr(run, "_fit_predictor", lambda *a, fitted=fitted: fitted)
        assert main(argv) == 0
    warnings = json.loads((folder / "calibration.json").read_text())["warnings"]
    assert warnings == ["tp=1 noisy point"]
