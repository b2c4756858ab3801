"""LLaDA2.x (`LLaDA2MoeModelLM`: LLaDA2.0-mini / -flash): a mixture-of-experts block-diffusion LM.

Attention is block-causal: bidirectional inside a block of `block_len` tokens aligned to absolute
positions 0, B, 2B, ..., causal across blocks, so the K/V of finished blocks never change (the
engine caches them exactly). Each layer: RMSNorm, fused q/k/v projection, RMSNorm on q and k
(`use_qk_norm`), partial rotary (`partial_rotary_factor`), attention, `dense` output; then RMSNorm
and either a dense SiLU MLP (the first `first_k_dense_replace` layers) or a MoE block.

The MoE block and its routing (published `LLaDA2MoeGate`) are in `models/moe.py`.

Under tensor parallelism the attention and the dense/shared MLPs are column/row-parallel and the
routed experts are split across ranks (rank r holds a contiguous slice); each rank sums its own
experts' outputs and one all-reduce joins them. Parameter names and config keys are the published
checkpoint's; no code from a checkpoint folder is ever run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from dilaserve.models.common import ForwardResult, KVContext
from dilaserve.models.family import (
    Attention,
    DecodingRule,
    ModelFamily,
    TokenEditing,
    build_config,
    check_divisible,
    config_dict,
)
from dilaserve.models.layers import (
    ColumnParallelLinear,
    Embedding,
    GatedMLP,
    RMSNorm,
    Rotary,
    RowParallelLinear,
    TPGroup,
    attend,
    init_normal,
    run_layers,
)
from dilaserve.models.moe import SparseMoeBlock
from dilaserve.protocol import EosStop

PUBLISHED_BLOCK_LEN = 32  # the block length LLaDA2's published generate uses
REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
ACCEPTED = {  # keys whose other values would need a computation this module does not have
    "hidden_act": ("silu",),
    "rope_scaling": (None,),
    "score_function": ("sigmoid",),
    "norm_topk_prob": (True,),
    "moe_router_enable_expert_bias": (True,),
    "router_dtype": ("fp32", "float32"),
    "use_rmsnorm": (True,),
    "norm_softmax": (False,),
    "norm_head": (False,),
    "using_split_qkv_in_self_attention": (False,),
    "use_sliding_window": (False,),
}
EXPERT_KEY = re.compile(r"\.mlp\.experts\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class LLaDA2Config:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_key_value_heads: int = 0  # 0: as many as query heads (the published config class)
    head_dim: int | None = None
    n_group: int = 1
    topk_group: int = 1
    num_shared_experts: int | None = None
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    rotary_dim: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 16384
    tie_word_embeddings: bool = False
    use_qkv_bias: bool = False
    use_bias: bool = True
    use_qk_norm: bool = True
    mask_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.head_dim:  # absent: hidden_size / heads (the published config class)
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"config.json: {self.num_attention_heads=} must be divisible by "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
            raise ValueError(
                f"config.json: {self.num_experts=} must split into {self.n_group=} groups of at "
                "least two experts (a group scores its two best)"
            )
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"config.json: {self.topk_group=} must be in 1..{self.n_group=}")
        allowed = self.topk_group * self.num_experts // self.n_group
        if not 0 < self.num_experts_per_tok <= allowed:
            raise ValueError(
                f"config.json: {self.num_experts_per_tok=} must be in 1..{allowed} (the experts "
                "of the kept groups)"
            )
        if self.rotary_dim is not None and self.rotary_dim != self.rope_dim:
            raise ValueError(
                f"config.json: {self.rotary_dim=} disagrees with head_dim * "
                f"partial_rotary_factor = {self.rope_dim}"
            )

    @classmethod
    def from_dict(cls, raw: dict) -> LLaDA2Config:
        return build_config(cls, raw, REQUIRED, ACCEPTED)

    def to_dict(self) -> dict:
        return config_dict(self, FAMILY)

    def check_tensor_parallel(self, size: int) -> None:
        """Heads, MLP widths and the routed experts must split evenly across `size` ranks."""
        counts = {
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "num_experts": self.num_experts,
        }
        if self.shared_width:
            counts["moe_intermediate_size * num_shared_experts"] = self.shared_width
        check_divisible(size, counts)

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def shared_width(self) -> int:
        return self.moe_intermediate_size * (self.num_shared_experts or 0)

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def max_sequence_length(self) -> int:
        return self.max_position_embeddings


class LLaDA2Attention(nn.Module):
    def __init__(self, cfg: LLaDA2Config, tp: TPGroup):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads = tp.shard_len(cfg.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = tp.shard_len(cfg.num_kv_heads, "num_key_value_heads")
        self.head_dim = hd
        parts = (cfg.num_attention_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd)
        self.query_key_value = ColumnParallelLinear(
            d, sum(parts), tp, bias=cfg.use_qkv_bias, parts=parts
        )
        if cfg.use_qk_norm:
            self.query_layernorm = RMSNorm(hd, cfg.rms_norm_eps, hf_order=True)
            self.key_layernorm = RMSNorm(hd, cfg.rms_norm_eps, hf_order=True)
        self.use_qk_norm = cfg.use_qk_norm
        self.dense = RowParallelLinear(cfg.num_attention_heads * hd, d, tp, bias=cfg.use_bias)

    def forward(self, x, angles, mask, context):
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = Rotary.rotate(q, *angles), Rotary.rotate(k, *angles)
        v = v.contiguous()
        return self.dense(attend(q, k, v, mask, context)), k, v


class LLaDA2DecoderLayer(nn.Module):
    def __init__(self, cfg: LLaDA2Config, tp: TPGroup, index: int):
        super().__init__()
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, hf_order=True)
        self.attention = LLaDA2Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps, hf_order=True)
        if index < cfg.first_k_dense_replace:
            self.mlp = GatedMLP(d, cfg.intermediate_size, tp)
        else:
            self.mlp = SparseMoeBlock(cfg, tp)

    def forward(self, x, angles, mask, context=None):
        h, k, v = self.attention(self.input_layernorm(x), angles, mask, context)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class LLaDA2MoeModel(nn.Module):
    def __init__(self, cfg: LLaDA2Config, tp: TPGroup):
        super().__init__()
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LLaDA2DecoderLayer(cfg, tp, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, hf_order=True)


def block_causal_mask(
    positions: torch.Tensor, valid: torch.Tensor | None, block_len: int
) -> torch.Tensor:
    """[batch, 1, q, q] bool: a query sees the valid keys whose block (position // block_len)
    is not after its own; a padding query sees every valid key (its output is dropped; no row
    is left empty). `valid` None: no padding."""
    blocks = positions // block_len
    allowed = blocks[:, None, :] <= blocks[:, :, None]
    if valid is not None:
        allowed = (allowed | ~valid[:, :, None]) & valid[:, None, :]
    return allowed[:, None]


def context_masks(context: KVContext, positions: torch.Tensor, block_len: int) -> KVContext:
    """The context with each row's block-causal mask: its cached keys (positions [0, start),
    all in earlier blocks) are all visible, or those its given mask marks valid; its queried
    ones (from position `start` on) are seen block-causally. A row whose queries lie in one
    block keeps its given mask (None: every key visible)."""
    masks = []
    for i, (start, n) in enumerate(zip(context.starts, context.lengths)):
        given = context.masks[i]
        if start // block_len == (start + n - 1) // block_len:
            masks.append(given)
            continue
        queried = block_causal_mask(positions[i : i + 1, :n], None, block_len)[0]
        seen = torch.ones(1, n, start, dtype=torch.bool, device=positions.device)
        mask = torch.cat((seen, queried), dim=2)[None]
        masks.append(mask if given is None else mask & given)
    return replace(context, masks=masks)


class LLaDA2MoeModelLM(nn.Module):
    """Top level; state-dict keys are the checkpoint's (`model.layers.N...`, `lm_head.weight`)."""

    def __init__(self, cfg: LLaDA2Config, tp: TPGroup = TPGroup()):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = LLaDA2MoeModel(cfg, tp)
        if not cfg.tie_word_embeddings:
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_dim)

    def reset_buffers(self) -> None:
        self.rotary.reset()

    def is_held_elsewhere(self, key: str) -> bool:
        """Whether a checkpoint key belongs to another rank (a routed expert it holds)."""
        match = EXPERT_KEY.search(key)
        if match is None or self.tp.size == 1:
            return False
        local = self.config.num_experts // self.tp.size
        return int(match.group(1)) // local != self.tp.rank

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor | None,
        context: KVContext | None = None,
        keep_kv: bool = False,
        block_len: int = PUBLISHED_BLOCK_LEN,
    ) -> ForwardResult:
        """input_ids, positions, valid: [batch, seq] (`valid` None: no padding); `context`
        holds each row's K/V of earlier blocks (every cached key is visible); the queried keys
        are seen block-causally."""
        mask = None
        if context is None:
            mask = block_causal_mask(positions, valid, block_len)
        else:
            context = context_masks(context, positions, block_len)
        x = self.model.word_embeddings(input_ids)
        angles = self.rotary.angles(positions, x.dtype)
        x, keys, values = run_layers(self.model.layers, x, angles, mask, context, keep_kv)
        return ForwardResult(self.model.norm(x), keys, values)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.word_embeddings if self.config.tie_word_embeddings else self.lm_head
        return F.linear(hidden, head.weight)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        init_normal(self, seed, std)


