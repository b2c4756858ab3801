"""Block-diffusion SFT for the LLaDA2 family (`train-model --arch llada2`): model, batch, loss.

Inference decodes blocks of `block_len` positions aligned to absolute positions (0, B, 2B, ...)
and attends block-causally, so a block b is predicted from clean earlier blocks (the prompt is
never masked, and its last `prompt_len % B` tokens share the first decoded block) and its own
partly masked tokens; later blocks do not reach it. Each row trains every block of its answer
window at once, exactly as inference sees it: the row holds a clean copy of prompt + answer and,
after it, a noisy copy of the blocks the answer touches (the prompt's tail clean, each block's
answer positions masked at its own ratio t ~ U(eps, 1)). A noisy token sees the clean copy's
earlier blocks and the noisy copy's own block; a clean token sees the clean copy block-causally.
The loss is the unweighted cross-entropy on masked positions (see `train_model`).

Expert bias: the routers' `expert_bias` is updated outside gradient descent as in the published
aux-loss-free balancing: after each step it moves by a fixed rate toward even expert load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dilaserve.models.layers import run_layers
from dilaserve.models.llada2 import LLaDA2Config, LLaDA2MoeModelLM
from dilaserve.models.moe import Router

MIN_MASK_RATIO = 1e-3
ROUTED_SCALING_FACTOR = 2.5  # LLaDA2.0-mini's


@dataclass(frozen=True, slots=True)
class BlockBatch:
    ids: torch.Tensor  # [rows, len]: clean copy, then noisy copy
    positions: torch.Tensor  # [rows, len]: absolute positions (the noisy copy repeats them)
    valid: torch.Tensor  # [rows, len]
    is_noisy: torch.Tensor  # [rows, len]: in the noisy copy
    targets: torch.Tensor  # [rows, len]: the clean token at every column
    is_masked: torch.Tensor  # [rows, len]: masked answer positions of the noisy copy (the loss)


def llada2_config(cfg, vocab_size: int, pad_id: int) -> dict:
    """config.json for a fresh model: LLaDA2.0's published keys with small values, plus the
    bundled model's `block_len` and `gen_len`. `cfg` is a `TrainConfig`."""
    head_dim = cfg.d_model // cfg.n_heads
    return {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": cfg.mlp_hidden_size,
        "first_k_dense_replace": 1,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": cfg.moe_hidden_size,
        "routed_scaling_factor": ROUTED_SCALING_FACTOR,
        "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "norm_topk_prob": True,
        "router_dtype": "fp32",
        "hidden_act": "silu",
        "partial_rotary_factor": 0.5,
        "rotary_dim": head_dim // 2,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "use_bias": False,
        "use_qkv_bias": False,
        "use_rmsnorm": True,
        "norm_head": False,
        "norm_softmax": False,
        "using_split_qkv_in_self_attention": False,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
        "torch_dtype": "float32",
        "pad_token_id": pad_id,
        "block_len": cfg.block_len,
        "gen_len": cfg.gen_len,
    }


def create_llada2(cfg, vocab_size: int, mask_id: int, eos_id: int) -> LLaDA2MoeModelLM:
    """A randomly initialised model (the mask id is the tokenizer's `<|mask|>`, as published)."""
    raw = llada2_config(cfg, vocab_size, eos_id)
    model = LLaDA2MoeModelLM(LLaDA2Config.from_dict(raw))
    model.init_weights(cfg.seed)
    return model


