"""Building blocks of the model families, written for tensor parallelism.

`ColumnParallelLinear` splits its output features across the ranks of a tensor-parallel group and
`RowParallelLinear` its input features, summing partial results with an all-reduce. With the
default `TPGroup()` (one rank) both are plain linear layers. Each module knows how to take its
parameters' shards from full checkpoint tensors (`load_full(full, name)`, with the full shape in
`full_shapes[name]`), so the loader never needs to know the parallel layout.
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
    """y = x W^T (+ b) with W's rows (output features) split across ranks; output stays sharded.

    `parts`: the output features are the concatenation of parts of these sizes (a fused q/k/v
    projection), each split across ranks on its own, so that a rank holds whole heads of each.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup = TPGroup(),
        bias: bool = False,
        parts: tuple[int, ...] | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.parts = parts or (out_features,)
        if sum(self.parts) != out_features:
            raise ValueError(f"parts {self.parts} do not add up to {out_features=}")
        local_out = sum(tp.shard_len(n, "out_features") for n in self.parts)
        self.weight = nn.Parameter(torch.empty(local_out, in_features))
        self.bias = nn.Parameter(torch.empty(local_out)) if bias else None
        self.full_shapes = {"weight": (out_features, in_features), "bias": (out_features,)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_full(self, full: torch.Tensor, name: str = "weight") -> None:
        start, shards = 0, []
        for n in self.parts:
            rows = n // self.tp.size
            lo = start + self.tp.rank * rows
            shards.append(full[lo : lo + rows])
            start += n
        getattr(self, name).data.copy_(torch.cat(shards))


class MergedColumnLinear(ColumnParallelLinear):
    """Column-parallel projections of the same input run as one matmul (q/k/v; gate/up): the
    output is each part's local shard in turn (`split`). The checkpoint keeps one tensor per
    part, named after sibling modules (`parts` {"q_proj": out_features, ...} gives
    `q_proj.weight`, `q_proj.bias`, ...), which load into and save from slices of the merged
    parameters; the files do not change."""

    def __init__(
        self, in_features: int, parts: dict[str, int], tp: TPGroup = TPGroup(), bias=False
    ):
        super().__init__(in_features, sum(parts.values()), tp, bias, tuple(parts.values()))
        self.local_sizes = [tp.shard_len(n, "out_features") for n in parts.values()]
        self.full_shapes, self._rows = {}, {}
        start = 0
        for (name, n), local in zip(parts.items(), self.local_sizes):
            self._rows[name] = slice(start, start + local)
            self.full_shapes[f"{name}.weight"] = (n, in_features)
            if bias:
                self.full_shapes[f"{name}.bias"] = (n,)
            start += local

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The merged output [..., local out] split into the parts' outputs."""
        return y.split(self.local_sizes, dim=-1)

    def slot(self, key: str) -> torch.Tensor:
        """The rows of the merged weight or bias that hold checkpoint tensor `key`."""
        if key not in self.full_shapes:
            raise KeyError(f"no projection weight {key!r} here (parts {list(self._rows)})")
        name, _, attr = key.rpartition(".")
        return getattr(self, attr)[self._rows[name]]

    def load_full(self, full: torch.Tensor, name: str = "weight") -> None:
        rows = full.shape[0] // self.tp.size
        with torch.no_grad():
            self.slot(name).copy_(full[self.tp.rank * rows : (self.tp.rank + 1) * rows])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        parent = _parent_prefix(prefix)
        for key in self.full_shapes:  # copies: safetensors refuses tensors that share memory
            destination[parent + key] = self.slot(key).detach().clone()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, *_):
        parent = _parent_prefix(prefix)
        for key in self.full_shapes:
            if parent + key in state_dict:
                self.load_full(state_dict[parent + key], key)
            elif strict:
                missing.append(parent + key)


