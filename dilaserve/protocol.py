"""The seams between the control plane and model instances.

The scheduler hands an executor a `StepBatch` and gets a `StepOutput` back (DESIGN section 3).
An executor keeps its own copy of each request's tokens: a request's full sequence travels once,
when it first runs on an instance (`SequenceSpec`); after that a step names only the request,
its threshold and the step kind. Nothing here imports torch.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


class StepKind(str, enum.Enum):
    """What one denoising step computes (DESIGN section 1)."""

    FULL = "full"  # no KV cache: the whole sequence, nothing stored
    RECOMPUTE = "recompute"  # the whole sequence, K/V stored (a block's first step)
    CACHE = "cache"  # the current block (dual) or block + suffix (prefix), against stored K/V
    # block-causal models (exact cache, `KVCacheMode.BLOCK`):
    PREFILL = "prefill"  # prompt + finished blocks + the current block; K/V before it stored
    BLOCK = "block"  # the current block against the stored K/V; nothing stored
    COMMIT = "commit"  # the finished block + the next one; the finished block's K/V stored


# steps that run one or two blocks against stored K/V (the rest run the whole sequence)
# token editing: a block whose masks are all committed runs at most this many edit-only steps
# (LLaDA2.1's published `max_post_steps`)
MAX_EDIT_STEPS = 16
CACHED_KINDS = frozenset((StepKind.CACHE, StepKind.BLOCK, StepKind.COMMIT))
# the kinds a bidirectional model's steps take (none, prefix or dual cache) ...
APPROXIMATE_KINDS = (StepKind.FULL, StepKind.RECOMPUTE, StepKind.CACHE)
# ... and a block-causal model's (none, or its exact block cache)
EXACT_KINDS = (StepKind.FULL, StepKind.PREFILL, StepKind.BLOCK, StepKind.COMMIT)


class KVCacheMode(str, enum.Enum):
    NONE = "none"
    PREFIX = "prefix"  # approximate (bidirectional models)
    DUAL = "dual"  # approximate (bidirectional models)
    BLOCK = "block"  # exact: block-causal models' prompt and finished blocks


class EosStop(str, enum.Enum):
    """When a request may end before its output window is fully committed."""

    COMMITTED = "committed"  # after any step, once a stop token and all before it are committed
    BLOCK = "block"  # after a step that completes a block, if a stop token is committed so far
    STEP = "step"  # as BLOCK, and after a step that commits a stop token with nothing masked
    # before the first stop token (LLaDA2's `eos_early_stop`)
    NONE = "none"  # never: the whole window is decoded


def block_offset(prompt_len: int, block_len: int, aligned: bool) -> int:
    """How far into its first block the output window starts: blocks at absolute multiples of
    `block_len` (`aligned`: block-causal models) put it `prompt_len % block_len` in, else 0."""
    return prompt_len % block_len if aligned else 0


def window_len(prompt_len: int, max_tokens: int, block_len: int, aligned: bool) -> int:
    """The output window of a request for `max_tokens`: whole blocks. With blocks at absolute
    positions (`aligned`) it ends on the first block boundary at or after prompt + max_tokens,
    as LLaDA2's published `generate` decodes; otherwise it is max_tokens rounded up to blocks."""
    if aligned:
        return -(-(prompt_len + max_tokens) // block_len) * block_len - prompt_len
    return -(-max_tokens // block_len) * block_len


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    """A request's whole token state, sent when it first runs on an instance.

    `output_ids` has `gen_len` entries; uncommitted positions hold the mask id.
    `output_conf` carries the confidences the request already has (commit-time for committed
    positions), so that a migrated request keeps them. Sequences or numpy arrays.
    """

    prompt_ids: Sequence[int]
    output_ids: Sequence[int] | np.ndarray
    output_conf: Sequence[float] | np.ndarray | None = None
    block_step: int = 0  # steps already run in the current block (a per-block step schedule)
    # token editing: the block whose masks are all committed but whose edit steps go on, and
    # the edit-only steps it has run
    edit_block: int | None = None
    post_steps: int = 0
    num_steps: int = 0  # steps already run on the window (a whole-window rule's budget)
    block: int = 0  # the current block: the positions before it are decided (a mask left so)


# The two messages built for every request's every step are not frozen: a frozen dataclass's
# `__init__` sets each field through `object.__setattr__`, 1.4 us a construction against 0.3,
# and the 2-hour simulation builds 10 million of them (docs/simulator/speed.md). Nobody
# changes one after it is built.
@dataclass(slots=True)
class StepItem:
    request_id: str
    threshold: float
    kind: StepKind
    spec: SequenceSpec | None = None  # required the first time a request runs on an instance
    steps: int | None = None  # steps per block of a family's step schedule (None: the engine's)


@dataclass(frozen=True, slots=True)
class StepBatch:
    items: tuple[StepItem, ...]

    @property
    def is_empty(self) -> bool:
        return not self.items

    def __len__(self) -> int:
        return len(self.items)


@dataclass(slots=True)  # not frozen: see StepItem
class RequestStepResult:
    """What one step did to one request.

    positions: output-window indices committed this step (each was masked before it, except
    where a token-editing rule replaced a committed token of the current block); tokens: their
    ids (the mask token where an edit to the mask masked a committed position again).
    confidences: float32 [gen_len], the latest top-1 probability of every masked position and
    the commit-time probability of every committed one.
    """

    request_id: str
    kind: StepKind
    positions: np.ndarray
    tokens: np.ndarray
    confidences: np.ndarray
    block_index: int  # the block this step worked on
    is_block_done: bool  # that block is now fully committed (and, with token editing, edited)
    is_finished: bool


@dataclass(frozen=True, slots=True)
class StepOutput:
    results: tuple[RequestStepResult, ...]
    num_tokens: int  # tokens the forward passes processed (the batch size the profile indexes)
    # requests this step left without a cache to keep within the K/V memory budget (dropped, or
    # not stored): their next steps recompute, wherever they run (`engine/kv_budget.py`)
    kv_dropped: tuple[str, ...] = ()

    def by_id(self) -> dict[str, RequestStepResult]:
        return {r.request_id: r for r in self.results}


@runtime_checkable
class Executor(Protocol):
    """A model instance's step runner: the engine (`engine.Engine`), which a worker rank runs
    steps through (`cluster.worker.InstanceWorker`)."""

    def execute(self, batch: StepBatch) -> StepOutput: ...

    def release(self, request_id: str) -> None:
        """Forget a request (finished, cancelled or migrated away) and free its cache."""
        ...
