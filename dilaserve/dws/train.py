"""`dilaserve train-dws`: collect DWS labels from engine runs and train the predictor.

The labels (papers.md 2.2, `surface.collect_labels`) are each prompt's steps per output block
T_b on the real engine at the serving threshold. Training is coarse to fine (papers.md 2.4):
Stage A fits the encoder and a regression head to the horizon targets T(h) = sum_b min(T_b, h)
(Smooth-L1 on T(h) / mean T(h)); Stage B starts from Stage A's encoder and fits the hazard
heads to the executed-cell grid by the surface Brier score (the shipped default of the paper's
code), the encoder frozen for the first half of the epochs. Each stage keeps its best epoch on
validation prompts (Stage A: MAE of T(32); Stage B: MAE of the surface area against the true
total steps).

The scalar proxies the paper compares against (predicted output length, predicted total steps)
train here too, on the same encoder architecture, so the evaluation compares like with like.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dilaserve.dws.encoders import (
    MINILM,
    HashedEncoder,
    SentenceTransformerEncoder,
    has_packaged_minilm,
)
from dilaserve.dws.model import DWSModel, DWSPredictor, _head
from dilaserve.dws.surface import (
    HORIZONS,
    Labels,
    collect_labels,
    horizon_targets,
    joint_target,
    split,
)


@dataclass(frozen=True)
class DWSTrainConfig:
    """The predictor's training hyperparameters (`train_dws`)."""

    encoder: str | None = None  # MINILM or a sentence-transformers folder; None: hashed
    stage_a_epochs: int = 30
    stage_b_epochs: int = 12  # the first half with the encoder frozen
    batch: int = 32
    head_lr: float = 3e-4
    encoder_lr: float = 1e-3  # the hashed encoder learns from scratch; 4e-5 for a pretrained one
    seed: int = 42
    extra: dict = field(default_factory=dict)


class _Batches:
    """Shuffled mini-batches of (features, targets) with the encoder's features cached."""

    def __init__(self, feats: list, rng: np.random.Generator, batch: int):
        self.feats, self.rng, self.batch = feats, rng, batch

    def __call__(self, n: int):
        order = self.rng.permutation(n)
        for start in range(0, n, self.batch):
            yield order[start : start + self.batch]


def _fit(
    params: list[dict],
    epochs: int,
    step: Callable[[np.ndarray], torch.Tensor],
    score: Callable[[], float],
    batches,
    n: int,
    module: nn.Module,
    on_epoch: Callable[[int], None] | None = None,
) -> float:
    """Train for `epochs`, keeping the parameters of the epoch with the lowest `score`."""
    if epochs < 1:
        raise ValueError(f"{epochs=} must be at least 1")
    optimizer = torch.optim.AdamW(params, weight_decay=0.01)
    best, best_state = float("inf"), None
    for epoch in range(epochs):
        if on_epoch is not None:
            on_epoch(epoch)
        module.train()
        for index in batches(n):
            optimizer.zero_grad()
            loss = step(index)
            loss.backward()
            nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
        module.eval()
        with torch.no_grad():
            value = score()
        if best_state is None or value < best:
            best, best_state = value, copy.deepcopy(module.state_dict())
    module.load_state_dict(best_state)
    return best


def resolve_encoder(name: str | None) -> str | None:
    """A command's encoder choice as `DWSTrainConfig.encoder`: "auto" is the packaged MiniLM
    where the `dws` extra is installed, else the hashed fallback; "hashed" (or None) the
    fallback; anything else MINILM or a sentence-transformers folder."""
    if name == "auto":
        return MINILM if has_packaged_minilm() else None
    return None if name in (None, HashedEncoder.kind) else name


def _encoder(cfg: DWSTrainConfig) -> nn.Module:
    return SentenceTransformerEncoder(cfg.encoder) if cfg.encoder else HashedEncoder()


def _pick(feats: list, index) -> list:
    return [feats[i] for i in index]


@dataclass
class _Run:
    """One training run's model, cached encoder features and the tensors both stages share."""

    model: DWSModel
    train: Labels
    feats: list
    val_feats: list
    val_total: torch.Tensor  # the validation prompts' true total steps
    batches: _Batches
    encoder: list  # the encoder's trainable parameters (none for a frozen one)

    def groups(self, heads, head_lr: float, encoder_lr: float) -> list[dict]:
        params = [{"params": heads, "lr": head_lr}]
        return params + ([{"params": self.encoder, "lr": encoder_lr}] if self.encoder else [])


