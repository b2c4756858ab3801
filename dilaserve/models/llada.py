"""The LLaDA architecture: a bidirectional LLaMA-style transformer (no causal mask).

Parameter names follow the Hugging Face layout in which LLaDA-8B-Base/-Instruct and LLaDA-1.5
are published (`model.transformer.blocks.N.q_proj.weight`, ...), so their safetensors shards
load without renaming. The forward pass optionally attends to cached keys/values of positions
it does not recompute (`KVContext`), which is all the approximate KV cache needs from the model;
which positions to cache is the engine's business, not the model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dilaserve.models.common import ForwardResult, KVContext
from dilaserve.models.config import LLaDAConfig
from dilaserve.models.family import ModelFamily
from dilaserve.models.layers import (
    ColumnParallelLinear,
    Embedding,
    MergedColumnLinear,
    RMSNorm,
    Rotary,
    RowParallelLinear,
    TPGroup,
    attend,
    init_normal,
    run_layers,
)


class LLaDABlock(nn.Module):
    def __init__(self, cfg: LLaDAConfig, tp: TPGroup):
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        self.num_heads = tp.shard_len(cfg.n_heads, "n_heads")
        self.num_kv_heads = tp.shard_len(cfg.num_kv_heads, "n_kv_heads")
        self.head_dim = hd
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        kv = cfg.num_kv_heads * hd
        self.qkv = MergedColumnLinear(
            d, {"q_proj": cfg.n_heads * hd, "k_proj": kv, "v_proj": kv}, tp
        )
        self.attn_out = RowParallelLinear(cfg.n_heads * hd, d, tp)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps)
        hidden = cfg.mlp_hidden_size  # ff_proj: the SiLU gate
        self.ff_gate_up = MergedColumnLinear(d, {"ff_proj": hidden, "up_proj": hidden}, tp)
        self.ff_out = RowParallelLinear(cfg.mlp_hidden_size, d, tp)

    def attention(self, x, angles, mask, context):
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        rotated = self.num_heads + self.num_kv_heads  # queries and keys rotate together
        q, k = Rotary.rotate(qkv[:, :rotated], *angles).split(
            [self.num_heads, self.num_kv_heads], dim=1
        )
        v = qkv[:, rotated:]
        return self.attn_out(attend(q, k, v, mask, context)), k, v

    def forward(self, x, angles, mask, context=None):
        """angles: the rotary (cos, sin) of the queried positions (`Rotary.angles`)."""
        h, k, v = self.attention(self.attn_norm(x), angles, mask, context)
        x = x + h
        gate, up = self.ff_gate_up.split(self.ff_gate_up(self.ff_norm(x)))
        return x + self.ff_out(F.silu(gate) * up), k, v


class Transformer(nn.Module):
    def __init__(self, cfg: LLaDAConfig, tp: TPGroup):
        super().__init__()
        self.wte = Embedding(cfg.padded_vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LLaDABlock(cfg, tp) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        if not cfg.weight_tying:
            # The LM head is replicated on every rank (logits are needed whole for top-1).
            self.ff_out = ColumnParallelLinear(cfg.d_model, cfg.padded_vocab_size)


class LLaDAModel(nn.Module):
    """LLaDA mask predictor. Outer name `model` mirrors the checkpoint's `model.transformer.*`."""

    def __init__(self, cfg: LLaDAConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        self.config = cfg
        self.transformer = Transformer(cfg, tp)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor | None,
        context: KVContext | None = None,
        keep_kv: bool = False,
    ) -> ForwardResult:
        """input_ids, positions, valid: [batch, seq]; `valid` marks real (non-padding) tokens
        (None: every token is real). Rows with a `context` attend to their cached K/V too."""
        t = self.transformer
        x = t.wte(input_ids)
        mask = None if valid is None else valid[:, None, None, :]
        angles = self.rotary.angles(positions)
        x, keys, values = run_layers(t.blocks, x, angles, mask, context, keep_kv)
        return ForwardResult(t.ln_f(x), keys, values)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        head = t.wte.weight if self.config.weight_tying else t.ff_out.weight
        return F.linear(hidden, head)[..., : self.config.vocab_size]


class LLaDAModelLM(nn.Module):
    """Top-level module; its state-dict keys are the checkpoint's (`model.transformer...`)."""

    def __init__(self, cfg: LLaDAConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        self.tp = tp
        self.model = LLaDAModel(cfg, tp)

    @property
    def config(self) -> LLaDAConfig:
        return self.model.config

    def reset_buffers(self) -> None:
        self.model.rotary.reset()

    def forward(self, *args, **kwargs) -> ForwardResult:
        return self.model(*args, **kwargs)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random initialisation (for training from scratch and for tests)."""
        init_normal(self, seed, std)


FAMILY = ModelFamily(
    name="LLaDA",
    architectures=("LLaDAModelLM",),
    model_types=("llada",),
    config_class=LLaDAConfig,
    model_class=LLaDAModelLM,
    eot_token="<|eot_id|>",
)
