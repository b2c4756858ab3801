"""What a step commits: each family's decoding rule applied to a batch's top-1 tokens.

`Engine` runs the forwards; `StepDecider` turns each row's top-1 tokens and confidences into
its commits (and, under token editing, its edits), by the family's `DecodingRule`: a step's
candidates, its fewest and most commits per row, whether a picked mask stays masked, when a
block ends and when a request stops early.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dilaserve.config import EngineConfig
from dilaserve.engine.sequence import Sequence
from dilaserve.engine.unmask import select_edits, select_unmask
from dilaserve.models.family import DecodingRule
from dilaserve.protocol import (
    CACHED_KINDS,
    EosStop,
    RequestStepResult,
    StepItem,
    StepKind,
)


@dataclass
class Row:
    """One request's part of a step: what it runs through the model and reads back."""

    seq: Sequence
    item: StepItem
    kind: StepKind
    q_start: int  # absolute span run through the model
    q_end: int
    shift: int  # position i's token is read from the output at i - shift

    @property
    def attends_cache(self) -> bool:
        """Whether the row runs against stored K/V (an exact cache may hold none yet)."""
        return self.kind in CACHED_KINDS and self.seq.cached_len > 0

    @property
    def window_start(self) -> int:
        """Output-window index of the first position whose logits this row reads."""
        return max(self.q_start + self.shift, self.seq.prompt_len) - self.seq.prompt_len

    @property
    def window_len(self) -> int:
        return self.q_end - self.seq.prompt_len - self.window_start


