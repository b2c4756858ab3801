"""A request's state as the control plane sees it: tokens, block progress, counters, timing.

The engine keeps its own copy of the tokens; this copy is updated from each `RequestStepResult`
so that the request can resume on any instance (`spec()`). Nothing here imports torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from dilaserve.protocol import (
    CACHED_KINDS,
    KVCacheMode,
    RequestStepResult,
    SequenceSpec,
    StepItem,
    StepKind,
)

# The cache modes and step kinds read for each request's every step, as constants (here and in
# `control/step_costs.py`, `control/placement.py`): compiled (`make compile`), a Final constant
# of a compiled module is a C variable, in the modules that import it too, where
# `StepKind.COMMIT` looks the member up on its class each time (about 70 ns)
MODE_NONE: Final = KVCacheMode.NONE
MODE_BLOCK: Final = KVCacheMode.BLOCK
KIND_FULL: Final = StepKind.FULL
KIND_RECOMPUTE: Final = StepKind.RECOMPUTE
KIND_CACHE: Final = StepKind.CACHE
KIND_PREFILL: Final = StepKind.PREFILL
KIND_BLOCK: Final = StepKind.BLOCK
KIND_COMMIT: Final = StepKind.COMMIT
KINDS_CACHED: Final = CACHED_KINDS


def next_step_kind(mode: KVCacheMode, starts_block: bool, has_cache: bool) -> StepKind:
    """The kind of a request's next step: recompute at a block's first step or without a cache;
    with an exact block cache, prefill without one and commit when a block has just finished."""
    if mode is MODE_NONE:
        return KIND_FULL
    if mode is MODE_BLOCK:
        if not has_cache:
            return KIND_PREFILL
        return KIND_COMMIT if starts_block else KIND_BLOCK
    return KIND_RECOMPUTE if starts_block or not has_cache else KIND_CACHE


class RequestStatus(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


_FINISHED: Final = RequestStatus.FINISHED


@dataclass
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    gen_len: int
    block_len: int
    mask_id: int
    threshold: float
    arrival_time: float = 0.0
    deadline: float | None = None
    priority: int = 0
    # (lowest, highest) threshold this request accepts; equal bounds pin it (a fixed threshold)
    threshold_bounds: tuple[float, float] | None = None
    # prompt-only predictions made at admission (the DWS predictor), when a driver has them:
    cost: float | None = None  # expected cost (ms), the DWS-SJF service order
    prior_steps: dict[float, float] | None = None  # expected steps per threshold, before step 1
    # block-causal models: blocks start at absolute multiples of block_len, so the first block
    # of the window is `block_len - block_offset` long (block_offset = prompt_len % block_len)
    block_offset: int = 0
    # a family with a per-block step schedule (LLaDA2): steps per block (None: the engine's)
    steps: int | None = None
    max_tokens: int | None = None  # the answer's length at most (None: the whole window)
    edits: bool = False  # the engine's rule edits committed tokens of the current block
    # a whole-window rule (Dream `none`): tokens a step commits at most, plus the rejections
    # carried over (EngineConfig.step_budget); None: the rule decodes block by block
    step_budget: int | None = None
    # seconds its client gave it, from when it was submitted (None: the server's, or a trace's
    # deadline - arrival): its SLO class for the planner, whatever its wait for the controller
    slo: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_ids: np.ndarray = field(init=False)
    confidences: np.ndarray = field(init=False)
    num_committed: int = field(init=False)
    current_block: int = field(init=False)  # the first block with a masked position
    starts_block: bool = True  # the next step is the first step of a block
    block_step: int = 0  # steps run in the current block so far
    edit_block: int | None = None  # token editing: a fully committed block still being edited
    post_steps: int = 0  # ... and the edit-only steps it has run
    num_steps: int = 0
    steps_by_kind: dict[StepKind, int] = field(default_factory=dict)
    threshold_steps: list[float] = field(default_factory=list)  # the threshold of each step
    step_tokens: list[int] = field(default_factory=list)  # tokens each step committed
    first_block_time: float | None = None  # when the first block was fully committed
    finish_time: float | None = None
    prompt_len: int = field(init=False)
    num_tokens: int = field(init=False)  # prompt + output window: what a full-sequence step reads
    num_blocks: int = field(init=False)

    def __post_init__(self):
        if self.gen_len <= 0 or (self.gen_len % self.block_len and not self.block_offset):
            raise ValueError(
                f"request {self.request_id}: {self.gen_len=} must be a positive "
                f"multiple of {self.block_len=} (any length if blocks are at absolute positions)"
            )
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"request {self.request_id}: {self.steps=} must be positive")
        if self.step_budget is not None and self.step_budget <= 0:
            raise ValueError(f"request {self.request_id}: {self.step_budget=} must be positive")
        self.num_committed = 0
        self.current_block = 0
        self.output_ids = np.full(self.gen_len, self.mask_id, dtype=np.int32)
        self.confidences = np.zeros(self.gen_len, dtype=np.float32)
        self.prompt_len = len(self.prompt_ids)
        self.num_tokens = self.prompt_len + self.gen_len
        if not 0 <= self.block_offset < self.block_len:
            raise ValueError(
                f"request {self.request_id}: {self.block_offset=} must be in [0, {self.block_len})"
            )
        self.num_blocks = -(-(self.gen_len + self.block_offset) // self.block_len)
        if self.threshold_bounds is not None:
            lo, hi = self.threshold_bounds
            if not 0 < lo <= hi <= 1:
                raise ValueError(
                    f"request {self.request_id}: threshold bounds {self.threshold_bounds} must "
                    "satisfy 0 < min_threshold <= max_threshold <= 1"
                )

    def fresh(self) -> Request:
        """A copy as admitted: the same identity, lengths, threshold, timing and priority, and
        no progress."""
        return Request(
            self.request_id,
            self.prompt_ids,
            self.gen_len,
            self.block_len,
            self.mask_id,
            self.threshold,
            self.arrival_time,
            self.deadline,
            self.priority,
            self.threshold_bounds,
            self.cost,
            self.prior_steps,
            self.block_offset,
            self.steps,
            self.max_tokens,
            self.edits,
            self.step_budget,
            self.slo,
        )

    def block_span(self, block: int) -> tuple[int, int]:
        """Output-window [start, end) of a block (`block_offset` into the window's first one
        where blocks sit at absolute positions)."""
        start = block * self.block_len - self.block_offset
        return max(start, 0), min(start + self.block_len, self.gen_len)

    @property
    def committed(self) -> np.ndarray:
        return self.output_ids != self.mask_id

    @property
    def blocks_left(self) -> int:
        """Blocks with a masked position, the current one included (0 once all committed)."""
        return self.num_blocks - self.current_block

    @property
    def num_blocks_to_recompute(self) -> int:
        """Recompute steps left with a KV cache: one per block not yet started."""
        return self.blocks_left - (0 if self.starts_block else 1)

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    def spec(self) -> SequenceSpec:
        """The whole state an instance needs to take this request on (copies: the request
        goes on changing)."""
        return SequenceSpec(
            self.prompt_ids,
            self.output_ids.copy(),
            self.confidences.copy(),
            self.block_step,
            self.edit_block,
            self.post_steps,
            self.num_steps,
            self.current_block,
        )

    def within_bounds(self, thresholds: tuple[float, ...]) -> tuple[float, ...]:
        """The thresholds this request accepts, in the given order."""
        if self.threshold_bounds is None:
            return thresholds
        lo, hi = self.threshold_bounds
        return tuple(g for g in thresholds if lo <= g <= hi)

    def clamp_threshold(self, threshold: float) -> float:
        if self.threshold_bounds is None:
            return threshold
        lo, hi = self.threshold_bounds
        return min(max(threshold, lo), hi)

    def next_kind(self, mode: KVCacheMode, has_cache: bool) -> StepKind:
        return next_step_kind(mode, self.starts_block, has_cache)

    def step_item(self, mode: KVCacheMode, on_instance: bool) -> StepItem:
        """This request's next step on an instance; the sequence travels only if it is new there."""
        kind = self.next_kind(mode, has_cache=on_instance)
        spec = None if on_instance else self.spec()
        return StepItem(self.request_id, self.threshold, kind, spec=spec, steps=self.steps)

    def apply(self, result: RequestStepResult, now: float = 0.0) -> None:
        """Record one step's outcome: `positions` were masked until this step (or, with token
        editing, held a token of the current block), and blocks complete in order, as the
        engine decodes them."""
        # (a step's few positions counted as a list: a third of `np.count_nonzero`'s time)
        newly = self.output_ids[result.positions].tolist().count(self.mask_id)
        remasked = result.tokens.tolist().count(self.mask_id)  # edits to the mask
        masks_before = self.edits and self._block_has_masks(result.block_index)
        self.output_ids.put(result.positions, result.tokens)  # 3x `a[i] = v` for int32 indices
        if self.edits:
            self._edit_progress(result, masks_before)
        self.confidences = result.confidences
        self.num_committed += newly - remasked
        self.current_block = result.block_index + int(result.is_block_done)
        self.num_steps += 1
        self.steps_by_kind[result.kind] = self.steps_by_kind.get(result.kind, 0) + 1
        self.threshold_steps.append(self.threshold)
        self.step_tokens.append(newly)
        if self.first_block_time is None and (self.current_block > 0 or result.is_finished):
            self.first_block_time = now
        self.starts_block = result.is_block_done
        self.block_step = 0 if result.is_block_done else self.block_step + 1
        if result.is_finished:
            self.status = _FINISHED
            self.finish_time = now

    def _edit_progress(self, result: RequestStepResult, masks_before: bool) -> None:
        """Follow the engine's token-editing state (`StepDecider._edit_progress`), so that the
        request resumes mid-edit on another instance."""
        if result.is_block_done:
            self.edit_block, self.post_steps = None, 0
            return
        self.post_steps += not masks_before
        if not self._block_has_masks(result.block_index):
            self.edit_block = result.block_index  # its masks are all committed now

    def _block_has_masks(self, block: int) -> bool:
        """Whether the block still has a masked position (token editing reads it)."""
        start, end = self.block_span(block)
        return bool((self.output_ids[start:end] == self.mask_id).any())

    @property
    def mean_threshold(self) -> float:
        """Token-weighted mean threshold: each committed token counts at its step's threshold."""
        tokens = sum(self.step_tokens)
        if not tokens:
            return self.threshold
        return sum(g * n for g, n in zip(self.threshold_steps, self.step_tokens)) / tokens

    def generated_ids(self, stop_ids: frozenset[int], start: int = 0) -> list[int]:
        """Committed output tokens before the first stop token, at most `max_tokens`, from output
        position `start` on (`start` at most their number: a stream asks only for what it has
        not seen). With token editing, the current block's tokens may still change, so an
        unfinished request gives those of finished blocks only."""
        end = self.max_tokens
        if self.edits and not self.is_finished:
            end = min(end or self.gen_len, self.block_span(self.current_block)[0])
        out = []
        for token in self.output_ids[start:end].tolist():
            if token in stop_ids or token == self.mask_id:
                break
            out.append(token)
        return out
