"""What every model family's forward pass takes and returns: the cached keys/values it also
attends to (`KVContext`, over per-request `KVSlot`s read and written in place) and its hidden
states with the keys/values it computed (`ForwardResult`). The engine and its KV cache speak
these; no family owns them, and none knows which positions a slot's keys belong to."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


@dataclass
class KVSlot:
    """One request's keys/values (after rotary), preallocated for its whole sequence and
    written in place: per layer [kv_heads, capacity, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def like(cls, keys: list[torch.Tensor], capacity: int) -> KVSlot:
        """An empty slot of `capacity` positions shaped like a forward's per-layer keys
        [batch, kv_heads, seq, head_dim]."""
        shapes = [(k.shape[1], capacity, k.shape[3]) for k in keys]
        return cls([keys[0].new_zeros(s) for s in shapes], [keys[0].new_zeros(s) for s in shapes])


@dataclass
class KVContext:
    """The cached keys/values each row of a forward also attends to, in place.

    Row i's slot holds `starts[i]` cached positions at its head; every layer writes the K/V of
    the row's `lengths[i]` queried tokens right after them and attends to the slot's first
    `starts[i] + lengths[i]` positions (no concatenation, no padded copy of the batch).
    `masks[i]`: None (every query sees every key) or bool broadcastable to
    [1, heads, lengths[i], starts[i] + lengths[i]]. `layer`: the layer `attend` serves.
    """

    slots: list[KVSlot]
    starts: list[int]
    lengths: list[int]
    masks: list[torch.Tensor | None]
    layer: int = 0

    def at(self, layer: int) -> KVContext:
        return replace(self, layer=layer)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [batch, heads, s, hd]; k, v [batch, kv_heads, s, hd], the queried tokens' own.
        Each row's k, v go into its slot; returns [batch, heads, s, hd] (0 past a row's
        length)."""
        out = torch.zeros_like(q)
        gqa = q.shape[1] != k.shape[1]
        for i, slot in enumerate(self.slots):
            n, end = self.lengths[i], self.starts[i] + self.lengths[i]
            keys, values = slot.keys[self.layer], slot.values[self.layer]
            keys[:, end - n : end] = k[i, :, :n]
            values[:, end - n : end] = v[i, :, :n]
            out[i, :, :n] = F.scaled_dot_product_attention(
                q[i : i + 1, :, :n],
                keys[None, :, :end],
                values[None, :, :end],
                attn_mask=self.masks[i],
                enable_gqa=gqa,
            )[0]
        return out


@dataclass
class ForwardResult:
    hidden: torch.Tensor  # [batch, seq, d_model], after the final norm
    keys: list[torch.Tensor] | None  # per layer [batch, kv_heads, seq, head_dim], if requested
    values: list[torch.Tensor] | None
