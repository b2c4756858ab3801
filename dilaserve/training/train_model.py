"""Train the bundled dLLMs: small LLaDA (`--arch llada`) or LLaDA2 MoE (`--arch llada2`) models
on generated arithmetic problems.

Masked-diffusion SFT as in LLaDA: the prompt is never masked; each response token (the worked
solution, `#### answer`, then EOS padding to the output window) is masked with probability t,
t ~ U(eps, 1), and the loss is the mean cross-entropy over masked tokens (LLaDA weights each by
1/t, the ELBO; unweighted is far less noisy at this scale: with 1/t weights and lr 2e-3 our first
run's loss rose from 3.3 to 11.9 in 150 steps, unweighted at lr 1e-3 it fell steadily). Half the
rows use a block-structured mask instead (earlier blocks clean, later blocks fully masked, the
current block masked with probability t), the states that semi-autoregressive block decoding
visits. The LLaDA2 family attends block-causally and is trained on exactly the states block
decoding visits (`training/block_diffusion.py`). Writes a checkpoint folder in the Hugging Face
layout, with its tokenizer, plus a training log.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dilaserve.config import DEFAULT_BLOCK_LEN
from dilaserve.models.checkpoint import load_model, save_checkpoint
from dilaserve.models.config import LLaDAConfig
from dilaserve.models.llada import LLaDAModelLM
from dilaserve.models.registry import family_of, load_config
from dilaserve.models.tokenizer import Tokenizer
from dilaserve.tasks import arith
from dilaserve.training import block_diffusion
from dilaserve.training.tokenizer import (
    EOS_TOKEN,
    LLADA2_FORMAT,
    LLADA_FORMAT,
    ChatFormat,
    train_tokenizer,
)

MIN_MASK_RATIO = 1e-3
CHECKPOINT_EVERY = 500
# trained in float32, stored in float16: half the bytes, and the loader reads it into float32
STORED_DTYPE = torch.float16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    out: str
    minutes: float = 55.0
    max_steps: int = 100_000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 100
    d_model: int = 192
    n_layers: int = 6
    n_heads: int = 6
    mlp_hidden_size: int = 512
    vocab_size: int = 300
    gen_len: int = 64
    block_len: int = DEFAULT_BLOCK_LEN
    block_mask_fraction: float = 0.5
    seed: int = 0
    threads: int = 2
    num_shards: int = 2
    difficulty: str = arith.DEFAULT_DIFFICULTY
    init_from: str | None = None  # continue training this checkpoint
    arch: str = "llada"  # a key of ARCHS
    num_kv_heads: int = 2  # llada2: K/V heads
    num_experts: int = 8  # llada2: routed experts (top-2 of 4 groups, 2 groups kept)
    moe_hidden_size: int = 128  # llada2: width of each routed expert and of the shared one
    expert_bias_rate: float = 1e-3  # llada2: the expert-bias balancing step

    def __post_init__(self):
        if self.gen_len % self.block_len:
            raise ValueError(f"{self.block_len=} must divide {self.gen_len=}")
        if self.arch not in ARCHS:
            raise ValueError(f"{self.arch=} must be one of {sorted(ARCHS)}")


def _encode(tok: Tokenizer, problem: arith.Problem, gen_len: int) -> tuple[list[int], list[int]]:
    prompt = tok.encode_chat(problem.question)
    response = tok.encode(problem.target)[: gen_len - 1]
    return prompt, response + [tok.special.eos] * (gen_len - len(response))


def _mask_response(rng: torch.Generator, num_rows: int, cfg: TrainConfig):
    """Per-row mask ratio t and a [rows, gen_len] boolean mask of response positions to hide."""
    t = MIN_MASK_RATIO + (1 - MIN_MASK_RATIO) * torch.rand(num_rows, generator=rng)
    masked = torch.rand(num_rows, cfg.gen_len, generator=rng) < t[:, None]
    num_blocks = cfg.gen_len // cfg.block_len
    blocky = torch.rand(num_rows, generator=rng) < cfg.block_mask_fraction
    block = torch.randint(0, num_blocks, (num_rows,), generator=rng)
    pos_block = torch.arange(cfg.gen_len)[None, :] // cfg.block_len
    structured = (pos_block > block[:, None]) | ((pos_block == block[:, None]) & masked)
    return t, torch.where(blocky[:, None], structured, masked)


def make_batch(tok, problems, cfg: TrainConfig, rng: torch.Generator):
    pairs = [_encode(tok, p, cfg.gen_len) for p in problems]
    seq_len = max(len(p) for p, _ in pairs) + cfg.gen_len
    rows = len(pairs)
    ids = torch.full((rows, seq_len), tok.special.eos, dtype=torch.long)
    valid = torch.zeros(rows, seq_len, dtype=torch.bool)
    resp_index = torch.zeros(rows, cfg.gen_len, dtype=torch.long)
    for i, (prompt, response) in enumerate(pairs):
        n = len(prompt)
        ids[i, : n + cfg.gen_len] = torch.tensor(prompt + response)
        valid[i, : n + cfg.gen_len] = True
        resp_index[i] = torch.arange(n, n + cfg.gen_len)
    t, masked = _mask_response(rng, rows, cfg)
    targets = ids.gather(1, resp_index)
    noisy = ids.clone()
    noisy.scatter_(1, resp_index, torch.where(masked, tok.special.mask, targets))
    positions = torch.arange(seq_len).expand(rows, seq_len)
    return noisy, positions, valid, resp_index, targets, masked, t


def diffusion_loss(model, batch) -> torch.Tensor:
    noisy, positions, valid, resp_index, targets, masked, t = batch
    hidden = model(noisy, positions, valid).hidden
    resp_hidden = hidden.gather(1, resp_index[..., None].expand(-1, -1, hidden.shape[-1]))
    logits = model.logits(resp_hidden[masked])
    return F.cross_entropy(logits, targets[masked])


def block_loss(model, tok, problems, cfg: TrainConfig, rng: torch.Generator) -> torch.Tensor:
    pairs = [_encode(tok, p, cfg.gen_len) for p in problems]
    batch = block_diffusion.make_block_batch(
        pairs, cfg.gen_len, cfg.block_len, tok.special.mask, rng
    )
    return block_diffusion.block_diffusion_loss(model, batch, cfg.block_len)


def masked_loss(model, tok, problems, cfg: TrainConfig, rng: torch.Generator) -> torch.Tensor:
    return diffusion_loss(model, make_batch(tok, problems, cfg, rng))


def _lr(cfg: TrainConfig, step: int, progress: float) -> float:
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    return cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _fresh_model(cfg: TrainConfig, out: Path) -> torch.nn.Module:
    """A randomly initialised model and a newly trained tokenizer, written to `out`."""
    arch = ARCHS[cfg.arch]
    problems = arith.generate(20_000, seed=cfg.seed + 12345)
    texts = [p.question for p in problems] + [p.target for p in problems]
    tok = train_tokenizer(texts, out, cfg.vocab_size, arch.chat)
    mask_id, eos_id = tok.token_to_id(arch.chat.mask_token), tok.token_to_id(EOS_TOKEN)
    return arch.create_model(cfg, tok.get_vocab_size(), mask_id, eos_id)


def _create_llada(cfg: TrainConfig, vocab_size: int, mask_id: int, eos_id: int) -> LLaDAModelLM:
    model_cfg = LLaDAConfig(
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        n_layers=cfg.n_layers,
        mlp_hidden_size=cfg.mlp_hidden_size,
        vocab_size=vocab_size,
        max_sequence_length=512,
        mask_token_id=mask_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        extra={"block_len": cfg.block_len, "gen_len": cfg.gen_len},
    )
    model = LLaDAModelLM(model_cfg)
    model.init_weights(cfg.seed)
    return model


def _no_balancing(model, cfg: TrainConfig) -> Callable[[], None]:
    return lambda: None


def _expert_balancing(model, cfg: TrainConfig) -> Callable[[], None]:
    return block_diffusion.ExpertBalancer(model, cfg.expert_bias_rate).update


@dataclass(frozen=True, slots=True)
class Arch:
    """How `train` builds, trains and balances one model family."""

    family: str  # the registry's name for it (`ModelFamily.name`)
    chat: ChatFormat  # the tokenizer's special tokens and chat template
    create_model: Callable  # (cfg, vocab_size, mask_id, eos_id) -> a randomly initialised model
    batch_loss: Callable  # (model, tok, problems, cfg, rng) -> the batch's loss
    balancing: Callable  # (model, cfg) -> called after each optimizer step


ARCHS = {
    "llada": Arch("LLaDA", LLADA_FORMAT, _create_llada, masked_loss, _no_balancing),
    "llada2": Arch(
        "LLaDA2", LLADA2_FORMAT, block_diffusion.create_llada2, block_loss, _expert_balancing
    ),
}


def _resume(cfg: TrainConfig, out: Path) -> torch.nn.Module:
    """Continue from a checkpoint: its weights and tokenizer (the optimizer starts anew)."""
    src = Path(cfg.init_from)
    family = family_of(load_config(src)).name
    if family != ARCHS[cfg.arch].family:
        raise ValueError(f"{cfg.init_from=} is a {family} checkpoint, not {cfg.arch=}")
    out.mkdir(parents=True, exist_ok=True)
    if src.resolve() != out.resolve():
        for name in TOKENIZER_FILES:
            shutil.copy(src / name, out / name)
    return load_model(src).train()


def _training_batch(cfg: TrainConfig, py_rng: random.Random) -> list[arith.Problem]:
    problems = (
        arith.make_problem(py_rng, py_rng.randint(1, 3), cfg.difficulty)
        for _ in range(cfg.batch_size)
    )
    return [p for p in problems if not arith.is_held_out(p.question)]


def train(cfg: TrainConfig) -> Path:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    model = _resume(cfg, out) if cfg.init_from else _fresh_model(cfg, out)
    tok = Tokenizer(out, model.config)
    arch = ARCHS[cfg.arch]
    after_step = arch.balancing(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.98))
    rng, py_rng = torch.Generator().manual_seed(cfg.seed), random.Random(cfg.seed)
    log, start, step = [], time.monotonic(), 0
    budget = cfg.minutes * 60
    while step < cfg.max_steps and time.monotonic() - start < budget:
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step, (time.monotonic() - start) / budget)
        loss = arch.batch_loss(model, tok, _training_batch(cfg, py_rng), cfg, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        after_step()
        step += 1
        if step % 25 == 0:
            minutes = round((time.monotonic() - start) / 60, 2)
            log.append({"step": step, "loss": round(loss.item(), 4), "minutes": minutes})
            print(json.dumps(log[-1]), flush=True)
        if step % CHECKPOINT_EVERY == 0:
            save_checkpoint(model, out, num_shards=cfg.num_shards, dtype=STORED_DTYPE)
    save_checkpoint(model, out, num_shards=cfg.num_shards, dtype=STORED_DTYPE)
    summary = {
        "config": asdict(cfg),
        "steps": step,
        "minutes": (time.monotonic() - start) / 60,
        "num_params": sum(p.numel() for p in model.parameters()),
        "log": log,
    }
    (out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    return out
