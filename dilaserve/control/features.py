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
    committed: np.ndarray,
    confidences: np.ndarray,
    steps_done: np.ndarray,
    block_len: int,
    lengths: np.ndarray | None = None,
    offsets: np.ndarray | None = None,
) -> np.ndarray:
    """`state_features` of n requests at once: [n, width] -> [n, 10].

    Rows may have different output lengths (`lengths`; cells past a row's length are padding
    and ignored), so one call serves a whole scheduling round. `offsets`: each row's
    `block_offset` (block-causal models: blocks at absolute positions; default 0).
    """
    n, width = committed.shape
    rows = np.arange(n)
    gen_len = np.full(n, width) if lengths is None else np.asarray(lengths)
    offset = np.zeros(n, dtype=np.int64) if offsets is None else np.asarray(offsets)
    pad = np.arange(width)[None, :] >= gen_len[:, None]
    done = committed & ~pad
    first_masked = np.argmin(done | pad, axis=1)
    first_masked = np.where((done | pad).all(axis=1), gen_len, first_masked)
    num_blocks = -(-(gen_len + offset) // block_len)
    block = (first_masked + offset) // block_len
    counts = np.zeros((n, width + 1))
    np.cumsum(done, axis=1, out=counts[:, 1:])
    start = np.clip(block * block_len - offset, 0, gen_len)
    end = np.clip((block + 1) * block_len - offset, 0, gen_len)
    in_block = np.where(
        block < num_blocks, (counts[rows, end] - counts[rows, start]) / block_len, 1.0
    )
    progress = (
        np.asarray(steps_done, dtype=np.float64) / gen_len,
        counts[:, -1] / gen_len,
        block / num_blocks,
        in_block,
    )
    return _with_confidences(gen_len, progress, confidences, pad)


def _with_confidences(gen_len, progress, confidences: np.ndarray, pad) -> np.ndarray:
    """The state rows: output length, the four progress columns, then the confidence
    statistics over each row's first `gen_len` cells (`pad` marks the others, or is None)."""
    conf = confidences.astype(np.float64)
    if pad is None:  # sorted before widening (faster for float32; the same values)
        return _state_rows(gen_len, progress, np.sort(confidences, axis=1), conf.sum(axis=1), None)
    ordered = np.sort(np.where(pad, np.inf, conf), axis=1)
    return _state_rows(gen_len, progress, ordered, np.where(pad, 0.0, conf).sum(axis=1), gen_len)


def _state_rows(gen_len, progress, ordered: np.ndarray, total: np.ndarray, lengths) -> np.ndarray:
    """Rows from each row's confidences sorted ascending and their sum (float64); `lengths`:
    the cells of each sorted row that count (the rest sort after them), or None for all. The
    statistics are read in float64 whatever `ordered`'s type (sorted float32 is widened only
    where read: the same values)."""
    q = _quartiles(ordered, lengths)
    rows = np.empty((len(ordered), NUM_FEATURES - 1))  # (`np.column_stack`'s, written in place)
    rows[:, 0] = gen_len
    for i, column in enumerate(progress, start=1):
        rows[:, i] = column
    rows[:, 5] = ordered[:, 0]
    rows[:, 6:8] = q[:, :2]
    rows[:, 8] = total / gen_len
    rows[:, 9] = q[:, 2]
    return rows


_QUARTILES = np.array([0.25, 0.5, 0.75])


def _quartiles(ordered: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """[n, 3]: the 25th, 50th and 75th percentiles of each sorted row's first `lengths` cells
    (None: whole rows), interpolated linearly as numpy's default (a few times faster than
    np.quantile on small rows)."""
    n, width = ordered.shape
    last = (np.full(n, width - 1) if lengths is None else lengths - 1)[:, None]
    pos = last * _QUARTILES
    lo = np.floor(pos).astype(np.int64)
    rows = np.arange(n)[:, None]
    below = ordered[rows, lo].astype(np.float64)
    above = ordered[rows, np.minimum(lo + 1, last)].astype(np.float64)
    return below + (above - below) * (pos - lo)


def feature_matrix(states: np.ndarray, thresholds) -> np.ndarray:
    """Rows for every (state, threshold) pair: [len(states) * len(thresholds), 11].

    Row order is state-major: the rows of state i are i*T .. i*T + T - 1.
    """
    states = np.atleast_2d(states)
    n, width = states.shape
    rows = np.empty((n, len(thresholds), width + 1))
    rows[:, :, 0] = thresholds
    rows[:, :, 1:] = states[:, None, :]
    return rows.reshape(-1, width + 1)


def request_states(requests) -> np.ndarray:
    """`state_matrix` of `Request`s in flight, in one pass. Blocks complete in order, so the
    progress columns come from each request's counters (the committed positions are the blocks
    before `current_block` and part of it); only the confidences are read as arrays, shorter
    outputs padded to the longest. A block whose masks are all committed but whose edit-only
    steps go on (token editing) counts as done, as its committed positions alone say (the
    trajectories the predictor learns from record commits, not the edit phase)."""
    block_len = requests[0].block_len
    counters = np.array(
        [
            (
                r.gen_len,
                r.num_steps,
                r.num_committed,
                r.current_block + (r.edit_block is not None),
                r.num_blocks,
                r.block_offset,
            )
            for r in requests
        ],
        dtype=np.int64,
    )
    gen_len, steps, committed, block, num_blocks, offset = counters.T
    start = np.maximum(block * block_len - offset, 0)  # the current block's first position
    in_block = np.where(block < num_blocks, (committed - start) / block_len, 1.0)
    progress = (steps / gen_len, committed / gen_len, block / num_blocks, in_block)
    width = int(gen_len.max())
    if (gen_len == width).all():  # one length: stacked without padding
        return _with_confidences(
            gen_len, progress, np.stack([r.confidences for r in requests]), None
        )
    # padded twice: with zeros to sum in float64 (the same sums as `state_matrix`), and
    # sorted as float32, each row alone (less to sort than padded rows), then +inf after it
    zeros = np.zeros((len(requests), width))
    ordered = np.full((len(requests), width), np.inf, dtype=np.float32)
    for i, r in enumerate(requests):
        zeros[i, : r.gen_len] = r.confidences
        ordered[i, : r.gen_len] = np.sort(r.confidences)
    return _state_rows(gen_len, progress, ordered, zeros.sum(axis=1), gen_len)
