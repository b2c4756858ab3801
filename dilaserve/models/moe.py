"""Mixture-of-experts building blocks (LLaDA2's published routing; parameter names as there).

`Router` (`gate`): fp32 router logits, sigmoid scores; the expert bias (`expert_bias`) is added
for selection only; `select_experts` keeps the `topk_group` of `n_group` groups whose two best
biased scores sum highest and takes the top `num_experts_per_tok` experts in them; their weights
are the unbiased scores, normalised to sum 1 and times `routed_scaling_factor`.
`SparseMoeBlock`: routed experts (`experts.E`, stacked in an `ExpertBank` and run as one grouped
matmul over the assignments sorted by expert: no host sync and no loop over experts) plus shared
experts (`shared_experts`, one MLP of width `moe_intermediate_size * num_shared_experts`). Under
tensor parallelism rank r holds a contiguous slice of the routed experts, sums its experts'
weighted outputs in fp32, and one all-reduce joins the ranks; the router is replicated and the
shared MLP is column/row-parallel.
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


class ExpertBank(nn.Module):
    """This rank's routed experts, stacked so that one grouped matmul runs them all: `gate_up`
    [experts, 2 * width, hidden] (an expert's gate rows, then its up rows) and `down`
    [experts, hidden, width]. The checkpoint keeps one tensor per expert and projection,
    `{e}.gate_proj.weight`, `{e}.up_proj.weight` and `{e}.down_proj.weight` (e global), which
    load into and save from slices of the stacks."""

    def __init__(self, first: int, local: int, hidden: int, width: int):
        super().__init__()
        self.first, self.width = first, width
        self.gate_up = nn.Parameter(torch.empty(local, 2 * width, hidden))
        self.down = nn.Parameter(torch.empty(local, hidden, width))
        self.full_shapes = {}
        for e in self.held:
            self.full_shapes[f"{e}.gate_proj.weight"] = (width, hidden)
            self.full_shapes[f"{e}.up_proj.weight"] = (width, hidden)
            self.full_shapes[f"{e}.down_proj.weight"] = (hidden, width)

    @property
    def held(self) -> range:
        """The global ids of the experts this rank holds."""
        return range(self.first, self.first + self.down.shape[0])

    def slot(self, name: str) -> torch.Tensor:
        """The slice of a stack that holds checkpoint tensor `name` (`{e}.{projection}.weight`)."""
        if name not in self.full_shapes:
            raise KeyError(f"no expert weight {name!r} on this rank")
        expert, projection, _ = name.split(".")
        i = int(expert) - self.first
        if projection == "down_proj":
            return self.down[i]
        rows = slice(0, self.width) if projection == "gate_proj" else slice(self.width, None)
        return self.gate_up[i, rows]

    def load_full(self, full: torch.Tensor, name: str) -> None:
        with torch.no_grad():
            self.slot(name).copy_(full)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in self.full_shapes:  # copies: safetensors refuses tensors that share memory
            destination[prefix + name] = self.slot(name).detach().clone()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, *_):
        for name in self.full_shapes:
            if prefix + name in state_dict:
                self.load_full(state_dict[prefix + name], name)
            elif strict:
                missing.append(prefix + name)

    def forward(self, x: torch.Tensor, expert: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Rows of `x` sorted by `expert` (their local index; rows past `ends[-1]` belong to other
        ranks), `ends` the cumulative row counts per local expert (int32): each row through
        its expert's MLP, with no host sync (rows of other ranks come out 0)."""
        if _grouped_mm_fits(x, self.gate_up):
            gate, up = torch._grouped_mm(x, self.gate_up.transpose(1, 2), offs=ends).chunk(2, -1)
            out = torch._grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=ends)
            mine = torch.arange(x.shape[0], device=x.device) < ends[-1]
            return torch.where(mine[:, None], out, 0.0)
        return self._per_expert(x, expert, ends)

    def _per_expert(self, x: torch.Tensor, expert: torch.Tensor, ends: torch.Tensor):
        """The same product one expert at a time, where torch has no grouped matmul for these
        shapes (torch < 2.8, or rows not 16-byte aligned)."""
        out = torch.zeros(x.shape[0], self.down.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for i, end in enumerate(ends.tolist()):
            if end > start:
                rows = x[start:end]
                gate, up = F.linear(rows, self.gate_up[i]).chunk(2, -1)
                out[start:end] = F.linear(F.silu(gate) * up, self.down[i])
            start = end
        return out


def _grouped_mm_fits(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands: it exists (torch >= 2.8) and every
    row is a multiple of 16 bytes."""
    row_bytes = 16 // x.element_size()
    return (
        hasattr(torch, "_grouped_mm")
        and x.shape[-1] % row_bytes == 0
        and weights.shape[1] % (2 * row_bytes) == 0
        and x.dtype == weights.dtype
    )


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg, tp: TPGroup):
        super().__init__()
        self.tp = tp
        local = tp.shard_len(cfg.num_experts, "num_experts")
        self.gate = Router(cfg)  # replicated: every rank routes every token
        self.experts = ExpertBank(
            tp.rank * local, local, cfg.hidden_size, cfg.moe_intermediate_size
        )
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(cfg.hidden_size, cfg.shared_width, tp)
        self.has_shared = bool(cfg.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        chosen, weights = self.gate(flat)
        token, expert, weight, ends = self._sorted_assignments(chosen, weights)
        out = self.experts(flat[token], expert, ends).float() * weight[:, None]
        routed = torch.zeros(flat.shape, dtype=torch.float32, device=x.device)
        routed.index_add_(0, token, out)  # per token in expert order, as one expert at a time
        y = self.tp.all_reduce(routed).to(x.dtype).view(shape)
        return y + self.shared_experts(x) if self.has_shared else y

    def _sorted_assignments(self, chosen: torch.Tensor, weights: torch.Tensor):
        """(token, local expert, weight) of every assignment, sorted by expert with the other
        ranks' experts last, and the cumulative count per local expert; all on the device."""
        local = len(self.experts.held)
        expert = chosen.reshape(-1) - self.experts.first
        expert = torch.where((expert >= 0) & (expert < local), expert, local)
        order = expert.argsort(stable=True)
        counts = torch.zeros(local + 1, dtype=torch.int32, device=chosen.device)
        counts.index_add_(0, expert, torch.ones_like(expert, dtype=torch.int32))
        ends = counts[:local].cumsum(0, dtype=torch.int32)
        return order // chosen.shape[1], expert[order], weights.reshape(-1)[order], ends
