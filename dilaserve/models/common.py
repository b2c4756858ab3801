"""What every model family's forward pass takes and returns: the cached keys/values it also
attends to (`KVContext`) and its hidden states with the keys/values it computed
(`ForwardResult`). The engine and its KV cache speak these; no family owns them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVContext:
    """Cached keys/values (after rotary) the queried tokens also attend to.

    keys[layer], values[layer]: [batch, kv_heads, ctx_len, head_dim]; valid: [batch, ctx_len].
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor


@dataclass
class ForwardResult:
    hidden: torch.Tensor  # [batch, seq, d_model], after the final norm
    keys: list[torch.Tensor] | None  # per layer [batch, kv_heads, seq, head_dim], if requested
    values: list[torch.Tensor] | None
