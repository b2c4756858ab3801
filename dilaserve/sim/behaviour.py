"""What a simulated denoising step does to a request: which positions commit, with what
confidences (the inputs of the step predictor's features), and when the request finishes.

- `ParametricBehaviour`: a model of LLaDA-8B-like unmasking. Each request has a difficulty
  drawn once (log-normal); a step at threshold g commits, inside the current block, about
  T(g) / difficulty tokens (at least one, the top-1 fallback), with T(0.9) = `TOKENS_PER_STEP_09`
  and T falling 38% in steps from 0.9 to 0.7 (papers.md 1.1, Fig. 3a), geometrically between.
  Masked positions report confidences that are lower for harder requests, so the predictor's
  confidence features carry the signal they carry on a real model. Blocks are the request's own
  (`Request.block_offset`: a block-causal model's blocks sit at absolute positions, so the
  window's first block holds `block_len - block_offset` positions and its last `block_offset`).
  For LLaDA2.x (`tokens_per_step_for`) T is anchored at threshold 0.95 on the published tokens
  per forward (TPF) of the model cards, 2.55 for LLaDA2.0-mini and 3.19 for -flash (the
  LLaDA2.0-*-CAP cards' tables, averaged over 12 benchmarks); the cards do not give the
  threshold, so 0.95 (SGLang's and the DWS paper's default) is ASSUMED, and so is the fall
  below it, LLaDA-8B's 38% per 0.2 (no LLaDA2.x figure found).
- `ReplayBehaviour`: recorded trajectories of the real engine (`dilaserve train-predictor` writes
  them), replayed per (prompt, threshold); when the threshold changes mid-request the replay
  continues from the step of the new threshold's trajectory that had committed as many tokens.
  Trajectories recorded with token editing (`calibrate --editing`) replay each block's
  edit-only steps after its masks are committed, as many as the recorded run took there.
- The quality model the simulator reports (accuracy at a request's mean threshold) is
  `dilaserve.quality`'s.
"""

from __future__ import annotations

import bisect
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dilaserve.config import DEFAULT_BLOCK_LEN
from dilaserve.protocol import RequestStepResult, StepKind
from dilaserve.request import Request
from dilaserve.trajectory import Trajectory

TOKENS_PER_STEP_09 = 3.0  # LLaDA-8B, threshold 0.9, dual cache; shared with sim.latency
STEP_CUT_09_TO_07 = 0.38  # papers.md 1.1: 0.9 -> 0.7 cuts denoising steps by 38%
_TOKENS = np.full(4096, 7, np.int32)  # committed token ids (they do not matter), read-only
_TOKENS.flags.writeable = False


# LLaDA2.0 tokens per forward, published (model cards of LLaDA2.0-mini-CAP / -flash-CAP: the
# base models' TPF over 12 benchmarks); the threshold they were measured at is ASSUMED to be 0.95
LLADA2_THRESHOLD = 0.95
LLADA2_MINI_TOKENS_PER_STEP = 2.55
LLADA2_FLASH_TOKENS_PER_STEP = 3.19


@dataclass(frozen=True, slots=True)
class TokensPerStep:
    """T(g): mean tokens committed per step at threshold g: `tokens` at the `anchor` threshold
    and above, and `STEP_CUT_09_TO_07` fewer steps per 0.2 below it (geometric in g)."""

    anchor: float
    tokens: float
    source: str = ""  # where the numbers come from, for a run's summary

    def __call__(self, threshold: float) -> float:
        g = min(max(threshold, 0.0), self.anchor)
        return self.tokens * (1.0 - STEP_CUT_09_TO_07) ** ((g - self.anchor) / 0.2)


llada_tokens_per_step = TokensPerStep(
    0.9,
    TOKENS_PER_STEP_09,
    "tokens per step measured at 0.9 and 0.7 (the paper), extrapolated below 0.7",
)
_LLADA2_SOURCE = (
    "LLaDA2.0 tokens per forward from its model card, at an ASSUMED threshold 0.95; "
    "LLaDA-8B's fall below it (ASSUMED)"
)
TOKENS_PER_STEP_BY_MODEL = {
    "LLaDA2.0-mini": TokensPerStep(LLADA2_THRESHOLD, LLADA2_MINI_TOKENS_PER_STEP, _LLADA2_SOURCE),
    "LLaDA2.0-flash": TokensPerStep(LLADA2_THRESHOLD, LLADA2_FLASH_TOKENS_PER_STEP, _LLADA2_SOURCE),
}


