"""Mixture-of-experts building blocks (LLaDA2's published routing; parameter names as there).

`Router` (`gate`): fp32 router logits, sigmoid scores; the expert bias (`expert_bias`) is added
for selection only; `select_experts` keeps the `topk_group` of `n_group` groups whose two best
biased scores sum highest and takes the top `num_experts_per_tok` experts in them; their weights
are the unbiased scores, normalised to sum 1 and times `routed_scaling_factor`.
`SparseMoeBlock`: routed experts (`experts.E`) plus shared experts (`shared_experts`, one MLP of
width `moe_intermediate_size * num_shared_experts`). Under tensor parallelism rank r holds a
contiguous slice of the routed experts, sums its experts' weighted outputs in fp32, and one
all-reduce joins the ranks; the router is replicated and the shared MLP is column/row-parallel.
`cfg` is a config with those fields (`LLaDA2Config`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dilaserve.models.layers import GatedMLP, TPGroup


class Router(nn.Module):
    """The router: which experts each token goes to, with which weights (see the docstring)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        self.full_shapes = {
            "weight": (cfg.num_experts, cfg.hidden_size),
            "expert_bias": (cfg.num_experts,),
        }

    def load_full(self, full: torch.Tensor, name: str = "weight") -> None:
        getattr(self, name).data.copy_(full)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [tokens, hidden] -> (expert ids [tokens, k], fp32 weights [tokens, k])."""
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        chosen = select_experts(scores + self.expert_bias.float(), self.cfg)
        weights = scores.gather(1, chosen)
        if self.cfg.num_experts_per_tok > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * self.cfg.routed_scaling_factor


def select_experts(biased: torch.Tensor, cfg) -> torch.Tensor:
    """Group-limited top-k over biased scores [tokens, experts]: keep the `topk_group` groups
    whose two best scores sum highest, then the top `num_experts_per_tok` experts in them."""
    tokens = biased.shape[0]
    grouped = biased.view(tokens, cfg.n_group, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    kept = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    expert_mask = group_mask[..., None].expand_as(grouped).reshape(tokens, -1)
    masked = biased.masked_fill(~expert_mask, float("-inf"))
    return masked.topk(cfg.num_experts_per_tok, dim=-1).indices


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg, tp: TPGroup):
        super().__init__()
        self.tp = tp
        d = cfg.hidden_size
        local = tp.shard_len(cfg.num_experts, "num_experts")
        first = tp.rank * local
        self.num_experts = cfg.num_experts
        self.gate = Router(cfg)  # replicated: every rank routes every token
        self.experts = nn.ModuleDict(
            {str(e): GatedMLP(d, cfg.moe_intermediate_size) for e in range(first, first + local)}
        )
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(d, cfg.shared_width, tp)
        self.has_shared = bool(cfg.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        chosen, weights = self.gate(flat)
        routed = torch.zeros(flat.shape, dtype=torch.float32, device=x.device)
        for expert, token, weight in self._assignments(chosen, weights):
            routed.index_add_(0, token, expert(flat[token]).float() * weight[:, None])
        y = self.tp.all_reduce(routed).to(x.dtype).view(shape)
        return y + self.shared_experts(x) if self.has_shared else y

    def _assignments(self, chosen: torch.Tensor, weights: torch.Tensor):
        """(expert, its tokens, their weights) for this rank's experts that got tokens: one
        sort and one device-to-host copy of the counts, not one search per expert."""
        ids = chosen.reshape(-1)
        order = ids.argsort()
        counts = torch.bincount(ids, minlength=self.num_experts).tolist()
        token, weight = order // chosen.shape[1], weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n and str(e) in self.experts:
                yield self.experts[str(e)], token[start : start + n], weight[start : start + n]
            start += n
