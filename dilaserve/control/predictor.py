"""The step predictor: remaining denoising steps of a request under each candidate threshold.

Variants behind one interface, `predict(request_ids, states) -> [n, len(thresholds)]`, and
`at(thresholds)`: the same predictor predicting at those of its thresholds only:
- `OneShotPredictor`: output length times the historical mean steps per output token at each
  threshold, minus the steps already done (the paper's one-shot baseline);
- `GBMPredictor`: LightGBM on the progress features only, or on all 11 features;
- `OraclePredictor`: the true remaining steps (simulation, from recorded trajectories).
`states` rows are `features.state_features` vectors. All predictions are at least one step.
"""

from __future__ import annotations

import ctypes
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from dilaserve.config import MEASURED_THRESHOLDS
from dilaserve.control.features import FEATURE_NAMES, feature_matrix

MIN_STEPS = 1.0
# Predictions run on every scheduling round, at a cost that grows with the trees: on the bundled
# model's held-out states 60 trees of 63 leaves err as 120 do (18.6% against 18.5%) at about
# half the prediction time (0.10 against 0.18 ms for 70 rows); 40 err 19.2%.
NUM_TREES = 60


# LightGBM's wrappers this project does not use; `import lightgbm` loads them wherever they are
# installed (sentence-transformers, in the dws extra, brings scikit-learn): 1.7 s or more
_LIGHTGBM_HIDDEN = ("sklearn", "pandas")