def tokens_per_step_for(model: str | None) -> TokensPerStep:
    """The parametric rates of a latency profile's model: LLaDA2.x's own, LLaDA-8B's otherwise
    (Dream-7B has no figure of its own)."""
    return TOKENS_PER_STEP_BY_MODEL.get(model or "", llada_tokens_per_step)


class ParametricBehaviour:
    def __init__(self, seed: int = 0, difficulty_sigma: float = 0.35, tokens_per_step=None):
        self.seed = seed
        self.rng = Uniforms(np.random.default_rng(seed))
        self.sigma = difficulty_sigma
        self.tokens_per_step = tokens_per_step or llada_tokens_per_step
        self._rates: dict[float, float] = {}  # tokens_per_step by threshold, memoised
        # request id -> (difficulty, commit order as an array and as a list, confidences)
        self._state: dict[str, tuple[float, np.ndarray, list[int], np.ndarray]] = {}

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def _draw(self, r: Request) -> tuple[float, np.ndarray, list[int], np.ndarray]:
        """Difficulty, commit order within each block, and the confidences masked positions
        report, kept for the request's later steps: drawn from the request id, so a prompt id
        run at several thresholds (predictor training) is the same prompt each time. Harder
        requests report lower confidences."""
        rng = np.random.default_rng([self.seed, zlib.crc32(r.request_id.encode())])
        difficulty = float(rng.lognormal(0.0, self.sigma))
        order = _commit_order(r, rng.random((r.num_blocks, r.block_len)))
        confidences = rng.beta(2.0, 2.0 * difficulty, r.gen_len).astype(np.float32)
        state = self._state[r.request_id] = (difficulty, order, order.tolist(), confidences)
        return state

    def step(self, r: Request, threshold: float, kind: StepKind) -> RequestStepResult:
        difficulty, order, order_list, confidences = self._state.get(r.request_id) or self._draw(r)
        block = r.current_block
        # this model is the request's only committer and commits each block in `order`, so
        # the block's committed positions are a prefix of its order
        first = r.num_committed
        masked = r.block_span(block)[1] - first
        rate = self._rates.get(threshold)
        if rate is None:
            rate = self._rates[threshold] = self.tokens_per_step(threshold)
        n = min(masked, 1 + self.rng.poisson(max(rate / difficulty - 1.0, 0.0)))
        # committed positions keep a commit-time confidence, uniform in [threshold, 1)
        span = 1.0 - threshold  # a few positions a step: scalars beat array arithmetic
        for position in order_list[first : first + n]:
            confidences[position] = threshold + span * self.rng.random()
        positions = order[first : first + n]
        block_done = n == masked
        return RequestStepResult(
            r.request_id,
            kind,
            positions,
            _TOKENS[:n] if n <= _TOKENS.size else np.full(n, 7, np.int32),
            confidences,  # not a copy: the request's latest; its next step changes what commits
            block,
            block_done,
            block_done and block == r.num_blocks - 1,
        )


class Uniforms:
    """A numpy generator's uniform doubles and small Poisson draws, taken from blocks of its
    `random()`: the very numbers one call per draw gives (`Generator.poisson` below 10 is
    Knuth's product of uniforms, `random_poisson_mult` in numpy's distributions.c), at a
    fraction of the calls (two a simulated request's step, 10 million in the 2-hour run).
    A mean of 10 or more (numpy's PTRS, a few draws in a million) goes to the generator itself,
    set to where the blocks had reached."""

    BLOCK = 4096

    def __init__(self, rng: np.random.Generator):
        self._rng = rng
        self._start = rng.bit_generator.state  # the generator's state before the block
        self._block: list[float] = rng.random(self.BLOCK).tolist()
        self._next = 0

    def random(self) -> float:
        if self._next == len(self._block):
            self._refill()
        u = self._block[self._next]
        self._next += 1
        return u

    def poisson(self, lam: float) -> int:
        if lam >= 10.0:
            return self._poisson_by_generator(lam)
        if lam == 0.0:
            return 0
        limit, product, count = math.exp(-lam), 1.0, 0
        while True:
            product *= self.random()
            if product <= limit:
                return count
            count += 1

    def _refill(self) -> None:
        self._start = self._rng.bit_generator.state
        self._block = self._rng.random(self.BLOCK).tolist()
        self._next = 0

    def _poisson_by_generator(self, lam: float) -> int:
        """The generator's own draw, from where this block's uniforms had reached; a new
        block from where that draw leaves it."""
        self._rng.bit_generator.state = self._start
        self._rng.random(self._next)  # (discarded: the uniforms already taken)
        draw = int(self._rng.poisson(lam))
        self._refill()
        return draw


