"""Dream (Dream-v0-Base-7B / Dream-v0-Instruct-7B): a Qwen2 backbone used bidirectionally.

Grouped-query attention with biases on q/k/v, RoPE with the checkpoint's base, RMSNorm in the
Hugging Face order, untied embeddings (tied ones are read too), SiLU-gated MLP; no causal mask.
Parameter names and config keys are the published checkpoint's (`model.layers.N.self_attn.q_proj`,
`model.embed_tokens`, `lm_head`, ...). Decoding reads the token at position i from the output at
i - 1 (`FAMILY.logit_shift`); which positions run and which K/V are cached is the engine's
business. The computation follows Dream's published modeling code (as in Fast-dLLM's
`dream/model/modeling_dream.py`); no code from a checkpoint folder is ever run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dilaserve.models.common import ForwardResult, KVContext
from dilaserve.models.family import (
    DecodingRule,
    ModelFamily,
    build_config,
    check_divisible,
    config_dict,
)
from dilaserve.models.layers import (
    ColumnParallelLinear,
    Embedding,
    GatedMLP,
    MergedColumnLinear,
    RMSNorm,
    Rotary,
    RowParallelLinear,
    TPGroup,
    attend,
    init_normal,
    run_layers,
)

REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)
ACCEPTED = {  # keys whose other values would need a computation this module does not have
    "hidden_act": ("silu",),
    "rope_scaling": (None,),
    "use_sliding_window": (False,),
}


@dataclass(frozen=True, slots=True)
class DreamConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    mask_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"config.json: {self.hidden_size=} must be divisible by {self.num_attention_heads=}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: {self.num_attention_heads=} must be divisible by "
                f"{self.num_key_value_heads=}"
            )

    @classmethod
    def from_dict(cls, raw: dict) -> DreamConfig:
        return build_config(cls, raw, REQUIRED, ACCEPTED)

    def to_dict(self) -> dict:
        return config_dict(self, FAMILY)

    def check_tensor_parallel(self, size: int) -> None:
        """KV heads are split like query heads; fewer KV heads than ranks (which would need
        them replicated) is refused."""
        check_divisible(
            size,
            {
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "intermediate_size": self.intermediate_size,
            },
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def max_sequence_length(self) -> int:
        return self.max_position_embeddings


class DreamAttention(nn.Module):
    def __init__(self, cfg: DreamConfig, tp: TPGroup):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads = tp.shard_len(cfg.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = tp.shard_len(cfg.num_key_value_heads, "num_key_value_heads")
        self.head_dim = hd
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        self.qkv = MergedColumnLinear(d, {"q_proj": q, "k_proj": kv, "v_proj": kv}, tp, True)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, d, tp)

    def forward(self, x, angles, mask, context):
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        rotated = self.num_heads + self.num_kv_heads  # queries and keys rotate together
        q, k = Rotary.rotate(qkv[:, :rotated], *angles).split(
            [self.num_heads, self.num_kv_heads], dim=1
        )
        v = qkv[:, rotated:]
        return self.o_proj(attend(q, k, v, mask, context)), k, v


class DreamDecoderLayer(nn.Module):
    def __init__(self, cfg: DreamConfig, tp: TPGroup):
        super().__init__()
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, hf_order=True)
        self.self_attn = DreamAttention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps, hf_order=True)
        self.mlp = GatedMLP(d, cfg.intermediate_size, tp)

    def forward(self, x, angles, mask, context=None):
        h, k, v = self.self_attn(self.input_layernorm(x), angles, mask, context)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class DreamBaseModel(nn.Module):
    def __init__(self, cfg: DreamConfig, tp: TPGroup):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DreamDecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, hf_order=True)


class DreamModel(nn.Module):
    """Top level; state-dict keys are the checkpoint's (`model.layers.N...`, `lm_head.weight`)."""

    def __init__(self, cfg: DreamConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = DreamBaseModel(cfg, tp)
        if not cfg.tie_word_embeddings:
            # replicated on every rank (logits are needed whole for top-1)
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def reset_buffers(self) -> None:
        self.rotary.reset()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor | None,
        context: KVContext | None = None,
        keep_kv: bool = False,
    ) -> ForwardResult:
        """input_ids, positions, valid: [batch, seq] (`valid` None: no padding); attention is
        bidirectional over the valid keys (a row's cached ones in `context` first)."""
        mask = None if valid is None else valid[:, None, None, :]
        x = self.model.embed_tokens(input_ids)
        angles = self.rotary.angles(positions, x.dtype)
        x, keys, values = run_layers(self.model.layers, x, angles, mask, context, keep_kv)
        return ForwardResult(self.model.norm(x), keys, values)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw logits at each position; the engine reads position i's token from i - 1."""
        head = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        return F.linear(hidden, head.weight)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        init_normal(self, seed, std)


FAMILY = ModelFamily(
    name="Dream",
    architectures=("DreamModel",),
    model_types=("Dream",),
    config_class=DreamConfig,
    model_class=DreamModel,
    logit_shift=1,
    mask_token="<|mask|>",
    eot_token="<|im_end|>",
    # Fast-dLLM's Dream decoders (prefix, dual): a block opens with its first position
    decoding=DecodingRule(mask_in_softmax=True, first_opens_block=True, whole_window=True),
)
