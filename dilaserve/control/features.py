"""The step predictor's 11 features (papers.md 1.6, Appendix A of DiLaServe).

Computed from a request's state after `steps_done` steps: which output positions are committed
and the confidence of every output position (latest top-1 probability while masked, commit-time
probability once committed), as the engine reports them in each `RequestStepResult`.
"""

from __future__ import annotations

import numpy as np

FEATURE_NAMES = (
    "confidence_threshold",
    "output_length",
    "full_progress",
    "full_unmask_progress",
    "block_progress",
    "block_unmask_progress",
    "output_min_confidence",
    "output_q25_confidence",
    "output_median_confidence",
    "output_avg_confidence",
    "output_q75_confidence",
)
PROGRESS_FEATURES = FEATURE_NAMES[:6]
NUM_FEATURES = len(FEATURE_NAMES)


def state_features(
    committed: np.ndarray, confidences: np.ndarray, steps_done: int, block_len: int
) -> np.ndarray:
    """The 10 threshold-independent features (everything but the threshold), float64."""
    gen_len = committed.shape[0]
    masked = np.flatnonzero(~committed)
    num_blocks = gen_len // block_len
    block = int(masked[0]) // block_len if masked.size else num_blocks
    in_block = committed[block * block_len : (block + 1) * block_len]
    q25, median, q75 = _quartiles(np.sort(confidences))
    return np.array(
        [
            gen_len,
            steps_done / gen_len,
            committed.sum() / gen_len,
            block / num_blocks,
            in_block.sum() / block_len if in_block.size else 1.0,
            confidences.min(),
            q25,
            median,
            confidences.mean(),
            q75,
        ],
        dtype=np.float64,
    )


def _quartiles(ordered: np.ndarray) -> tuple[float, float, float]:
    """25th, 50th and 75th percentiles of a sorted array (linear interpolation, as numpy's)."""
    last = ordered.shape[0] - 1
    out = []
    for q in (0.25, 0.5, 0.75):
        pos = q * last
        lo = int(pos)
        hi = min(lo + 1, last)
        out.append(float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)))
    return out[0], out[1], out[2]


def feature_matrix(states: np.ndarray, thresholds) -> np.ndarray:
    """Rows for every (state, threshold) pair: [len(states) * len(thresholds), 11].

    Row order is state-major: the rows of state i are i*T .. i*T + T - 1.
    """
    states = np.atleast_2d(states)
    ladder = np.asarray(thresholds, dtype=np.float64)
    rep = np.repeat(states, len(ladder), axis=0)
    col = np.tile(ladder, len(states))[:, None]
    return np.hstack((col, rep))
