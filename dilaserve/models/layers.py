"""Building blocks of the LLaDA architecture, written for tensor parallelism.

`ColumnParallelLinear` splits its output features across the ranks of a tensor-parallel group and
`RowParallelLinear` its input features, summing partial results with an all-reduce. With the
default `TPGroup()` (one rank) both are plain linear layers. Each parameter knows how to take its
own shard from a full checkpoint tensor (`load_full`), so the loader never needs to know the
parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    """Where this module sits in a tensor-parallel gang; `group` is a torch.distributed group."""

    size: int = 1
    rank: int = 0
    group: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def shard_len(self, full: int, what: str) -> int:
        if full % self.size:
            raise ValueError(f"{what}={full} is not divisible by tensor-parallel size {self.size}")
        return full // self.size


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows (output features) split across ranks; output stays sharded."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup = TPGroup()):
        super().__init__()
        self.tp = tp
        self.full_shape = (out_features, in_features)
        local_out = tp.shard_len(out_features, "out_features")
        self.weight = nn.Parameter(torch.empty(local_out, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def load_full(self, full: torch.Tensor) -> None:
        rows = self.weight.shape[0]
        self.weight.data.copy_(full[self.tp.rank * rows : (self.tp.rank + 1) * rows])


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns (input features) split across ranks; partials are all-reduced."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup = TPGroup()):
        super().__init__()
        self.tp = tp
        self.full_shape = (out_features, in_features)
        local_in = tp.shard_len(in_features, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))

    def load_full(self, full: torch.Tensor) -> None:
        cols = self.weight.shape[1]
        self.weight.data.copy_(full[:, self.tp.rank * cols : (self.tp.rank + 1) * cols])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.full_shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)

    def load_full(self, full: torch.Tensor) -> None:
        self.weight.data.copy_(full)


class Embedding(nn.Module):
    """Token embedding (replicated on every rank; it is small next to the blocks)."""

    def __init__(self, num: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim))
        self.full_shape = (num, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def load_full(self, full: torch.Tensor) -> None:
        self.weight.data.copy_(full)


class Rotary(nn.Module):
    """Rotary position embedding, half-split ("rotate_half") convention as in LLaMA and LLaDA."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        return 1.0 / self.theta**exponents

    def reset(self) -> None:
        """Recompute the frequencies (after a model built on the meta device is materialised)."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of positions [batch, seq], shaped [batch, 1, seq, head_dim / 2]: computed
        once per forward pass and shared by every layer's queries and keys."""
        angles = positions.float()[:, None, :, None] * self.inv_freq
        return angles.cos(), angles.sin()

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [batch, heads, seq, head_dim], rotated by `angles`' (cos, sin)."""
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.to(x.dtype)