def _parent_prefix(prefix: str) -> str:
    """'a.b.qkv.' -> 'a.b.': where a merged module's checkpoint tensors are named."""
    parent = prefix.rstrip(".").rpartition(".")[0]
    return parent + "." if parent else ""


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's columns (input features) split across ranks; partials are
    all-reduced (`reduce=False` leaves that to the caller). The bias is added once, after it."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup = TPGroup(),
        bias: bool = False,
        reduce: bool = True,
    ):
        super().__init__()
        if bias and not reduce:
            raise ValueError("a row-parallel bias needs the layer's own all-reduce (reduce=True)")
        self.tp = tp
        self.reduce = reduce
        local_in = tp.shard_len(in_features, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local_in))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.full_shapes = {"weight": (out_features, in_features), "bias": (out_features,)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def load_full(self, full: torch.Tensor, name: str = "weight") -> None:
        if name == "bias":
            self.bias.data.copy_(full)
            return
        cols = self.weight.shape[1]
        self.weight.data.copy_(full[:, self.tp.rank * cols : (self.tp.rank + 1) * cols])


class RMSNorm(nn.Module):
    """RMS normalisation in fp32. `hf_order`: cast back to the input dtype before the weight
    multiplies (Hugging Face's Llama/Qwen2 order, which Dream and LLaDA2 use); otherwise the
    weight multiplies in fp32 (LLaDA). The two agree exactly in fp32."""

    def __init__(self, dim: int, eps: float, hf_order: bool = False):
        super().__init__()
        self.eps = eps
        self.hf_order = hf_order
        self.weight = nn.Parameter(torch.ones(dim))
        self.full_shapes = {"weight": (dim,)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if self.hf_order:
            return self.weight * F.rms_norm(x.float(), shape, eps=self.eps).to(x.dtype)
        return F.rms_norm(x.float(), shape, self.weight.float(), self.eps).to(x.dtype)

    def load_full(self, full: torch.Tensor, name: str = "weight") -> None:
        self.weight.data.copy_(full)


class Embedding(nn.Module):
    """Token embedding (replicated on every rank; it is small next to the blocks)."""

    def __init__(self, num: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim))
        self.full_shapes = {"weight": (num, dim)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def load_full(self, full: torch.Tensor, name: str = "weight") -> None:
        self.weight.data.copy_(full)


class Rotary(nn.Module):
    """Rotary position embedding, half-split ("rotate_half") convention as in LLaMA and LLaDA.

    `rotary_dim` < head_dim (partial rotary, LLaDA2): only the first `rotary_dim` features of each
    head rotate; the rest pass through.
    """

    def __init__(self, head_dim: int, theta: float, rotary_dim: int | None = None):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.rotary_dim = rotary_dim or head_dim
        inv_freq = self._inv_freq(torch.get_default_device())
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        # computed on the CPU and moved: `arange` on the meta device (a model built there before
        # its weights load) takes torch's reference path, whose first call in a process imports
        # torch._dynamo, 1.7 s of every worker's start-up
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device="cpu")
        return (1.0 / self.theta ** (exponents / self.rotary_dim)).to(device)

    def reset(self) -> None:
        """Recompute the frequencies (after a model built on the meta device is materialised)."""
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def angles(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of positions [batch, seq] for `rotate`, shaped [batch, 1, seq, rotary_dim]
        (each angle twice; sin negated on the first half) in the dtype rotation computes in:
        computed once per forward pass and shared by every layer's queries and keys."""
        angles = positions.float()[:, None, :, None] * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [batch, heads, seq, head_dim] rotated by `angles`' (cos, sin), in their dtype
        (float32: LLaDA's order; the model's dtype: Hugging Face's Llama/Qwen2 order, which
        Dream and LLaDA2 use). x1 * cos - x2 * sin and x2 * cos + x1 * sin, as one product
        with the halves swapped."""
        rot = cos.shape[-1]
        head = x[..., :rot].to(cos.dtype)
        x1, x2 = head.chunk(2, dim=-1)
        rotated = (head * cos + torch.cat((x2, x1), dim=-1) * sin).to(x.dtype)
        if rot == x.shape[-1]:
            return rotated
        return torch.cat((rotated, x[..., rot:]), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, context=None) -> torch.Tensor:
    """Scaled dot-product attention, grouped K/V heads served to their query heads in place.

    q: [batch, heads, q_len, hd]; k, v: [batch, kv_heads, q_len, hd], the queried tokens' own.
    With a `KVContext` (one layer's: `KVContext.at`), each row also attends to its cached K/V
    in place and `mask` is unused; without, `mask` is None (every key visible: SDPA's fused
    kernels) or bool broadcastable to [batch, 1, q_len, q_len]. Returns [batch, q_len, heads * hd].
    """
    if context is not None:
        out = context.attend(q, k, v)
    else:
        gqa = q.shape[1] != k.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    b, _, s, _ = out.shape
    return out.transpose(1, 2).reshape(b, s, -1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), column/row-parallel, gate and up as one matmul; Hugging Face
    names (gate_proj/up_proj/down_proj)."""

    def __init__(self, dim: int, hidden: int, tp: TPGroup = TPGroup(), reduce: bool = True):
        super().__init__()
        self.gate_up = MergedColumnLinear(dim, {"gate_proj": hidden, "up_proj": hidden}, tp)
        self.down_proj = RowParallelLinear(hidden, dim, tp, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up.split(self.gate_up(x))
        return self.down_proj(F.silu(gate) * up)


def run_layers(layers, x: torch.Tensor, angles, mask, context, keep_kv: bool):
    """Every layer in turn, each with its view of `context` (or none); (x, keys, values), the
    queried tokens' keys and values of each layer kept only with `keep_kv`."""
    keys, values = ([], []) if keep_kv else (None, None)
    for i, layer in enumerate(layers):
        x, k, v = layer(x, angles, mask, None if context is None else context.at(i))
        if keep_kv:
            keys.append(k)
            values.append(v)
    return x, keys, values


def init_normal(model: nn.Module, seed: int, std: float) -> None:
    """Random parameters for training from scratch and for tests: norm weights 1, every other
    parameter (biases included) N(0, std). Buffers are left as they are. A module that stacks
    several checkpoint tensors in one parameter (it has `slot`) draws them one checkpoint tensor
    at a time, in its order, so that the weights do not depend on how they are stacked."""
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    stacked: set[nn.Module] = set()
    for name, p in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, RMSNorm):
            p.data.fill_(1.0)
        elif not hasattr(owner, "slot"):
            p.data.normal_(0.0, std, generator=gen)
        elif owner not in stacked:
            stacked.add(owner)
            for key in owner.full_shapes:
                owner.slot(key).data.normal_(0.0, std, generator=gen)