def _commit_order(r: Request, keys: np.ndarray) -> np.ndarray:
    """Window positions in commit order: block by block, each block's positions sorted by its
    row of `keys` (one key per slot of `block_len`). Block b's slots are the window positions
    [b B - offset, (b + 1) B - offset); those outside the window are dropped, so block b holds
    `order[lo:hi]` for its window span [lo, hi)."""
    slots = np.arange(keys.size).reshape(keys.shape) - r.block_offset
    order = np.take_along_axis(slots, np.argsort(keys, axis=1), axis=1).ravel()
    return order if not r.block_offset else order[(order >= 0) & (order < r.gen_len)]


class ReplayBehaviour:
    """Steps taken from recorded trajectories: `assign(request_id, prompt_index)` first. Where
    they were recorded with token editing (`edits`), a block whose masks are committed runs the
    edit-only steps its trajectory ran on it before the block is done."""

    def __init__(self, trajectories: Sequence[Trajectory]):
        self._by_key = {(t.prompt_index, t.threshold): t for t in trajectories}
        self.prompts = sorted({t.prompt_index for t in trajectories})
        self.thresholds = sorted({t.threshold for t in trajectories})
        self.edits = any(t.edits for t in trajectories)  # requests replay edit phases
        self._edit_steps = {key: t.edit_steps_by_block() for key, t in self._by_key.items()}
        self._prompt: dict[str, int] = {}
        self._committed: dict[str, int] = {}  # tokens each request has committed so far
        self._post: dict[str, int] = {}  # edit-only steps run in the block being edited

    def remaining_steps(self, request_id: str, threshold: float) -> float:
        """The oracle: steps the recorded run at `threshold` still takes from where the
        request is now."""
        t = self._trajectory(request_id, threshold)
        s = self._step_index(t, self._committed.get(request_id, 0), self._post.get(request_id))
        return float(max(t.num_steps - s, 0))

    def tokens_per_step(self, threshold: float) -> float:
        """Mean tokens committed per step over the recorded runs at the nearest threshold."""
        i = min(bisect.bisect_left(self.thresholds, threshold), len(self.thresholds) - 1)
        runs = [t for (_, g), t in self._by_key.items() if g == self.thresholds[i]]
        return sum(sum(len(c) for c in t.commits) for t in runs) / sum(t.num_steps for t in runs)

    def assign(self, request_id: str, prompt_index: int) -> Trajectory:
        """Tie a request to a recorded prompt; returns its first-threshold trajectory."""
        self._prompt[request_id] = prompt_index
        return self._by_key[prompt_index, self.thresholds[-1]]

    def forget(self, request_id: str) -> None:
        self._prompt.pop(request_id, None)
        self._committed.pop(request_id, None)
        self._post.pop(request_id, None)

    def _key(self, request_id: str, threshold: float) -> tuple[int, float]:
        i = min(bisect.bisect_left(self.thresholds, threshold), len(self.thresholds) - 1)
        return self._prompt[request_id], self.thresholds[i]

    def _trajectory(self, request_id: str, threshold: float) -> Trajectory:
        return self._by_key[self._key(request_id, threshold)]

    @staticmethod
    def _step_index(t: Trajectory, committed: int, post: int | None) -> int:
        """The step of `t` a request with `committed` tokens is at: the one that starts with as
        many committed (past the steps that commit nothing), or, in an edit phase that has run
        `post` edit-only steps, the edit-only step after them."""
        done = np.cumsum([0] + [len(c) for c in t.commits])
        if post is not None:
            return int(np.searchsorted(done, committed, side="left")) + post
        return int(np.searchsorted(done, committed, side="right")) - 1

    def step(self, r: Request, threshold: float, kind: StepKind) -> RequestStepResult:
        if r.edits and r.edit_block is not None:
            return self._edit_step(r, threshold, kind)
        t = self._trajectory(r.request_id, threshold)
        s = min(self._step_index(t, r.num_committed, None), t.num_steps - 1)
        masked = r.output_ids == r.mask_id
        wanted = t.commits[s]
        positions = wanted[masked[wanted]]
        block = r.current_block
        lo, hi = r.block_span(block)
        if positions.size == 0:  # our state left this trajectory: commit its count in order
            free = np.flatnonzero(masked[lo:hi])
            positions = (free[: max(1, len(wanted))] + lo).astype(np.int32)
        after = masked.copy()
        after[positions] = False
        block_done = not after[lo:hi].any()
        finished = s == t.num_steps - 1 or not after.any()
        self._committed[r.request_id] = r.num_committed + positions.size
        if r.edits and block_done and self._edits_left(r, threshold, block, 0):
            block_done = finished = False  # its edit-only steps follow
            self._post[r.request_id] = 0
        return RequestStepResult(
            r.request_id,
            kind,
            positions.astype(np.int32),
            np.full(positions.size, 7, np.int32),
            t.confidences[s].copy(),
            block,
            block_done or finished,
            finished,
        )

    def _edits_left(self, r: Request, threshold: float, block: int, post: int) -> bool:
        """Whether the recorded run at `threshold` ran more than `post` edit-only steps on
        `block`."""
        return self._edit_steps[self._key(r.request_id, threshold)].get(block, 0) > post

    def _edit_step(self, r: Request, threshold: float, kind: StepKind) -> RequestStepResult:
        """An edit-only step of the block whose masks are all committed: it commits nothing
        (the recorded edits rewrite tokens this model does not track), and the block is done
        after as many as its trajectory ran on it."""
        t, block = self._trajectory(r.request_id, threshold), r.edit_block
        assert block is not None  # (`step` sends only a block being edited here)
        post = r.post_steps + 1
        block_done = not self._edits_left(r, threshold, block, post)
        if block_done:
            self._post.pop(r.request_id, None)
        else:
            self._post[r.request_id] = post
        s = min(self._step_index(t, r.num_committed, r.post_steps), t.num_steps - 1)
        total = sum(len(c) for c in t.commits)
        masks_left = bool((r.output_ids == r.mask_id).any())
        finished = block_done and (r.num_committed >= total or not masks_left)
        return RequestStepResult(
            r.request_id,
            kind,
            np.zeros(0, np.int32),
            np.zeros(0, np.int32),
            t.confidences[s].copy(),
            block,
            block_done,
            finished,
        )