def train_dws(
    train: Labels, val: Labels, cfg: DWSTrainConfig, log=print, encoder: nn.Module | None = None
) -> DWSPredictor:
    """Train DWS on `train`, keeping the best epochs on `val`. `encoder`: one already loaded
    (a frozen sentence-transformers encoder can be shared); None builds `cfg.encoder`."""
    torch.manual_seed(cfg.seed)
    model = DWSModel(encoder or _encoder(cfg), train.steps.shape[1], train.block_len)
    feats = model.encoder.features(train.texts)
    run = _Run(
        model,
        train,
        feats,
        model.encoder.features(val.texts),
        torch.from_numpy(val.steps.sum(axis=1).astype(np.float32)),
        _Batches(feats, np.random.default_rng(cfg.seed), cfg.batch),
        [p for p in model.encoder.parameters() if p.requires_grad],
    )
    a = _stage_a(run, cfg)
    log(f"Stage A: validation MAE of T(32) {a:.3f} steps")
    b = _stage_b(run, cfg, torch.from_numpy(val.prompt_tokens.astype(np.int64)))
    log(f"Stage B: validation MAE of the surface area {b:.3f} steps")
    meta = {
        "encoder": model.encoder.config(),
        "max_blocks": model.max_blocks,
        "block_len": train.block_len,
        "threshold": train.threshold,
        "aligned_blocks": train.aligned_blocks,
        "horizons": list(HORIZONS),
        "train": asdict(cfg),
        "validation": {"stage_a_t32_mae": round(a, 4), "stage_b_area_mae": round(b, 4)},
    }
    return DWSPredictor(model, meta)


def _stage_a(run: _Run, cfg: DWSTrainConfig) -> float:
    """The encoder and a regression head on the horizon targets T(h) (Smooth-L1, scaled)."""
    model, feats = run.model, run.feats
    targets = torch.from_numpy(horizon_targets(run.train.steps))
    scale = targets.mean(dim=0).clamp(min=1.0)
    smooth = nn.SmoothL1Loss(beta=1.0)
    return _fit(
        run.groups(model.horizon_head.parameters(), cfg.head_lr, cfg.encoder_lr),
        cfg.stage_a_epochs,
        lambda i: smooth(model.horizons(_pick(feats, i)) / scale, targets[i] / scale),
        lambda: float((model.horizons(run.val_feats)[:, -1] - run.val_total).abs().mean()),
        run.batches,
        len(run.train),
        model,
    )


def _stage_b(run: _Run, cfg: DWSTrainConfig, val_tokens: torch.Tensor) -> float:
    """The hazard heads on the executed-cell grid (Brier score); the encoder frozen for the
    first half of the epochs, then fine-tuned at a quarter of its Stage A rate."""
    model, feats, train = run.model, run.feats, run.train
    grid = torch.from_numpy(joint_target(train.steps, train.block_len))
    tokens = torch.from_numpy(train.prompt_tokens.astype(np.int64))
    frozen = cfg.stage_b_epochs // 2

    def freeze(epoch: int) -> None:
        for p in run.encoder:
            p.requires_grad_(epoch >= frozen)

    heads = [
        *model.count_head.parameters(),
        *model.step_head.parameters(),
        *model.remainder.parameters(),
    ]
    try:
        return _fit(
            run.groups(heads, 2 * cfg.head_lr, cfg.encoder_lr / 4),
            cfg.stage_b_epochs,
            lambda i: ((model.surface(_pick(feats, i), tokens[i]) - grid[i]) ** 2).mean(),
            lambda: float(
                (model.surface(run.val_feats, val_tokens).sum(dim=(1, 2)) - run.val_total)
                .abs()
                .mean()
            ),
            run.batches,
            len(train),
            model,
            on_epoch=freeze,
        )
    finally:
        for p in run.encoder:
            p.requires_grad_(True)