def _import_lightgbm():
    """`lightgbm` imported without its scikit-learn and pandas wrappers (Booster and train are
    the same without them); the hidden packages stay importable afterwards."""
    if "lightgbm" in sys.modules:
        return sys.modules["lightgbm"]
    hidden = [name for name in _LIGHTGBM_HIDDEN if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # lightgbm's `try: import ...` then takes its fallback
    try:
        import lightgbm
    finally:
        for name in hidden:
            del sys.modules[name]
    return lightgbm


class OneShotPredictor:
    name = "one-shot"

    def __init__(self, thresholds: Sequence[float], steps_per_token: dict[float, float]):
        self.thresholds = tuple(thresholds)
        self.steps_per_token = steps_per_token

    def at(self, thresholds: Sequence[float]) -> OneShotPredictor:
        return OneShotPredictor(_covered(self, thresholds), self.steps_per_token)

    def predict(self, request_ids: Sequence[str], states: np.ndarray) -> np.ndarray:
        states = np.atleast_2d(states)
        gen_len, done = states[:, 0], states[:, 0] * states[:, 1]
        rates = np.array([self.steps_per_token[t] for t in self.thresholds])
        return np.maximum(gen_len[:, None] * rates[None, :] - done[:, None], MIN_STEPS)


class _Trees:
    """`Booster.predict` on a float64 matrix, straight through LightGBM's C API: the same
    numbers without the Python wrapper's checks, which cost about 25 us a call: half the time
    of predicting a few requests (the simulator's busiest 600 s of the paper trace predicts
    17,000 times, for 15.5 requests on average)."""

    def __init__(self, booster):
        from lightgbm.basic import _LIB

        self._lib, self._booster = _LIB, booster
        self._num_features = booster.num_feature()
        self._out_len = ctypes.c_int64()

    def predict(self, rows: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(rows, dtype=np.float64)
        if rows.shape[1] != self._num_features:
            raise ValueError(f"{rows.shape[1]} features given, the trees read {self._num_features}")
        out = np.empty(len(rows))
        status = self._lib.LGBM_BoosterPredictForMat(
            self._booster._handle,
            ctypes.c_void_p(rows.ctypes.data),  # (not `data_as`: a reference cycle per call)
            1,  # float64
            len(rows),
            rows.shape[1],
            1,  # row-major
            0,  # normal prediction
            0,  # from the first iteration
            -1,  # through the last
            b"",
            ctypes.byref(self._out_len),
            ctypes.c_void_p(out.ctypes.data),
        )
        if status != 0:
            raise RuntimeError(self._lib.LGBM_GetLastError().decode())
        return out


class GBMPredictor:
    def __init__(self, thresholds: Sequence[float], booster, features: Sequence[str]):
        self.thresholds = tuple(thresholds)
        self.booster = booster
        self._trees = _Trees(booster)
        self.features = tuple(features)
        self.name = "full" if len(self.features) == len(FEATURE_NAMES) else "progress"
        columns = [FEATURE_NAMES.index(f) for f in self.features]
        self._columns = None if columns == list(range(len(FEATURE_NAMES))) else columns

    def at(self, thresholds: Sequence[float]) -> GBMPredictor:
        """The same trees predicting at `thresholds` only: each row is predicted alone, so
        the same numbers, without the rows of thresholds nobody reads."""
        return GBMPredictor(_covered(self, thresholds), self.booster, self.features)

    def predict(self, request_ids: Sequence[str], states: np.ndarray) -> np.ndarray:
        rows = feature_matrix(states, self.thresholds)
        if self._columns is not None:
            rows = rows[:, self._columns]
        pred = self._trees.predict(rows).reshape(-1, len(self.thresholds))
        return np.maximum(pred, MIN_STEPS)


class OraclePredictor:
    name = "oracle"

    def __init__(self, thresholds: Sequence[float], truth: Callable[[str, float], float]):
        self.thresholds = tuple(thresholds)
        self.truth = truth

    def at(self, thresholds: Sequence[float]) -> OraclePredictor:
        return OraclePredictor(_covered(self, thresholds), self.truth)

    def predict(self, request_ids: Sequence[str], states: np.ndarray) -> np.ndarray:
        return np.array(
            [[max(self.truth(r, t), MIN_STEPS) for t in self.thresholds] for r in request_ids],
            dtype=np.float64,
        )


def _covered(predictor, thresholds: Sequence[float]) -> tuple[float, ...]:
    """`thresholds`, each one the predictor predicts at (else a clear error)."""
    missing = set(thresholds) - set(predictor.thresholds)
    if missing:
        raise ValueError(
            f"the step predictor has no predictions for thresholds "
            f"{sorted(missing)} (it covers {predictor.thresholds})"
        )
    return tuple(thresholds)


def fit_gbm(
    rows: np.ndarray,
    labels: np.ndarray,
    thresholds: Sequence[float],
    features: Sequence[str] = FEATURE_NAMES,
    seed: int = 0,
    tree_shape: tuple[int, int] = (15, 20),
) -> GBMPredictor:
    """Train LightGBM on (11-feature rows, remaining steps).

    The objective is the mean relative error the predictor is judged by: an L1 loss with each
    row weighted by 1 / its true remaining steps, whose minimiser is the weighted median (on the
    bundled model's held-out prompts this cut the error from 25.0% to 20.4% over plain L1).
    `tree_shape` is (leaves per tree, minimum rows per leaf).
    """
    lightgbm = _import_lightgbm()

    columns = [FEATURE_NAMES.index(f) for f in features]
    params = {
        "objective": "regression_l1",
        "learning_rate": 0.1,
        "num_leaves": tree_shape[0],
        "min_data_in_leaf": tree_shape[1],
        "verbose": -1,
        "seed": seed,
        "num_threads": 1,
    }
    data = lightgbm.Dataset(
        rows[:, columns], labels, weight=1.0 / labels, feature_name=list(features)
    )
    return GBMPredictor(
        thresholds, lightgbm.train(params, data, num_boost_round=NUM_TREES), features
    )


def save_gbm(predictor: GBMPredictor, folder: Path, extra: dict | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    predictor.booster.save_model(str(folder / f"gbm-{predictor.name}.txt"))
    meta = {"thresholds": predictor.thresholds, "features": predictor.features, **(extra or {})}
    (folder / f"gbm-{predictor.name}.json").write_text(json.dumps(meta, indent=2) + "\n")


def load_gbm(folder: Path, name: str = "full") -> GBMPredictor:
    lightgbm = _import_lightgbm()

    folder = Path(folder)
    meta_path = folder / f"gbm-{name}.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"no step predictor '{name}' in {folder} ({meta_path.name})")
    meta = json.loads(meta_path.read_text())
    booster = lightgbm.Booster(model_file=str(folder / f"gbm-{name}.txt"))
    return GBMPredictor(meta["thresholds"], booster, meta["features"])


def create_predictor(name: str, folder: Path | None = None, truth=None):
    """A step predictor by policy name: full | progress (trained), one-shot, oracle."""
    if name == "oracle":
        if truth is None:
            raise ValueError("the oracle predictor needs the true remaining steps (simulation)")
        meta = json.loads((Path(folder) / "gbm-full.json").read_text()) if folder else {}
        return OraclePredictor(meta.get("thresholds", MEASURED_THRESHOLDS), truth)
    if folder is None:
        raise ValueError(f"step predictor {name!r} needs a trained predictor folder")
    if name == "one-shot":
        meta = json.loads((Path(folder) / "gbm-full.json").read_text())
        rates = {float(k): v for k, v in meta["one_shot_steps_per_token"].items()}
        return OneShotPredictor(meta["thresholds"], rates)
    if name in ("full", "progress"):
        return load_gbm(Path(folder), name)
    raise ValueError(f"step predictor {name!r} is not one of full, progress, one-shot, oracle")
