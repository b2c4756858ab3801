import numpy as np
import pytest

from dilaserve.control.features import state_features
from dilaserve.control.predictor import OneShotPredictor, OraclePredictor, load_gbm
from dilaserve.training.train_predictor import (
    PredictorConfig,
    choose_k,
    fit_and_report,
    one_shot_rates,
    refresh_curve,
    train_predictor,
)
from dilaserve.trajectory import Trajectory, save_trajectories

GEN, BLOCK = 32, 8


def synthetic(prompt: int, threshold: float) -> Trajectory:
    """Prompt difficulty sets tokens per step; masked confidences reveal it."""
    per_step = (1 + prompt % 4) * (2 if threshold < 0.7 else 1)
    order = list(range(GEN))
    commits, confs = [], []
    conf = np.full(GEN, 0.2 + 0.15 * (prompt % 4), dtype=np.float32)
    while order:
        block_end = (order[0] // BLOCK + 1) * BLOCK
        take = [p for p in order if p < block_end][:per_step]
        order = [p for p in order if p not in take]
        conf[take] = 0.99
        commits.append(np.array(take))
        confs.append(conf.copy())
    return Trajectory(
        prompt, threshold, 10, GEN, BLOCK, ("full",) * len(commits), tuple(commits), np.stack(confs)
    )


def test_full_model_beats_one_shot_and_is_saved(tmp_path):
    trajs = [synthetic(p, t) for t in (0.5, 0.9) for p in range(40)]
    cfg = PredictorConfig(model="unused", out=str(tmp_path / "pred"), thresholds=(0.5, 0.9))
    summary = fit_and_report(trajs, cfg, tmp_path, log=lambda *_: None)
    errors = summary["errors"]
    assert errors["full"] < errors["one-shot"]
    assert errors["full"] < 0.2 and errors["oracle"] == 0.0
    model = load_gbm(tmp_path / "pred", "full")
    state = state_features(np.zeros(GEN, bool), np.full(GEN, 0.2, np.float32), 0, BLOCK)
    pred = model.predict(["x"], state[None])
    assert pred.shape == (1, 2) and pred[0, 0] < pred[0, 1]  # lower threshold, fewer steps
    assert (tmp_path / "report.md").exists()


def test_one_shot_counts_down_from_length_times_rate():
    p = OneShotPredictor((0.5, 0.9), {0.5: 0.25, 0.9: 0.5})
    state = state_features(np.zeros(GEN, bool), np.zeros(GEN, np.float32), 4, BLOCK)
    assert p.predict(["r"], state[None]).tolist() == [[8 - 4, 16 - 4]]
    assert one_shot_rates([synthetic(0, 0.9), synthetic(1, 0.9)]) == {0.9: (32 + 16) / 2 / GEN}


def test_oracle_reads_the_truth():
    p = OraclePredictor((0.5, 0.9), lambda rid, t: {"a": 3.0}[rid] * (2 if t == 0.9 else 1))
    assert p.predict(["a"], np.zeros((1, 10))).tolist() == [[3.0, 6.0]]


def test_refresh_curve_counts_down_between_refreshes():
    # one request: true remaining 4,3,2,1; committed 0,1,2,3; model says 5 at every state
    pred, labels = np.full(4, 5.0), np.array([4.0, 3, 2, 1])
    committed, owner = np.array([0, 1, 2, 3]), np.zeros(4, int)
    curve = refresh_curve(pred, labels, committed, owner, ks=(1, 4))
    assert curve[1] == pytest.approx(np.mean([1 / 4, 2 / 3, 3 / 2, 4 / 1]))
    assert curve[4] == pytest.approx(np.mean([1 / 4, 1 / 3, 1 / 2, 1 / 1]))  # 5,4,3,2
    assert choose_k({1: 0.20, 2: 0.205, 4: 0.211, 8: 0.3}) == 2


def test_create_predictor_by_name(tmp_path):
    from dilaserve.control.predictor import create_predictor

    trajs = [synthetic(p, t) for t in (0.5, 0.9) for p in range(20)]
    cfg = PredictorConfig(model="unused", out=str(tmp_path / "pred"), thresholds=(0.5, 0.9))
    fit_and_report(trajs, cfg, tmp_path, log=lambda *_: None)
    folder = tmp_path / "pred"
    assert create_predictor("full", folder).name == "full"
    assert create_predictor("progress", folder).name == "progress"
    assert create_predictor("one-shot", folder).thresholds == (0.5, 0.9)
    assert create_predictor("oracle", folder, truth=lambda r, t: 2.0).name == "oracle"
    with pytest.raises(ValueError, match="oracle"):
        create_predictor("oracle", folder)
    with pytest.raises(ValueError, match="not one of"):
        create_predictor("magic", folder)


def test_train_predictor_refits_from_recorded_trajectories_without_a_model(tmp_path):
    save_trajectories(tmp_path / "t.npz", [synthetic(p, t) for t in (0.5, 0.9) for p in range(40)])
    cfg = PredictorConfig(
        model="no-such-checkpoint",  # never loaded: nothing is recorded
        out=str(tmp_path / "pred"),
        thresholds=(0.5, 0.9),
        runs=str(tmp_path / "runs"),
        trajectories=str(tmp_path / "t.npz"),
    )
    out = train_predictor(cfg, log=lambda *_: None)
    assert load_gbm(out).thresholds == (0.5, 0.9)
    [run] = (tmp_path / "runs").iterdir()
    assert not (run / "trajectories.npz").exists()  # they stay where they were recorded
    assert (run / "summary.json").exists()


@pytest.mark.parametrize("lengths", [(64, 64, 64), (32, 96, 64)])
def test_request_states_from_counters_match_the_features_read_from_masks(lengths):
    from dilaserve.control.features import request_states, state_matrix
    from dilaserve.protocol import StepKind
    from dilaserve.request import Request
    from dilaserve.sim.behaviour import ParametricBehaviour

    behaviour = ParametricBehaviour(seed=3)
    requests = [Request(f"r{i}", (3,) * 5, n, BLOCK, 1, 0.7) for i, n in enumerate(lengths)]
    for steps, r in zip((2, 5, 9), requests):  # mid-block, block boundaries alike
        for _ in range(steps):
            r.apply(behaviour.step(r, r.threshold, StepKind.CACHE))
    width = max(lengths)
    masks = np.zeros((len(requests), width), bool)
    confs = np.zeros((len(requests), width), np.float32)
    for i, r in enumerate(requests):
        masks[i, : r.gen_len], confs[i, : r.gen_len] = r.committed, r.confidences
    steps = np.array([r.num_steps for r in requests])
    expected = state_matrix(masks, confs, steps, BLOCK, np.array(lengths))
    np.testing.assert_array_equal(request_states(requests), expected)


@pytest.mark.parametrize("length", [1, 2, 7, 32])
def test_confidence_statistics_are_numpys(length):
    conf = np.random.default_rng(length).random(length).astype(np.float32)
    committed = np.zeros(length, bool)
    row = state_features(committed, conf, steps_done=0, block_len=1)
    wide = conf.astype(np.float64)
    expected = [wide.min(), *np.quantile(wide, [0.25, 0.5]), wide.mean(), np.quantile(wide, 0.75)]
    np.testing.assert_allclose(row[5:], expected, rtol=1e-12)


def test_gbm_predictions_through_the_c_api_equal_lightgbms_own():
    from dilaserve.config import BUNDLED_PREDICTOR
    from dilaserve.control.features import feature_matrix

    model = load_gbm(BUNDLED_PREDICTOR, "full")
    rng = np.random.default_rng(0)
    states = [
        state_features(rng.random(GEN) < p, rng.random(GEN).astype(np.float32), s, BLOCK)
        for p, s in ((0.0, 0), (0.3, 3), (0.8, 9))
    ]
    rows = feature_matrix(np.stack(states), model.thresholds)
    pred = model.predict(["a", "b", "c"], np.stack(states))
    expected = np.maximum(model.booster.predict(rows), 1.0).reshape(3, -1)
    np.testing.assert_array_equal(pred, expected)
    assert len(set(pred.ravel().round(6))) > 1  # the rows differ, so the check has teeth
    with pytest.raises(ValueError, match="features given"):
        model._trees.predict(rows[:, :3])


def test_a_predictor_at_some_thresholds_predicts_their_columns_exactly():
    """`at`: the scheduler's ladder only (the rows of other thresholds are not computed), in
    the ladder's order, each number the whole predictor's."""
    from dilaserve.config import BUNDLED_PREDICTOR

    full = load_gbm(BUNDLED_PREDICTOR, "full")
    rng = np.random.default_rng(0)
    states = np.stack(
        [
            state_features(rng.random(GEN) < 0.3, rng.random(GEN).astype(np.float32), s, BLOCK)
            for s in range(5)
        ]
    )
    every = full.predict(["r"] * 5, states)
    ladder = (full.thresholds[-1], full.thresholds[0])
    some = full.at(ladder)
    assert some.thresholds == ladder
    assert some.predict(["r"] * 5, states).tolist() == every[:, [-1, 0]].tolist()
    oracle = OraclePredictor((0.5, 0.9), lambda rid, t: 2.0 * t).at((0.9,))
    assert oracle.predict(["a"], states[:1]).tolist() == [[1.8]]
    one_shot = OneShotPredictor((0.5, 0.9), {0.5: 0.25, 0.9: 0.5}).at((0.9,))
    assert one_shot.predict(["r"], states[:1]).shape == (1, 1)
    with pytest.raises(ValueError, match=r"no predictions for thresholds \[0.65\]"):
        full.at((0.65,))
