"""Prompt encoders for the DWS predictor: a text in, a vector out.

- `HashedEncoder` (the light fallback, the default here): word unigrams and bigrams hashed into
  a few thousand buckets, an embedding bag trained with the heads, plus the prompt's length. It
  needs no weights beyond what DWS training learns, so it works on any machine.
- `SentenceTransformerEncoder`: a sentence-transformers model from a local folder (MiniLM-class,
  e.g. all-MiniLM-L12-v2, as the paper uses), frozen: embeddings are computed once per prompt
  and the heads learn on top. Needs the `dws` extra; nothing is downloaded.

Both expose `features(texts) -> list` (what the encoder needs per prompt, computed once) and
`forward(batch_of_features) -> [batch, dim]`, so training can cache the expensive part.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import numpy as np
import torch
from torch import nn

WORD = re.compile(r"[a-z]+|\d+|[^\sa-z\d]")


def _words(text: str) -> list[str]:
    return WORD.findall(text.lower())


class HashedEncoder(nn.Module):
    kind = "hashed"

    def __init__(self, dim: int = 96, buckets: int = 8192):
        super().__init__()
        self.dim, self.buckets = dim, buckets
        self.bag = nn.EmbeddingBag(buckets, dim, mode="mean")
        self.length = nn.Linear(1, dim)

    def config(self) -> dict:
        return {"kind": self.kind, "dim": self.dim, "buckets": self.buckets}

    def features(self, texts: list[str]) -> list[tuple[np.ndarray, float]]:
        """Per prompt: hashed unigram and bigram ids, and log(1 + words)."""
        out = []
        for text in texts:
            words = _words(text) or ["<empty>"]
            grams = words + [f"{a} {b}" for a, b in zip(words, words[1:])]
            ids = np.array([zlib.crc32(g.encode()) % self.buckets for g in grams], np.int64)
            out.append((ids, float(np.log1p(len(words)))))
        return out

    def forward(self, feats: list[tuple[np.ndarray, float]]) -> torch.Tensor:
        ids = torch.from_numpy(np.concatenate([f[0] for f in feats]))
        offsets = torch.tensor(np.cumsum([0] + [len(f[0]) for f in feats[:-1]]), dtype=torch.long)
        lengths = torch.tensor([[f[1]] for f in feats], dtype=torch.float32)
        return self.bag(ids, offsets) + self.length(lengths)


class SentenceTransformerEncoder(nn.Module):
    kind = "sentence-transformers"

    def __init__(self, folder: str | Path):
        super().__init__()
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise ImportError(
                "the sentence-transformers encoder needs: pip install 'dilaserve[dws]'"
            ) from None
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"sentence-transformers folder {folder} does not exist")
        self.folder = str(Path(folder).resolve())
        self.model = SentenceTransformer(self.folder, device="cpu", local_files_only=True)
        dimension = getattr(self.model, "get_embedding_dimension", None)
        self.dim = (dimension or self.model.get_sentence_embedding_dimension)()
        self.model.requires_grad_(False)  # frozen: its embeddings are computed once

    def config(self) -> dict:
        return {"kind": self.kind, "folder": self.folder}

    def features(self, texts: list[str]) -> list[np.ndarray]:
        vectors = self.model.encode(texts, batch_size=32, convert_to_numpy=True)
        return list(vectors.astype(np.float32))

    def forward(self, feats: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.stack(feats))


def make_encoder(config: dict) -> nn.Module:
    if config["kind"] == HashedEncoder.kind:
        return HashedEncoder(config["dim"], config["buckets"])
    if config["kind"] == SentenceTransformerEncoder.kind:
        return SentenceTransformerEncoder(config["folder"])
    raise ValueError(f"unknown DWS encoder kind {config['kind']!r}")
