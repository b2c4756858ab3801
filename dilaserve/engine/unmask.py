"""The confidence-threshold unmasking rule (papers.md 1.1), as one vectorised function."""

from __future__ import annotations

import torch


def select_unmask(
    conf: torch.Tensor, candidates: torch.Tensor, thresholds: torch.Tensor
) -> torch.Tensor:
    """Which candidate positions to commit this step.

    conf: [rows, n] top-1 probabilities; candidates: [rows, n] bool, the still-masked positions
    of each row's current block; thresholds: [rows]. A candidate is committed when its confidence
    exceeds its row's threshold; a row with candidates but none above the threshold commits its
    single most confident candidate, so every step makes progress.
    """
    commit = candidates & (conf > thresholds[:, None])
    stuck = candidates.any(dim=1) & ~commit.any(dim=1)
    if stuck.any():
        best = conf.masked_fill(~candidates, float("-inf")).argmax(dim=1)
        fallback = torch.zeros_like(commit)
        fallback[torch.arange(conf.shape[0], device=conf.device), best] = True
        commit = commit | (fallback & stuck[:, None])
    return commit