class BlockStepsBehaviour:
    """Replays known steps per block: request r's block b takes exactly `steps[r][b]` steps
    (commits spread evenly), and the request ends after its last block with steps. For
    experiments on labelled prompts (DWS labels), where the order of service is the question
    and the threshold is fixed. Blocks are the window's as the engine runs them: with blocks at
    absolute positions (`Request.block_offset`) block b spans window positions
    [b B - offset, (b + 1) B - offset), cut to the window."""

    def __init__(self, steps: Mapping[str, np.ndarray]):
        self.steps = steps
        self._done_in_block: dict[str, int] = {}

    def tokens_per_step(self, threshold: float) -> float:
        total = sum(int(s.sum()) for s in self.steps.values())
        return (
            DEFAULT_BLOCK_LEN * sum(int((s > 0).sum()) for s in self.steps.values()) / max(total, 1)
        )

    def forget(self, request_id: str) -> None:
        self._done_in_block.pop(request_id, None)

    def step(self, r: Request, threshold: float, kind: StepKind) -> RequestStepResult:
        steps = self.steps[r.request_id]
        block = r.current_block
        done = self._done_in_block.get(r.request_id, 0)
        lo, hi = r.block_span(block)
        free = np.flatnonzero(r.output_ids[lo:hi] == r.mask_id) + lo
        left = max(int(steps[block]) - done, 1)
        positions = free[: -(-len(free) // left)].astype(np.int32)
        block_done = len(positions) == len(free)
        last = block + 1 >= len(steps) or bool(steps[block + 1] == 0)
        self._done_in_block[r.request_id] = 0 if block_done else done + 1
        return RequestStepResult(
            r.request_id,
            kind,
            positions,
            np.full(positions.size, 7, np.int32),
            np.zeros(r.gen_len, np.float32),
            block,
            block_done,
            block_done and last,
        )
