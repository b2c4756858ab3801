"""`dilaserve calibrate --editing`: a LLaDA2.1 checkpoint's trajectories recorded with token
editing on, so that its step predictor learns the edit-only steps, and the edit phase kept in
the trajectories (their steps that commit nothing) for the simulator to replay."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dilaserve.calibration import run
from dilaserve.cli import main
from dilaserve.training.random_checkpoint import write_random_dream, write_random_llada21
from dilaserve.training.train_predictor import edit_steps_per_block
from dilaserve.trajectory import Trajectory, load_trajectories, save_trajectories


def edited(block_offset: int = 0) -> Trajectory:
    """Two blocks of 4: block 0 in two steps then 2 edit-only steps, block 1 in one step then
    1 edit-only step."""
    commits = ([0, 1], [2, 3], [], [], [4, 5, 6, 7], [])
    commits = tuple(np.array(c, dtype=np.int32) for c in commits)
    conf = np.zeros((len(commits), 8), np.float32)
    return Trajectory(0, 0.9, 5, 8, 4, ("block",) * len(commits), commits, conf, block_offset, True)


def test_a_trajectory_counts_each_blocks_edit_only_steps_and_keeps_them_on_disk(tmp_path):
    t = edited()
    assert t.edit_steps_by_block() == {0: 2, 1: 1}
    assert edit_steps_per_block([t]) == 1.5
    plain = Trajectory(1, 0.9, 5, 8, 4, t.kinds, t.commits, t.confidences)
    assert plain.edit_steps_by_block() == {} and edit_steps_per_block([plain]) is None
    save_trajectories(tmp_path / "t.npz", [t, plain])
    assert [x.edits for x in load_trajectories(tmp_path / "t.npz")] == [True, False]


def test_blocks_at_absolute_positions_count_edits_to_their_own_block():
    assert edited(block_offset=2).edit_steps_by_block() == {1: 2, 2: 1}


def fake_profile(monkeypatch, kinds):
    entry = {"tp": 1, "kind": kinds[0], "batch_tokens": 64, "num_requests": 1, "ms": 1.0}
    entry |= {"seq_len": 64, "spread": 0.0}
    entries = [{**entry, "kind": k} for k in kinds]
    monkeypatch.setattr(run, "measure_profile", lambda *a: (entries, []))


def test_calibrate_with_editing_teaches_the_predictor_the_edit_only_steps(tmp_path, monkeypatch):
    checkpoint = write_random_llada21(tmp_path / "llada21")
    fake_profile(monkeypatch, ("prefill", "block", "commit"))
    folder = tmp_path / "calibration"
    argv = ["calibrate", str(checkpoint), "--max-tokens", "32", "--num-prompts", "12"]
    argv += ["--thresholds", "0.5,0.9", "--calibration", str(folder), "--editing", "quality"]
    assert main(argv) == 0
    meta = json.loads((folder / "predictor" / "gbm-full.json").read_text())
    assert meta["editing"] == "quality" and meta["edit_steps_per_block"] >= 1.0
    trajs = load_trajectories(folder / "trajectories.npz")
    assert all(t.edits for t in trajs)
    assert json.loads((folder / "summary.json").read_text())["editing"] == "quality"


def test_editing_on_a_family_without_it_is_refused_by_name(tmp_path, capsys):
    checkpoint = write_random_dream(tmp_path / "dream")
    argv = ["calibrate", str(checkpoint), "--max-tokens", "32", "--editing", "speed"]
    assert main(argv + ["--calibration", str(tmp_path / "c")]) == 2
    assert "editing='speed'" in capsys.readouterr().err


def test_calibrate_config_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="editing"):
        run.CalibrateConfig("m", editing="fast")


def test_serving_another_editing_mode_than_calibrated_is_warned(tmp_path):
    from dilaserve.cli_cluster import editing_warnings

    checkpoint = write_random_llada21(tmp_path / "llada21")
    predictor = tmp_path / "predictor"
    predictor.mkdir()
    (predictor / "gbm-full.json").write_text(json.dumps({"editing": "quality"}))
    [line] = editing_warnings(str(checkpoint), None, str(predictor))  # the checkpoint's: speed
    assert "editing='quality'" in line and "editing='speed'" in line
    assert editing_warnings(str(checkpoint), "quality", str(predictor)) == []
    (predictor / "gbm-full.json").write_text(json.dumps({}))  # an older predictor: not judged
    assert editing_warnings(str(checkpoint), "off", str(predictor)) == []