class ScalarModel(nn.Module):
    """A one-number prompt-only predictor (a scalar proxy): the same encoder, one output."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder
        self.head = _head(encoder.dim, 128, 1)

    def forward(self, feats) -> torch.Tensor:
        return self.head(self.encoder(feats))[:, 0]


def train_scalar(
    train: Labels,
    val: Labels,
    target: Callable[[Labels], np.ndarray],
    cfg: DWSTrainConfig,
    encoder: nn.Module | None = None,
) -> Callable[[list[str]], np.ndarray]:
    """Train a scalar proxy on `target(labels)`; returns texts -> predictions. `encoder` as
    in `train_dws`."""
    torch.manual_seed(cfg.seed)
    model = ScalarModel(encoder or _encoder(cfg))
    feats, val_feats = model.encoder.features(train.texts), model.encoder.features(val.texts)
    y = torch.from_numpy(target(train).astype(np.float32))
    y_val = torch.from_numpy(target(val).astype(np.float32))
    scale = y.mean().clamp(min=1.0)
    smooth = nn.SmoothL1Loss(beta=1.0)
    enc = [p for p in model.encoder.parameters() if p.requires_grad]
    _fit(
        [{"params": model.head.parameters(), "lr": cfg.head_lr}]
        + ([{"params": enc, "lr": cfg.encoder_lr}] if enc else []),
        cfg.stage_a_epochs,
        lambda i: smooth(model(_pick(feats, i)) / scale, y[i] / scale),
        lambda: float((model(val_feats) - y_val).abs().mean()),
        _Batches(feats, np.random.default_rng(cfg.seed), cfg.batch),
        len(train),
        model,
    )
    model.eval()

    def predict(texts: list[str]) -> np.ndarray:
        with torch.no_grad():
            return model(model.encoder.features(texts)).numpy()

    return predict


@dataclass(frozen=True)
class DWSCommandConfig:
    """`dilaserve train-dws`: label prompts on the engine, then train (`DWSTrainConfig`)."""

    model: str
    out: str
    num: int = 1500
    gen_len: int = 64  # the serving output window the labels describe
    threshold: float = 0.9
    prompts: str | None = None  # a JSONL file with a "prompt" per line; None: the bundled task
    encoder: str | None = "auto"  # see resolve_encoder
    runs: str = "runs"
    seed: int = 5


def load_prompts(cfg: DWSCommandConfig) -> list[str]:
    if cfg.prompts is None:
        from dilaserve.tasks import arith

        return [p.question for p in arith.generate(cfg.num, seed=cfg.seed, split="train")]
    rows = [json.loads(line) for line in Path(cfg.prompts).read_text().splitlines() if line]
    texts = [r["prompt"] for r in rows if r.get("prompt")]
    if not texts:
        raise ValueError(f"prompts file {cfg.prompts} has no rows with a 'prompt' field")
    return texts[: cfg.num]


def train_dws_command(cfg: DWSCommandConfig, log=print) -> Path:
    """Collect labels on the engine, train, save the predictor; a run folder with the labels,
    the validation figures and the predictor's latency per prompt."""
    from dilaserve.runs import create_run_dir, environment, write_json

    folder = create_run_dir(cfg.runs, "train-dws")
    write_json(folder / "config.json", {**asdict(cfg), "environment": environment()})
    texts = load_prompts(cfg)
    log(f"collecting labels: {len(texts)} prompts at threshold {cfg.threshold}")
    labels = collect_labels(cfg.model, texts, cfg.gen_len, cfg.threshold)
    labels.save(folder / "labels.npz")
    train, val = split(labels, 0.2, cfg.seed)
    encoder = resolve_encoder(cfg.encoder)
    log(f"encoder: {encoder or HashedEncoder.kind}")
    predictor = train_dws(train, val, DWSTrainConfig(encoder=encoder), log)
    predictor.save(cfg.out)
    sample = val.texts[:100], val.prompt_tokens[:100].tolist()
    summary = {
        **predictor.meta["validation"],
        "labels": len(labels),
        "mean_total_steps": round(float(labels.steps.sum(axis=1).mean()), 3),
        "latency_ms_per_prompt_1_thread": round(predictor.latency_ms(*sample), 3),
    }
    write_json(folder / "summary.json", summary)
    log(f"{summary}\npredictor: {cfg.out}; run folder: {folder}")
    return folder
