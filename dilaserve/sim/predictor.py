"""A step predictor for simulated behaviour, trained the way `dilaserve train-predictor` trains
one on the real engine: run sample requests to completion at every candidate threshold, log every
step, fit LightGBM on the 11 features. A parametric behaviour model needs its own predictor (the
bundled model's knows nothing of LLaDA-8B-sized generations)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dilaserve.control.features import FEATURE_NAMES
from dilaserve.control.predictor import GBMPredictor, fit_gbm
from dilaserve.protocol import KVCacheMode, block_offset
from dilaserve.request import Request
from dilaserve.training.train_predictor import rows_and_labels
from dilaserve.trajectory import Trajectory

TREE_SHAPE = (31, 50)


def run_alone(behaviour, r: Request, mode: KVCacheMode) -> Trajectory:
    """One request to completion at its threshold, alone, logging every step."""
    kinds, commits, confidences = [], [], []
    while not r.is_finished:
        kind = r.next_kind(mode, has_cache=r.num_steps > 0)
        result = behaviour.step(r, r.threshold, kind)
        r.apply(result)
        kinds.append(kind.value)
        commits.append(result.positions.copy())
        confidences.append(result.confidences.copy())
    forget = getattr(behaviour, "forget", None)
    if forget is not None:
        forget(r.request_id)
    return Trajectory(
        int(r.request_id.removeprefix("p")),
        r.threshold,
        r.prompt_len,
        r.gen_len,
        r.block_len,
        tuple(kinds),
        tuple(commits),
        np.stack(confidences),
        r.block_offset,
    )


def simulated_trajectories(
    behaviour,
    shapes: Sequence[tuple[int, int]],
    thresholds: Sequence[float],
    *,
    block_len: int,
    mode: KVCacheMode,
) -> list[Trajectory]:
    """Every (prompt length, output length) shape run at every threshold; shape i is prompt
    `p{i}`, the same prompt at each threshold. With an exact cache (block diffusion) blocks sit
    at absolute positions."""
    out = []
    for threshold in thresholds:
        for i, (prompt_len, gen_len) in enumerate(shapes):
            offset = block_offset(prompt_len, block_len, mode is KVCacheMode.BLOCK)
            r = Request(
                f"p{i}", (3,) * prompt_len, gen_len, block_len, 1, threshold, block_offset=offset
            )
            out.append(run_alone(behaviour, r, mode))
    return out


def train_sim_predictor(
    behaviour,
    shapes: Sequence[tuple[int, int]],
    thresholds: Sequence[float],
    *,
    block_len: int,
    mode: KVCacheMode,
    seed: int = 0,
    features: Sequence[str] = FEATURE_NAMES,
) -> GBMPredictor:
    trajs = simulated_trajectories(behaviour, shapes, thresholds, block_len=block_len, mode=mode)
    rows, labels = rows_and_labels(trajs)
    return fit_gbm(rows, labels, tuple(thresholds), features, seed, TREE_SHAPE)