@dataclass(frozen=True)
class StepDecider:
    decoding: DecodingRule
    config: EngineConfig
    mask: int
    stop_ids: frozenset[int]
    eos_stop: EosStop
    whole_window: bool  # the rule decodes the whole window (no cache)
    step_budget: int

    def decide(self, rows: list[Row], conf, top) -> dict[str, RequestStepResult]:
        """Each row's commits (and edits) this step from its top-1 tokens and confidences."""
        candidates = torch.zeros(conf.shape, dtype=torch.bool)
        blocks = [r.seq.block for r in rows]
        for i, r in enumerate(rows):
            w0 = r.window_start
            lo, hi = self._candidate_span(r)
            candidates[i, lo - w0 : hi - w0] = torch.from_numpy(r.seq.is_masked[lo:hi])
        thresholds = torch.tensor([r.item.threshold for r in rows], dtype=conf.dtype)
        commit = select_unmask(
            conf, candidates, thresholds, self._min_commits(rows), self._max_commits(rows)
        )
        edits = torch.zeros_like(commit)
        if self.decoding.editing is not None:
            edits = self._edits(rows, conf, top)
        return {
            r.item.request_id: self._apply(r, blocks[i], conf[i], top[i], commit[i], edits[i])
            for i, r in enumerate(rows)
        }

    def _edits(self, rows: list[Row], conf, top) -> torch.Tensor:
        """Token editing: which committed tokens of each row's current block this step
        replaces, at the edit threshold the row's threshold sets (`TokenEditing`)."""
        editable = torch.zeros(conf.shape, dtype=torch.bool)
        current = torch.zeros(conf.shape, dtype=top.dtype)
        for i, r in enumerate(rows):
            w0, seq = r.window_start, r.seq
            lo, hi = self._block_window(r)
            editable[i, lo - w0 : hi - w0] = torch.from_numpy(~seq.is_masked[lo:hi])
            current[i, lo - w0 : hi - w0] = seq.ids[seq.prompt_len + lo : seq.prompt_len + hi]
        rule = self.decoding.editing
        edit_thresholds = torch.tensor(
            [rule.edit_threshold_for(r.item.threshold) for r in rows], dtype=conf.dtype
        )
        return select_edits(conf, top, current, editable, edit_thresholds)

    def _candidate_span(self, row: Row) -> tuple[int, int]:
        """Output-window [lo, hi) whose masked positions this step may commit: the current
        block's within the row's logit window (its first position, if the step opens it), or
        the whole window under a whole-window rule."""
        if self.whole_window:
            return row.window_start, row.window_start + row.window_len
        lo, hi = self._block_window(row)
        return (lo, lo + 1) if self._opens_block(row, lo, hi) else (lo, hi)

    def _block_window(self, row: Row) -> tuple[int, int]:
        """Output-window [lo, hi) of the row's current block within its logit window."""
        b_start, b_end = row.seq.block_span(row.seq.block)
        w0 = row.window_start
        return max(b_start, w0), min(b_end, w0 + row.window_len)

    def _max_commits(self, rows: list[Row]) -> torch.Tensor | None:
        """Each row's most commits this step (None: no cap), by a whole-window rule's budget."""
        if not self.whole_window:
            return None
        return torch.tensor(
            [
                self.decoding.max_commits(
                    r.seq.gen_len, self.step_budget, r.seq.num_steps, r.seq.num_committed
                )
                for r in rows
            ]
        )

    def _opens_block(self, row: Row, lo: int, hi: int) -> bool:
        """Whether this step opens its block by the rule's first position (a recompute step of
        a block with nothing committed yet; a recompute after a move is not one)."""
        opens = self.decoding.first_opens_block and row.kind is StepKind.RECOMPUTE
        return opens and bool(row.seq.is_masked[lo:hi].all())

    def _min_commits(self, rows: list[Row]) -> torch.Tensor:
        """Each row's fewest commits this step, by the family's rule and the row's steps."""
        block_len = self.config.block_len
        return torch.tensor(
            [self.decoding.min_commits(block_len, self._steps(r), r.seq.block_step) for r in rows]
        )

    def _steps(self, row: Row) -> int:
        """The row's steps per block (a step schedule's)."""
        return row.item.steps or self.config.steps or self.config.block_len

    def _ends_block(self, row: Row, block: int) -> bool:
        """Whether a schedule's steps for the block ran out with positions still masked: the
        published loop then moves on, leaving them the mask."""
        seq = row.seq
        ran_out = self.decoding.step_schedule and seq.block_step + 1 >= self._steps(row)
        return ran_out and seq.block == block

    def _apply(self, row: Row, block: int, conf, top, commit, edits) -> RequestStepResult:
        seq, w0, n = row.seq, row.window_start, row.window_len
        b_start, b_end = seq.block_span(block)
        masks_before = bool(seq.is_masked[b_start:b_end].any())
        window_conf = conf[:n].numpy()
        still_masked = seq.is_masked[w0 : w0 + n]
        seq.conf[w0 : w0 + n][still_masked] = window_conf[still_masked]
        window_top = top[:n].numpy()
        picked = np.flatnonzero((commit | edits)[:n].numpy())
        to_mask = window_top[picked] == self.mask  # a picked mask stays; an edit to it masks
        remasked = (picked[to_mask & edits[:n].numpy()[picked]] + w0).astype(np.int32)
        seq.remask(remasked)
        picked = picked[~to_mask]
        tokens = window_top[picked].astype(np.int32)
        seq.commit((picked + w0).astype(np.int32), tokens, window_conf[picked])
        positions = np.concatenate(((picked + w0).astype(np.int32), remasked))
        tokens = np.concatenate((tokens, np.full(len(remasked), self.mask, np.int32)))
        if self.decoding.editing is not None:
            self._edit_progress(seq, block, masks_before, bool(edits.any()))
        if self._ends_block(row, block):
            seq.leave_masked(block)
        block_done = seq.block != block
        seq.block_step = 0 if block_done else seq.block_step + 1
        seq.num_steps += 1
        committed_stop = bool(np.isin(tokens, list(self.stop_ids)).any())
        finished = seq.is_finished(self.stop_ids, self.eos_stop, committed_stop, block_done)
        result = RequestStepResult(
            request_id=seq.request_id,
            kind=row.kind,
            positions=positions,
            tokens=tokens,
            confidences=seq.conf.copy(),
            block_index=block,
            is_block_done=finished or block_done,
            is_finished=finished,
        )
        return result

    def _edit_progress(self, seq: Sequence, block: int, masks_before: bool, edited: bool) -> None:
        """Token editing: a block whose masks are all committed stays open for edit-only steps
        until one edits nothing, or after `max_post_steps` of them (the published loop)."""
        b_start, b_end = seq.block_span(block)
        seq.post_steps += not masks_before
        if seq.is_masked[b_start:b_end].any():
            return
        limit = self.decoding.editing.max_post_steps
        done = (not masks_before and not edited) or seq.post_steps >= limit
        seq.edit_block, seq.post_steps = (None, 0) if done else (block, seq.post_steps)
