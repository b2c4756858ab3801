"""What the latency presets price: published model shapes and GPU data-sheet numbers."""

from __future__ import annotations

from dataclasses import dataclass

BYTES_BF16 = 2


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Published config numbers of a bidirectional transformer (bf16 weights)."""

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden: int
    vocab: int
    params: float  # published parameter count

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def derived_params(self) -> int:
        """Parameters from the shapes: SwiGLU MLP, untied input/output embeddings, no biases."""
        kv = self.n_kv_heads * self.head_dim
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * kv
        mlp = 3 * self.hidden * self.mlp_hidden
        return self.n_layers * (attn + mlp) + 2 * self.vocab * self.hidden

    @property
    def matmul_params(self) -> float:
        """Parameters that multiply every token: all but the input embedding (a gather)."""
        return self.params - self.vocab * self.hidden

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

H100_SXM = GPUSpec("H100 SXM", 989e12, 3.35e12, 80, 450e9, 8, 50e9)
GH200 = GPUSpec("GH200", 989e12, 4.0e12, 96, 450e9, 4, 25e9)