def make_block_batch(pairs, gen_len: int, block_len: int, mask_id: int, rng) -> BlockBatch:
    """`pairs`: (prompt ids, answer ids of length gen_len) per row."""
    starts = [len(p) // block_len * block_len for p, _ in pairs]
    clean_len = max(len(p) for p, _ in pairs) + gen_len
    noisy_len = max(len(p) + gen_len - s for (p, _), s in zip(pairs, starts))
    shape = (len(pairs), clean_len + noisy_len)
    ids = torch.zeros(shape, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    valid = torch.zeros(shape, dtype=torch.bool)
    is_answer = torch.zeros(shape, dtype=torch.bool)
    for i, ((prompt, answer), start) in enumerate(zip(pairs, starts)):
        seq, n = torch.tensor(prompt + answer), len(prompt)
        for first, begin in ((0, 0), (clean_len, start)):  # the clean copy, the noisy copy
            cols = slice(first, first + n + gen_len - begin)
            ids[i, cols], positions[i, cols] = seq[begin:], torch.arange(begin, n + gen_len)
            valid[i, cols] = True
            is_answer[i, first + n - begin : cols.stop] = True
    is_noisy = torch.zeros(shape, dtype=torch.bool)
    is_noisy[:, clean_len:] = True
    is_masked = _mask_blocks(positions, is_noisy & is_answer, block_len, rng)
    noisy = torch.where(is_masked, mask_id, ids)
    return BlockBatch(noisy, positions, valid, is_noisy, ids, is_masked)


def _mask_blocks(positions, maskable, block_len: int, rng) -> torch.Tensor:
    """Each (row, block) draws its ratio t ~ U(eps, 1); each maskable position is masked
    with its block's t."""
    blocks = positions // block_len
    num_blocks = int(blocks.max()) + 1
    t = MIN_MASK_RATIO + (1 - MIN_MASK_RATIO) * torch.rand(
        positions.shape[0], num_blocks, generator=rng
    )
    draws = torch.rand(positions.shape, generator=rng)
    return maskable & (draws < t.gather(1, blocks))


def two_copy_mask(positions, valid, is_noisy, block_len: int) -> torch.Tensor:
    """[rows, 1, len, len] bool: clean queries see clean keys of their block and earlier ones;
    noisy queries see clean keys of earlier blocks and noisy keys of their own block. A padding
    query sees every valid key (its output is dropped; no row is left empty)."""
    blocks = positions // block_len
    bq, bk = blocks[:, :, None], blocks[:, None, :]
    nq, nk = is_noisy[:, :, None], is_noisy[:, None, :]
    clean_keys = ~nk & ((bk < bq) | (~nq & (bk == bq)))
    noisy_keys = nq & nk & (bk == bq)
    allowed = (clean_keys | noisy_keys | ~valid[:, :, None]) & valid[:, None, :]
    return allowed[:, None]


def masked_logits(model: LLaDA2MoeModelLM, batch: BlockBatch, block_len: int) -> torch.Tensor:
    """Logits [masked positions, vocab] of the batch's masked positions."""
    mask = two_copy_mask(batch.positions, batch.valid, batch.is_noisy, block_len)
    x = model.model.word_embeddings(batch.ids)
    x, _, _ = run_layers(
        model.model.layers, x, model.rotary.angles(batch.positions), mask, None, False
    )
    return model.logits(model.model.norm(x)[batch.is_masked])


def block_diffusion_loss(model, batch: BlockBatch, block_len: int) -> torch.Tensor:
    logits = masked_logits(model, batch, block_len)
    return F.cross_entropy(logits, batch.targets[batch.is_masked])


class ExpertBalancer:
    """Aux-loss-free load balancing: counts each router's tokens per expert during a step, then
    moves its `expert_bias` by `rate` up for experts below the mean load, down for those above."""

    def __init__(self, model: torch.nn.Module, rate: float):
        self.rate = rate
        self.loads: dict[Router, torch.Tensor] = {}
        for module in model.modules():
            if isinstance(module, Router):
                module.register_forward_hook(self._count)

    def _count(self, router: Router, args, output) -> None:
        chosen = output[0].flatten()
        load = torch.bincount(chosen, minlength=router.cfg.num_experts).float()
        self.loads[router] = self.loads.get(router, 0) + load

    def update(self) -> None:
        with torch.no_grad():
            for router, load in self.loads.items():
                router.expert_bias += self.rate * torch.sign(load.mean() - load)
        self.loads.clear()
