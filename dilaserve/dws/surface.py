"""The Denoising Surface of a request (papers.md 2.2) and its training labels.

A request decodes a grid of cells: output block b (0..N-1) and denoising step s (0..T_b-1)
within it. Its labels are the executed block count N and the steps per block T_b. The surface
S[b, s] = P(N >= b+1) * P(T_b >= s+1 | block b reached) is the probability that a cell runs;
here it comes from two hazard heads (`surface_from_logits`), so it is monotone by construction:
rows never increase along s, the first column never increases along b.

Derived figures: expected blocks E[N] = sum_b S[b, 0]; expected total steps (the area) =
sum S; the coarse targets of Stage A, T(h) = sum_b min(T_b, h) for horizons h.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

HORIZONS = (1, 4, 8, 12, 16, 20, 24, 28, 32)  # Stage A's horizons h (papers.md 2.4)


def block_steps(block_indices: Sequence[int], max_blocks: int) -> np.ndarray:
    """T_b from the block each step worked on (a request's steps in order)."""
    steps = np.zeros(max_blocks, dtype=np.int32)
    for b in block_indices:
        if b >= max_blocks:
            raise ValueError(f"a step worked on block {b}, beyond max_blocks={max_blocks}")
        steps[b] += 1
    return steps


def horizon_targets(steps: np.ndarray, horizons: Sequence[int] = HORIZONS) -> np.ndarray:
    """T(h) = sum_b min(T_b, h): [requests, len(horizons)] from T_b [requests, blocks]."""
    return np.stack([np.minimum(steps, h).sum(axis=1) for h in horizons], axis=1).astype(np.float32)


def joint_target(steps: np.ndarray, block_len: int) -> np.ndarray:
    """1[cell executed]: [requests, blocks, block_len] from T_b [requests, blocks]."""
    s = np.arange(block_len)
    return (s[None, None, :] < steps[:, :, None]).astype(np.float32)


def surface_from_logits(count_logits: torch.Tensor, step_logits: torch.Tensor) -> torch.Tensor:
    """The surface [batch, blocks, block_len] from hazard logits.

    count_logits [batch, blocks-1]: sigmoid = P(N > k | N >= k), k = 1..blocks-1.
    step_logits [batch, blocks, block_len-1]: sigmoid = P(T_b > s | T_b >= s), s = 1..block_len-1.
    """
    batch = count_logits.shape[0]
    ones = count_logits.new_ones(batch, 1)
    block_survival = torch.cumprod(torch.cat((ones, torch.sigmoid(count_logits)), dim=1), dim=1)
    blocks = step_logits.shape[1]
    first = step_logits.new_ones(batch, blocks, 1)
    step_survival = torch.cumprod(torch.cat((first, torch.sigmoid(step_logits)), dim=2), dim=2)
    return block_survival[:, :, None] * step_survival


def window_blocks(gen_len: int, block_len: int, aligned: bool) -> int:
    """The most blocks an output window of `gen_len` can span: the engine rounds the window up
    to whole blocks, and where blocks sit at absolute positions (`aligned`: block-causal models,
    `protocol.block_offset`) a window that starts inside a block spans one more."""
    return -(-gen_len // block_len) + int(aligned)


def support(surface: np.ndarray, gen_len: int, block_len: int, prompt_tokens=None) -> np.ndarray:
    """Zero the blocks a request's output window cannot reach (no renormalisation).

    prompt_tokens: None where the window starts at a block's start (blocks aligned to the
    window); else each row's prompt length, for blocks at absolute positions, where a window
    that starts `P mod block_len` into its first block reaches one block further."""
    out = surface.copy()
    blocks = -(-gen_len // block_len)  # the engine rounds the window up to whole blocks
    if prompt_tokens is None:
        out[..., blocks:, :] = 0.0
        return out
    offsets = np.asarray(prompt_tokens) % block_len
    reach = -(-(blocks * block_len + offsets) // block_len)  # blocks each window spans
    unreached = np.arange(out.shape[-2]) >= np.asarray(reach)[..., None]
    out[unreached] = 0.0
    return out
