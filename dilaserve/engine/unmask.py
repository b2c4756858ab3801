"""The confidence-threshold unmasking rule (papers.md 1.1), as one vectorised function."""

from __future__ import annotations

import torch


def select_unmask(
    conf: torch.Tensor,
    candidates: torch.Tensor,
    thresholds: torch.Tensor,
    min_commits: torch.Tensor | None = None,
    max_commits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which candidate positions to commit this step.

    conf: [rows, n] top-1 probabilities; candidates: [rows, n] bool, the still-masked positions
    of each row's current block; thresholds: [rows]; min_commits: [rows] int (None: ones);
    max_commits: [rows] int (None: no cap). A candidate is committed when its confidence exceeds
    its row's threshold; a row with fewer such candidates than its `min_commits` commits its
    `min_commits` most confident candidates instead (all of them, if it has fewer), so every
    step makes progress; a row then keeps at most its `max_commits` most confident commits.
    """
    commit = candidates & (conf > thresholds[:, None])
    if min_commits is None:
        min_commits = torch.ones(conf.shape[0], dtype=torch.long)
    min_commits = min_commits.to(conf.device)
    short = commit.sum(dim=1) < min_commits
    if not short.any() and max_commits is None:
        return commit
    rank = _rank(conf.masked_fill(~candidates, float("-inf")))
    commit = torch.where(short[:, None], candidates & (rank < min_commits[:, None]), commit)
    if max_commits is not None:
        commit &= rank < max_commits.to(conf.device)[:, None]
    return commit


def _rank(conf: torch.Tensor) -> torch.Tensor:
    """Each position's rank in its row, most confident first (ties: the earlier position)."""
    order = conf.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    positions = torch.arange(conf.shape[1], device=conf.device).expand_as(order)
    return rank.scatter_(1, order, positions)


def select_edits(
    conf: torch.Tensor,
    top: torch.Tensor,
    current: torch.Tensor,
    editable: torch.Tensor,
    edit_thresholds: torch.Tensor,
) -> torch.Tensor:
    """Which committed tokens to replace this step (token-to-token editing, LLaDA2.1).

    conf, top: [rows, n] top-1 probabilities and tokens; current: [rows, n] the tokens there now;
    editable: [rows, n] bool, the committed output positions of each row's current block;
    edit_thresholds: [rows]. A position is edited when its top-1 differs from its token and its
    probability exceeds its row's edit threshold.
    """
    return editable & (top != current) & (conf > edit_thresholds[:, None])
