"""`dilaserve train-predictor`: collect engine trajectories, train and compare step predictors.

Runs every prompt under every candidate threshold on the real engine, logging each step; splits
by prompt (held-out prompts never train); fits the one-shot baseline and LightGBM on progress
and on all 11 features; reports each variant's mean relative error on held-out states, and the
error of the full model when predictions refresh only every k newly committed tokens, choosing
the largest k within 5% (relative) of per-token refreshes, as the paper does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dilaserve.config import MEASURED_THRESHOLDS
from dilaserve.control.features import FEATURE_NAMES, PROGRESS_FEATURES, state_matrix
from dilaserve.control.predictor import OneShotPredictor, fit_gbm, save_gbm
from dilaserve.runs import create_run_dir, environment, markdown_table, write_json
from dilaserve.trajectory import Trajectory, load_trajectories, save_trajectories

PAPER_ERRORS = {"one-shot": 0.750, "progress": 0.351, "full": 0.193, "oracle": 0.0}
REFRESH_KS = (1, 2, 4, 8, 16, 32)
TREE_SHAPES = ((15, 20), (31, 50), (63, 100))  # (leaves, min rows per leaf), picked on validation
K_TOLERANCE = 0.05


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    model: str
    out: str  # folder for the trained predictor
    num_prompts: int = 120
    thresholds: tuple[float, ...] = MEASURED_THRESHOLDS
    max_tokens: int = 64
    held_out_fraction: float = 0.2
    runs: str = "runs"
    seed: int = 0
    trajectories: str | None = None  # refit from a run folder's trajectories.npz: no recording

    def __post_init__(self):
        if self.num_prompts < 5:
            raise ValueError(f"{self.num_prompts=} must be at least 5")
        if not 0 < self.held_out_fraction < 1:
            raise ValueError(f"{self.held_out_fraction=} must be in (0, 1)")


def trajectory_rows(trajs: list[Trajectory]):
    """(states [n, 10], thresholds [n], remaining steps [n], committed counts [n], traj index)."""
    states, thresholds, labels, committed, owner = [], [], [], [], []
    for i, t in enumerate(trajs):
        steps, masks, confs = zip(*((s, m, c) for s, m, c in t.states()))
        masks = np.stack(masks)
        offsets = np.full(len(steps), t.block_offset)
        states.append(
            state_matrix(masks, np.stack(confs), np.array(steps), t.block_len, offsets=offsets)
        )
        n = len(steps)
        thresholds.append(np.full(n, t.threshold))
        labels.append(t.num_steps - np.array(steps, dtype=np.float64))
        committed.append(masks.sum(axis=1))
        owner.append(np.full(n, i))
    return tuple(np.concatenate(x) for x in (states, thresholds, labels, committed, owner))


def own_threshold_predictions(predictor, states: np.ndarray, thresholds: np.ndarray):
    """Each state's prediction at the threshold its trajectory actually ran."""
    pred = predictor.predict([""] * len(states), states)
    column = np.array([predictor.thresholds.index(t) for t in thresholds])
    return pred[np.arange(len(states)), column]


def relative_error(pred: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - truth) / truth))


def refresh_curve(pred: np.ndarray, labels, committed, owner, ks=REFRESH_KS) -> dict[int, float]:
    """Mean relative error when predictions refresh only every k newly committed tokens.

    Between refreshes a request's estimate counts down one per step taken.
    """
    curve = {}
    for k in ks:
        estimate = np.empty_like(pred)
        anchor_pred, anchor_step, anchor_tokens = pred[0], 0, committed[0]
        for i in range(len(pred)):
            new_request = i > 0 and owner[i] != owner[i - 1]
            if new_request or committed[i] - anchor_tokens >= k:
                anchor_pred, anchor_step, anchor_tokens = pred[i], i, committed[i]
            estimate[i] = max(anchor_pred - (i - anchor_step), 1.0)
        curve[k] = relative_error(estimate, labels)
    return curve


def choose_k(curve: dict[int, float], tolerance: float = K_TOLERANCE) -> int:
    return max(k for k, err in curve.items() if err <= curve[1] * (1 + tolerance))


def one_shot_rates(trajs: list[Trajectory]) -> dict[float, float]:
    rates: dict[float, list[float]] = {}
    for t in trajs:
        rates.setdefault(t.threshold, []).append(t.num_steps / t.gen_len)
    return {g: float(np.mean(v)) for g, v in rates.items()}


