import numpy as np

from dilaserve.config import EngineConfig
from dilaserve.control.features import FEATURE_NAMES, feature_matrix, state_features
from dilaserve.engine.llm import LLM
from dilaserve.engine.record import record_trajectories
from dilaserve.trajectory import load_trajectories, save_trajectories


def test_recorded_trajectories_replay_and_round_trip(tiny_checkpoint, tmp_path):
    llm = LLM(tiny_checkpoint, EngineConfig(kv_cache="dual", block_len=8))
    trajs = record_trajectories(
        llm, ["Tom has 3 apples.", "Ava has 9 coins."], (0.5, 1.0), max_tokens=16
    )
    assert [(t.prompt_index, t.threshold) for t in trajs] == [
        (0, 0.5),
        (1, 0.5),
        (0, 1.0),
        (1, 1.0),
    ]
    for t in trajs:
        committed = np.concatenate(t.commits)
        assert len(set(committed.tolist())) == len(committed)  # each position once
        assert t.kinds[0] == "recompute"
        if t.threshold == 1.0:
            assert all(len(c) == 1 for c in t.commits)
    path = tmp_path / "t.npz"
    save_trajectories(path, trajs)
    back = load_trajectories(path)
    assert [b.kinds for b in back] == [t.kinds for t in trajs]
    assert all(
        np.array_equal(a, b) for t, u in zip(trajs, back) for a, b in zip(t.commits, u.commits)
    )
    # exact, so that a predictor refit from a run folder reproduces its report
    assert all(np.array_equal(t.confidences, u.confidences) for t, u in zip(trajs, back))


def test_states_and_features_follow_the_trajectory(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, EngineConfig(kv_cache="none", block_len=8))
    [t] = record_trajectories(llm, ["Tom has 3 apples."], (1.0,), max_tokens=16)
    states = list(t.states())
    assert [s[0] for s in states] == list(range(t.num_steps))
    assert [int(s[1].sum()) for s in states] == list(range(t.num_steps))  # one per step
    f = state_features(states[3][1], states[3][2], 3, 8)
    assert f[0] == 16 and f[1] == 3 / 16 and f[2] == 3 / 16 and f[4] == 3 / 8
    rows = feature_matrix(np.stack([f, f]), (0.9, 0.5))
    assert rows.shape == (4, len(FEATURE_NAMES))
    assert rows[:, 0].tolist() == [0.9, 0.5, 0.9, 0.5]
