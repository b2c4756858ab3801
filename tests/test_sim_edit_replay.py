"""The simulator replays token editing's edit phases from calibration records: after a block's
masks are committed it runs the edit-only steps the recorded run took on that block, through
the same control code (the scheduler prices each as a block step)."""

import numpy as np
import pytest
from test_calibrate_editing import edited
from test_simulator import spec

from dilaserve.protocol import StepKind
from dilaserve.request import Request
from dilaserve.sim.behaviour import ReplayBehaviour
from dilaserve.sim.run import simulate
from dilaserve.trajectory import Trajectory, save_trajectories


def plain() -> Trajectory:
    """`edited()`'s commits without editing: its steps that commit nothing are not replayed."""
    t = edited()
    return Trajectory(0, t.threshold, 5, 8, 4, t.kinds, t.commits, t.confidences)


def replayed(t: Trajectory):
    """(blocks, is_block_done, oracle steps left before each step) of `t` replayed alone."""
    b = ReplayBehaviour([t])
    b.assign("r", 0)
    r = Request("r", (3,) * 5, 8, 4, 1, 0.9, edits=b.edits)
    blocks, done, left = [], [], []
    while not r.is_finished:
        left.append(b.remaining_steps("r", 0.9))
        result = b.step(r, 0.9, StepKind.BLOCK)
        r.apply(result)
        blocks.append(result.block_index)
        done.append(result.is_block_done)
    return blocks, done, left


def test_each_block_runs_its_recorded_edit_only_steps_before_it_is_done():
    blocks, done, left = replayed(edited())
    assert blocks == [0, 0, 0, 0, 1, 1]  # block 0: 2 mask steps + 2 edit-only, block 1: 1 + 1
    assert done == [False, False, False, True, False, True]
    assert left == [6, 5, 4, 3, 2, 1]  # the oracle counts the edit-only steps too


def test_without_editing_the_replay_skips_the_steps_that_commit_nothing():
    blocks, done, _ = replayed(plain())
    assert blocks == [0, 0, 1] and done == [False, True, True]


@pytest.mark.parametrize("trajectory, steps", [(edited(), 6), (plain(), 3)])
def test_the_simulator_serves_edit_phases_through_the_control_plane(tmp_path, trajectory, steps):
    save_trajectories(tmp_path / "t.npz", [trajectory])
    replay = f"replay:{tmp_path / 't.npz'}"
    run = simulate(spec(tmp_path, behaviour=replay, block_len=4, policy="oracle-predictor"))
    assert run.summary["finished"] == run.summary["requests"] == 20
    assert {row["steps"] for row in run.rows} == {steps}
    assert np.all([row["output_tokens"] == 8 for row in run.rows])
