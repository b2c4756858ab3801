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
    return state_matrix(committed[None], confidences[None], np.array([steps_done]), block_len)[0]


def state_matrix(
    committed: np.ndarray, confidences: np.ndarray, steps_done: np.ndarray, block_len: int
) -> np.ndarray:
    """`state_features` of n requests with one output length: [n, gen_len] -> [n, 10]."""
    n, gen_len = committed.shape
    num_blocks = gen_len // block_len
    first_masked = np.where(committed.all(axis=1), gen_len, np.argmin(committed, axis=1))
    block = first_masked // block_len
    per_block = committed.reshape(n, num_blocks, block_len).sum(axis=2)
    in_block = np.where(
        block < num_blocks,
        per_block[np.arange(n), np.minimum(block, num_blocks - 1)] / block_len,
        1.0,
    )
    conf = confidences.astype(np.float64)
    q25, median, q75 = _quartiles(np.sort(conf, axis=1))
    return np.column_stack(
        (
            np.full(n, gen_len, dtype=np.float64),
            np.asarray(steps_done, dtype=np.float64) / gen_len,
            committed.sum(axis=1) / gen_len,
            block / num_blocks,
            in_block,
            conf.min(axis=1),
            q25,
            median,
            conf.mean(axis=1),
            q75,
        )
    )


def _quartiles(ordered: np.ndarray) -> list[np.ndarray]:
    """25th, 50th and 75th percentiles of each sorted row, interpolated linearly as numpy's
    default (a few times faster than np.quantile on small rows)."""
    last = ordered.shape[1] - 1
    out = []
    for q in (0.25, 0.5, 0.75):
        pos = q * last
        lo = int(pos)
        hi = min(lo + 1, last)
        out.append(ordered[:, lo] + (ordered[:, hi] - ordered[:, lo]) * (pos - lo))
    return out


def feature_matrix(states: np.ndarray, thresholds) -> np.ndarray:
    """Rows for every (state, threshold) pair: [len(states) * len(thresholds), 11].

    Row order is state-major: the rows of state i are i*T .. i*T + T - 1.
    """
    states = np.atleast_2d(states)
    ladder = np.asarray(thresholds, dtype=np.float64)
    rep = np.repeat(states, len(ladder), axis=0)
    col = np.tile(ladder, len(states))[:, None]
    return np.hstack((col, rep))