# LLaDA2.1's published decoding (its `generate`: mask-to-token by threshold, at least one a step,
# no steps schedule; token-to-token edits; stop after a block holding EOS) in its two published
# modes, the first the default (SGLang's JointThreshold defaults): (threshold, edit threshold)
LLADA21_DECODING = DecodingRule(
    eos_stop=EosStop.BLOCK, eos_only=True, mask_in_softmax=True, commits_mask=True
)
LLADA21_MODES = (TokenEditing("speed", 0.5, 0.0), TokenEditing("quality", 0.7, 0.5))

FAMILY = ModelFamily(
    name="LLaDA2",
    architectures=("LLaDA2MoeModelLM",),
    model_types=("llada2_moe", "llada21_moe"),  # the second: LLaDA2.1's remote code (same net)
    config_class=LLaDA2Config,
    model_class=LLaDA2MoeModelLM,
    attention=Attention.BLOCK_CAUSAL,
    mask_token="<|mask|>",
    eot_token="<|role_end|>",
    # the published `generate`: a steps schedule, stop after a block holding EOS
    decoding=DecodingRule(
        step_schedule=True,
        eos_stop=EosStop.BLOCK,
        eos_only=True,
        mask_in_softmax=True,
        commits_mask=True,
    ),
    editing_decoding=LLADA21_DECODING,
    editing_modes=LLADA21_MODES,
    editing_model_types=("llada21_moe",),
)
