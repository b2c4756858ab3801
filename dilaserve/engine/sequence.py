"""One request's token state inside an engine instance, and its cached K/V.

Positions are absolute (prompt first, then the output window). The output window is split into
blocks of `block_len`; the current block is the first one with a masked position. Blocks start
at the output window (`block_offset` 0), or, for block-causal models, at absolute multiples of
`block_len` (`block_offset` = prompt_len % block_len: the first block then also holds the
prompt's tail; the window then ends on an absolute block boundary, or anywhere: its last block
holds what is left). This module does the bookkeeping of a step's outcome (commit, block
progress, early finish by an `EosStop` rule); it runs no model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dilaserve.models.common import KVSlot
from dilaserve.protocol import EosStop, block_offset


@dataclass
class CachedKV:
    """The K/V a step stored, at the head of the request's slot (`KVSlot`, allocated once for
    the whole sequence and reused): the `length` positions a recompute step keeps
    (approximate; `kv_cache.cached_ranges`), or the exact prefix [0, length) of a block-causal
    model. A new store makes a new `CachedKV` on the same slot."""

    block: int  # the block whose step stored them
    length: int
    slot: KVSlot


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_ids,
        output_ids,
        output_conf,
        block_len: int,
        mask_id: int,
        aligned_blocks: bool = False,
        block_step: int = 0,
        edit_block: int | None = None,
        post_steps: int = 0,
        num_steps: int = 0,
        block: int = 0,
    ):
        gen_len = len(output_ids)
        if len(prompt_ids) == 0:
            raise ValueError(f"request {request_id}: prompt is empty")
        self.request_id = request_id
        self.prompt_len = len(prompt_ids)
        self.gen_len = gen_len
        self.block_len = block_len
        self.block_offset = block_offset(self.prompt_len, block_len, aligned_blocks)
        if gen_len == 0 or (gen_len % block_len and not self.block_offset):
            raise ValueError(
                f"request {request_id}: output window of {gen_len} tokens is not a "
                f"positive multiple of block_len={block_len}"
            )
        self.block_step = block_step  # steps run in the current block so far
        # token editing: a block with every mask committed whose edit steps go on, and how many
        # edit-only steps it has run
        self.edit_block = edit_block
        self.post_steps = post_steps
        self.num_steps = num_steps  # steps run on the window so far
        self.ids = torch.from_numpy(
            np.concatenate(
                (np.asarray(prompt_ids, dtype=np.int64), np.asarray(output_ids, dtype=np.int64))
            )
        )
        self.mask_id = mask_id
        self.is_masked = np.asarray(output_ids) == mask_id
        self.is_masked[: self.block_span(block)[0]] = False  # blocks before `block` are decided
        self.conf = (
            np.zeros(gen_len, np.float32)
            if output_conf is None
            else np.asarray(output_conf, np.float32).copy()
        )
        self.kv: CachedKV | None = None

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def num_blocks(self) -> int:
        return -(-(self.gen_len + self.block_offset) // self.block_len)

    @property
    def block(self) -> int:
        """Index of the current block: the block still being edited, else the first with a
        masked position."""
        if self.edit_block is not None:
            return self.edit_block
        masked = np.flatnonzero(self.is_masked)
        if not masked.size:
            return self.num_blocks
        return (int(masked[0]) + self.block_offset) // self.block_len

    def block_span(self, block: int) -> tuple[int, int]:
        """Output-window [start, end) of a block."""
        start = block * self.block_len - self.block_offset
        return max(start, 0), min(start + self.block_len, self.gen_len)

    def absolute_block_start(self, block: int) -> int:
        """Absolute position where a block starts (before the window for an aligned block 0)."""
        return self.prompt_len - self.block_offset + block * self.block_len

    @property
    def cached_len(self) -> int:
        return 0 if self.kv is None else self.kv.length

    def has_cache_for_current_block(self) -> bool:
        return self.kv is not None and self.kv.block == self.block

    @property
    def num_committed(self) -> int:
        return self.gen_len - int(self.is_masked.sum())

    def output_ids(self) -> torch.Tensor:
        return self.ids[self.prompt_len :]

    def commit(self, positions: np.ndarray, tokens: np.ndarray, conf: np.ndarray) -> None:
        self.ids[self.prompt_len + positions] = torch.from_numpy(tokens.astype(np.int64))
        self.is_masked[positions] = False
        self.conf[positions] = conf

    def remask(self, positions: np.ndarray) -> None:
        """Mask committed positions again (an edit to the mask token)."""
        self.ids[self.prompt_len + positions] = self.mask_id
        self.is_masked[positions] = True
        self.conf[positions] = 0.0

    def leave_masked(self, block: int) -> None:
        """End a block with its masked positions decided as the mask token (a rule whose
        steps for the block ran out)."""
        start, end = self.block_span(block)
        self.is_masked[start:end] = False

    def is_finished(
        self, stop_ids: frozenset[int], rule: EosStop, committed_stop: bool, block_done: bool
    ) -> bool:
        """Whether the request ends after a step: the window is decoded, or the `rule` stops
        it early (`committed_stop`: the step committed a stop token; `block_done`: it completed
        a block). A block still being edited ends nothing."""
        if self.edit_block is not None:
            return False
        if not self.is_masked.any():
            return True
        if rule is EosStop.NONE:
            return False
        out = self.output_ids().numpy()
        stops = np.flatnonzero(np.isin(out, list(stop_ids)) & ~self.is_masked)
        if not stops.size:
            return False
        prefix_done = not (out[: stops[0]] == self.mask_id).any()  # a left mask counts
        if rule is EosStop.COMMITTED:
            return prefix_done
        return block_done or (rule is EosStop.STEP and committed_stop and prefix_done)
