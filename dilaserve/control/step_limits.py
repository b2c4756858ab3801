"""The steps a request's decoding knobs allow it: what every step prediction (the trained
predictor, the one-shot table, DWS's prior) is held within before the control plane prices it.

A step predictor learns the steps of the rule it was calibrated under; a request may run under
knobs its calibration never saw. The family's rule fixes hard limits that hold whatever the
predictor learned:

- a step schedule (`Request.steps`, LLaDA2's `steps`): a block ends after at most that many
  steps (`DecodingRule.min_commits`, `StepDecider._ends_block`); without one, every step
  commits a masked position at least, so no more steps are left than masked positions (a pick
  of the mask token, LLaDA2.1's, commits none, but only weights that rank the mask first make
  one, which a trained model's do not);
- token editing (`Request.edits`): after a block's masks are committed it runs at most
  `MAX_EDIT_STEPS` edit-only steps (`Request.post_steps` of them run so far);
- a whole-window budget (`Request.step_budget`, Dream `none`): after k steps at most k times the
  budget are committed (`DecodingRule.max_commits`), so the window takes at least
  ceil(gen_len / budget) steps in all. The floor is the whole window's: an answer that stops
  early at a stop token takes fewer, so it is priced on the safe side.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dilaserve.protocol import MAX_EDIT_STEPS

MIN_STEPS = 1.0


def step_limits(requests: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """(fewest, most) remaining steps of each request as it stands, float64 [n] each."""
    most = [_most_steps(r) for r in requests]
    fewest = [min(_fewest_steps(r), m) for r, m in zip(requests, most)]
    return np.array(fewest, dtype=np.float64), np.array(most, dtype=np.float64)


def within_limits(rows: np.ndarray, requests: Sequence) -> np.ndarray:
    """`rows` [n, thresholds] of predicted remaining steps, each request's row held within its
    `step_limits` (fewest <= most, so `minimum(maximum(...))` is `np.clip`, without its
    Python wrapper: it runs on every prediction)."""
    fewest, most = step_limits(requests)
    rows = np.maximum(np.asarray(rows, dtype=np.float64), fewest[:, None])
    return np.minimum(rows, most[:, None], out=rows)


def _most_steps(r) -> float:
    """Steps left at most: a schedule's steps for each block left (less those the current one
    ran), else one per masked position (every such step commits one at least), plus each block
    left's edit-only steps (less those the current one ran)."""
    blocks_left = max(r.blocks_left, 1)
    if r.steps is not None:
        mask_steps = r.steps * blocks_left - r.block_step
    else:
        mask_steps = r.gen_len - r.num_committed
    edit_steps = MAX_EDIT_STEPS * blocks_left - r.post_steps if r.edits else 0
    return max(float(mask_steps + edit_steps), MIN_STEPS)


def _fewest_steps(r) -> float:
    """Steps left at least: the whole window's at a whole-window budget, else one."""
    if r.step_budget is None:
        return MIN_STEPS
    return max(float(-(-r.gen_len // r.step_budget) - r.num_steps), MIN_STEPS)
