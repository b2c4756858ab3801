"""The DWS predictor: encoder -> pooled state -> block-count and per-block step hazard heads.

Follows papers.md 2.3 at a small scale: the count head also sees the prompt-length remainder
(P mod block_len under the serving model's tokenizer, embedded); the step head predicts a
hazard per (block, step); `surface_from_logits` turns both into a monotone surface. Stage A of
training uses the same encoder with a regression head on the horizon targets T(h).

`DWSPredictor` is the inference side: load a trained folder, predict surfaces for prompts on
one CPU thread.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dilaserve.dws.encoders import make_encoder
from dilaserve.dws.surface import HORIZONS, support, surface_from_logits

REMAINDER_DIM = 16
# trained in float32, stored in float16: half the bytes, and loading reads it into float32
STORED_DTYPE = torch.float16


def _head(inp: int, hidden: int, out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.LayerNorm(inp),
        nn.Linear(inp, hidden),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, out),
    )


class DWSModel(nn.Module):
    def __init__(self, encoder: nn.Module, max_blocks: int, block_len: int, hidden: int = 128):
        super().__init__()
        self.encoder = encoder
        self.max_blocks, self.block_len = max_blocks, block_len
        dim = encoder.dim
        self.remainder = nn.Embedding(block_len, REMAINDER_DIM)
        self.count_head = _head(dim + REMAINDER_DIM, hidden, max_blocks - 1)
        self.step_head = _head(dim, hidden, max_blocks * (block_len - 1))
        self.horizon_head = _head(dim, 2 * hidden, len(HORIZONS))  # Stage A only

    def pooled(self, feats) -> torch.Tensor:
        return self.encoder(feats)

    def surface(self, feats, prompt_tokens: torch.Tensor) -> torch.Tensor:
        h = self.pooled(feats)
        remainder = self.remainder(prompt_tokens % self.block_len)
        counts = self.count_head(torch.cat((h, remainder), dim=1))
        steps = self.step_head(h).view(-1, self.max_blocks, self.block_len - 1)
        return surface_from_logits(counts, steps)

    def horizons(self, feats) -> torch.Tensor:
        return self.horizon_head(self.pooled(feats))


@dataclass
class DWSPrediction:
    surface: np.ndarray  # [prompts, blocks, block_len]

    @property
    def expected_blocks(self) -> np.ndarray:
        return self.surface[:, :, 0].sum(axis=1)

    @property
    def expected_steps(self) -> np.ndarray:
        return self.surface.sum(axis=(1, 2))


class DWSPredictor:
    """A trained DWS model for inference: `predict(texts, prompt_tokens, gen_len)`."""

    def __init__(self, model: DWSModel, meta: dict):
        self.model = model.eval()
        self.meta = meta
        self.block_len, self.max_blocks = model.block_len, model.max_blocks
        self.threshold = meta.get("threshold")
        self.aligned_blocks = bool(meta.get("aligned_blocks", False))

    @classmethod
    def load(cls, folder: str | Path) -> DWSPredictor:
        folder = Path(folder)
        meta = json.loads((folder / "dws.json").read_text())
        model = DWSModel(make_encoder(meta["encoder"]), meta["max_blocks"], meta["block_len"])
        missing, unexpected = model.load_state_dict(
            load_file(str(folder / "dws.safetensors")), strict=False
        )
        missing = [k for k in missing if not k.startswith("encoder.model.")]
        if missing or unexpected:
            raise ValueError(
                f"DWS weights in {folder} do not fit the model: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
        return cls(model, meta)

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        weights = {
            k: v.to(STORED_DTYPE).contiguous()
            for k, v in self.model.state_dict().items()
            if not k.startswith("encoder.model.")  # a sentence-transformers model stays put
        }
        save_file(weights, str(folder / "dws.safetensors"))
        (folder / "dws.json").write_text(json.dumps(self.meta, indent=2) + "\n")

    @torch.inference_mode()
    def predict(
        self, texts: list[str], prompt_tokens: list[int], gen_len: int | None = None
    ) -> DWSPrediction:
        feats = self.model.encoder.features(texts)
        tokens = torch.tensor(prompt_tokens, dtype=torch.long)
        surface = self.model.surface(feats, tokens).numpy()
        if gen_len is not None:
            surface = window_support(self, surface, gen_len, prompt_tokens)
        return DWSPrediction(surface)

    def latency_ms(self, texts: list[str], prompt_tokens: list[int], repeats: int = 3) -> float:
        return median_latency_ms(self.predict, texts, prompt_tokens, repeats)


def window_support(predictor, surface: np.ndarray, gen_len: int, prompt_tokens) -> np.ndarray:
    """`predictor`'s surface with the blocks each prompt's window cannot reach zeroed: where
    its labels' blocks sit at absolute positions (a block-causal model), per prompt length."""
    tokens = prompt_tokens if predictor.aligned_blocks else None
    return support(surface, gen_len, predictor.block_len, tokens)


def median_latency_ms(predict, texts: list[str], prompt_tokens: list[int], repeats: int) -> float:
    """Median ms per prompt, one prompt at a time on one thread (as a serving CPU would)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(repeats):
            for text, n in zip(texts, prompt_tokens):
                start = time.perf_counter()
                predict([text], [n])
                times.append(1e3 * (time.perf_counter() - start))
        return float(np.median(times))
    finally:
        torch.set_num_threads(threads)