def edit_steps_per_block(trajs: list[Trajectory]) -> float | None:
    """Token editing: the mean edit-only steps a block ran after its masks were committed,
    over the blocks of the trajectories recorded with editing (None: none were)."""
    edited = [t for t in trajs if t.edits]
    blocks = sum(
        len({(int(p) + t.block_offset) // t.block_len for c in t.commits for p in c})
        for t in edited
    )
    if not blocks:
        return None
    return sum(sum(t.edit_steps_by_block().values()) for t in edited) / blocks


def split(trajs: list[Trajectory], fraction: float, seed: int):
    prompts = sorted({t.prompt_index for t in trajs})
    rng = np.random.default_rng(seed)
    held = set(rng.choice(prompts, size=max(1, int(len(prompts) * fraction)), replace=False))
    return (
        [t for t in trajs if t.prompt_index not in held],
        [t for t in trajs if t.prompt_index in held],
    )


def rows_and_labels(trajs: list[Trajectory]) -> tuple[np.ndarray, np.ndarray]:
    """11-feature rows (threshold first) and remaining-step labels."""
    states, thresholds, labels, _, _ = trajectory_rows(trajs)
    return np.hstack((thresholds[:, None], states)), labels


def choose_tree_shape(train: list[Trajectory], features, cfg: PredictorConfig, log=print):
    """The tree shape with the lowest error on validation prompts split off the training ones."""
    fit, val = split(train, cfg.held_out_fraction, cfg.seed + 1)
    (fit_rows, fit_labels), (val_rows, val_labels) = rows_and_labels(fit), rows_and_labels(val)
    errors = {}
    for shape in TREE_SHAPES:
        p = fit_gbm(fit_rows, fit_labels, cfg.thresholds, features, cfg.seed, shape)
        pred = own_threshold_predictions(p, val_rows[:, 1:], val_rows[:, 0])
        errors[shape] = relative_error(pred, val_labels)
    best = min(errors, key=errors.get)
    log(f"validation error by tree shape (leaves, min rows per leaf): {errors}; chose {best}")
    return best


def fit_and_report(
    trajs: list[Trajectory], cfg: PredictorConfig, run: Path, log=print, extra: dict | None = None
) -> dict:
    """Fit and compare the predictors, save the full and progress ones to `cfg.out` (their
    meta: the refresh period, the one-shot table, the edit-only steps per block and `extra`),
    and report into `run`."""

    train, test = split(trajs, cfg.held_out_fraction, cfg.seed)
    tr_rows, tr_labels = rows_and_labels(train)
    te_states, te_thr, te_labels, te_committed, te_owner = trajectory_rows(test)
    shapes = {f: choose_tree_shape(train, f, cfg, log) for f in (PROGRESS_FEATURES, FEATURE_NAMES)}
    predictors = {
        "one-shot": OneShotPredictor(cfg.thresholds, one_shot_rates(train)),
        **{
            name: fit_gbm(tr_rows, tr_labels, cfg.thresholds, f, cfg.seed, shapes[f])
            for name, f in (("progress", PROGRESS_FEATURES), ("full", FEATURE_NAMES))
        },
    }
    errors = {
        name: relative_error(own_threshold_predictions(p, te_states, te_thr), te_labels)
        for name, p in predictors.items()
    }
    errors["oracle"] = 0.0
    full_pred = own_threshold_predictions(predictors["full"], te_states, te_thr)
    curve = refresh_curve(full_pred, te_labels, te_committed, te_owner)
    k = choose_k(curve)
    out = Path(cfg.out)
    meta = {
        "refresh_every_tokens": k,
        "one_shot_steps_per_token": one_shot_rates(train),
        "edit_steps_per_block": edit_steps_per_block(trajs),
        **(extra or {}),
    }
    for name in ("progress", "full"):
        save_gbm(predictors[name], out, meta)
    table = [
        {"variant": n, "mean_relative_error": round(e, 4), "paper": PAPER_ERRORS[n]}
        for n, e in errors.items()
    ]
    summary = {
        "errors": errors,
        "refresh_curve": curve,
        "refresh_every_tokens": k,
        "num_train_states": len(tr_labels),
        "num_test_states": len(te_labels),
        "num_trajectories": len(trajs),
        "edit_steps_per_block": meta["edit_steps_per_block"],
        "tree_shapes": {"progress": shapes[PROGRESS_FEATURES], "full": shapes[FEATURE_NAMES]},
    }
    columns = ["variant", "mean_relative_error", "paper"]
    report = (
        f"# step predictor\n\n{markdown_table(table, columns)}\n\n"
        f"refresh every k tokens (full model): {curve}; chosen k = {k}\n"
    )
    (run / "report.md").write_text(report)
    write_json(run / "summary.json", summary)
    log(report)
    return summary


def train_predictor(cfg: PredictorConfig, log=print) -> Path:
    from dilaserve.config import EngineConfig
    from dilaserve.engine.llm import LLM
    from dilaserve.engine.record import record_trajectories
    from dilaserve.tasks import arith

    run = create_run_dir(cfg.runs, "train-predictor")
    write_json(run / "config.json", {**asdict(cfg), "environment": environment()})
    if cfg.trajectories is not None:  # they stay in the run folder they were recorded in
        trajs = load_trajectories(cfg.trajectories)
    else:
        llm = LLM(cfg.model, EngineConfig(kv_cache="dual"))
        prompts = [
            p.question for p in arith.generate(cfg.num_prompts, seed=cfg.seed + 77, split="test")
        ]
        trajs = record_trajectories(llm, prompts, cfg.thresholds, cfg.max_tokens)
        save_trajectories(run / "trajectories.npz", trajs)
    fit_and_report(trajs, cfg, run, log)
    log(f"predictor written to {cfg.out}; run folder: {run}")
    return Path(cfg.out)
