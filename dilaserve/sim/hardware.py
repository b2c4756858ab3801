"""What the latency presets price: published model shapes and GPU data-sheet numbers.

A model is dense (every parameter multiplies every token) or a mixture of experts (`Experts`):
a step then multiplies each token by its active parameters only, and reads from HBM the dense
weights plus the routed experts its tokens chose. Which experts those are is not known ahead, so
the expected number of distinct experts per layer among `n` batch tokens assumes uniform,
independent routing (THE UNIFORM-ROUTING ASSUMPTION, not measured): each token picks `top_k` of
`E`, so an expert is untouched with probability (1 - top_k / E)^n and E (1 - (1 - top_k / E)^n)
are read. Real routers are skewed, which reads fewer distinct experts at small batches.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_BF16 = 2


@dataclass(frozen=True, slots=True)
class Experts:
    """The mixture-of-experts layers of a config: `num_experts` routed SwiGLU experts of width
    `expert_hidden` (`moe_intermediate_size`), `top_k` a token (`num_experts_per_tok`), plus
    `num_shared` shared experts every token runs; the first `num_dense_layers`
    (`first_k_dense_replace`) have the dense MLP instead."""

    num_experts: int
    top_k: int
    expert_hidden: int
    num_shared: int
    num_dense_layers: int

    def distinct_experts(self, batch_tokens: float) -> float:
        """Expected routed experts one layer reads for `batch_tokens` tokens (uniform routing)."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** batch_tokens)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Published config numbers of a transformer (bf16 weights), dense or with `experts`."""

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden: int  # the dense MLP's width (`intermediate_size`)
    vocab: int
    params: float  # published parameter count
    experts: Experts | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.experts is None else self.n_layers - self.experts.num_dense_layers

    @property
    def expert_params(self) -> int:
        """One SwiGLU expert (0 for a dense model)."""
        return 0 if self.experts is None else 3 * self.hidden * self.experts.expert_hidden

    @property
    def derived_params(self) -> int:
        """Parameters from the shapes: SwiGLU MLPs, untied input/output embeddings, no biases
        (norms left out); a MoE layer's experts, shared experts and router."""
        kv = self.n_kv_heads * self.head_dim
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * kv
        dense_layers = self.n_layers - self.num_moe_layers
        mlp = dense_layers * 3 * self.hidden * self.mlp_hidden
        if self.experts is not None:
            e = self.experts
            per_layer = (e.num_experts + e.num_shared) * self.expert_params
            mlp += self.num_moe_layers * (per_layer + self.hidden * e.num_experts)
        return self.n_layers * attn + mlp + 2 * self.vocab * self.hidden

    @property
    def routed_params(self) -> int:
        """Parameters of all routed experts: a step reads only those its tokens route to."""
        if self.experts is None:
            return 0
        return self.num_moe_layers * self.experts.num_experts * self.expert_params

    @property
    def active_params(self) -> float:
        """Parameters one token runs through (all of them for a dense model)."""
        if self.experts is None:
            return self.params
        top_k = self.num_moe_layers * self.experts.top_k * self.expert_params
        return self.derived_params - self.routed_params + top_k

    @property
    def matmul_params(self) -> float:
        """Active parameters that multiply every token: all but the input embedding (a gather)."""
        return self.active_params - self.vocab * self.hidden

    def weight_bytes(self, batch_tokens: float) -> float:
        """Weight bytes one step over `batch_tokens` tokens reads: all of a dense model's; a MoE
        model's dense weights and the distinct routed experts (the uniform-routing assumption)."""
        if self.experts is None:
            return self.params * BYTES_BF16
        distinct = self.experts.distinct_experts(batch_tokens) * self.num_moe_layers
        dense = self.derived_params - self.routed_params
        return (dense + distinct * self.expert_params) * BYTES_BF16

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, bf16."""
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * BYTES_BF16


@dataclass(frozen=True, slots=True)
class GPUSpec:
    name: str
    peak_flops: float  # dense bf16, FLOP/s
    hbm_bytes_per_s: float
    memory_gb: float
    link_bytes_per_s: float  # NVLink, per direction, within a node
    gpus_per_node: int
    internode_bytes_per_s: float  # per GPU, for TP groups wider than a node


LLADA_8B = ModelShape("LLaDA-8B", 32, 4096, 32, 32, 12288, 126464, 8.0e9)
DREAM_7B = ModelShape("Dream-7B", 28, 3584, 28, 4, 18944, 152064, 7.6e9)  # Qwen2.5-7B shapes
# LLaDA2.0-mini: the published config (reference/models.md): 20 layers, hidden 2048, 16 heads,
# 4 K/V heads, dense MLP 5120 in layer 0, then 256 experts of 512, top-8, 1 shared expert;
# vocab 157184, untied. Published: 16B total, ~1.4B active (papers.md, LLaDA2.x).
LLADA2_MINI = ModelShape(
    "LLaDA2.0-mini", 20, 2048, 16, 4, 5120, 157184, 16e9, Experts(256, 8, 512, 1, 1)
)
# LLaDA2.0-flash: 100B total, 6.1B active (papers.md). Its config is not in our references, so
# the shapes are ASSUMED to be those of Ling-flash-2.0, the AR model LLaDA2.0-flash was
# converted from: 32 layers, hidden 4096, 32 heads, 4 K/V heads, dense MLP 9216 in layer 0,
# then 256 experts of 1024, top-8, 1 shared; vocab 157184, untied. With the norms they give
# 102,889,697,280 bf16 parameters, the Ling-flash-2.0 checkpoint's count on its model page,
# and 6.1B active.
LLADA2_FLASH = ModelShape(
    "LLaDA2.0-flash", 32, 4096, 32, 4, 9216, 157184, 100e9, Experts(256, 8, 1024, 1, 1)
)

H100_SXM = GPUSpec("H100 SXM", 989e12, 3.35e12, 80, 450e9, 8, 50e9)
GH200 = GPUSpec("GH200", 989e12, 4.0e12, 96, 450e9, 4, 25e9)
# H200 SXM data sheet: the H100's dense bf16 peak (989 TFLOP/s), 141 GB of HBM3e at 4.8 TB/s,
# NVLink 900 GB/s bidirectional (450 GB/s a direction, as H100's), 8 GPUs an HGX node.
H200_SXM = GPUSpec("H200 SXM", 989e12, 4.8e12, 141, 450e9, 8, 50e9)
