"""The DWS tests' data and encoders (tests/test_dws*.py): labels whose step counts depend on
the text, and a tiny randomly initialised sentence-transformers model, with the network blocked."""

from __future__ import annotations

import socket

import numpy as np
import torch

from dilaserve.dws.surface import Labels

BLOCK_LEN = 32
SYN_WORDS = "red blue green cat dog bird runs jumps sits on the big small old new".split()


def synthetic_labels(n: int, seed: int = 0) -> Labels:
    """k sentences of random words: T_0 = 2k; "answer in detail" adds block 1 with k + 4 steps."""
    rng = np.random.default_rng(seed)
    texts, steps = [], []
    for _ in range(n):
        k, detail = int(rng.integers(1, 9)), bool(rng.integers(0, 2))
        sentences = [" ".join(rng.choice(SYN_WORDS, 3)) + " ." for _ in range(k)]
        sentences.append("answer in detail ." if detail else "answer very briefly .")
        texts.append(" ".join(sentences))
        steps.append([2 * k, k + 4 if detail else 0])
    steps = np.array(steps, np.int32)
    tokens = np.array([len(t.split()) + 7 for t in texts], np.int64)
    output = BLOCK_LEN * (steps > 0).sum(axis=1) - 3
    return Labels(texts, tokens, steps, output, BLOCK_LEN, 0.9)


def _tiny_sentence_transformer(folder, words) -> None:
    """A randomly initialised 1-layer BERT with a WordPiece vocab, saved as a ST model folder."""
    import transformers
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Pooling, Transformer

    hf = folder / "hf"
    hf.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(words))]
    (hf / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(hf / "vocab.txt")).save_pretrained(hf)
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=len(vocab),
        max_position_embeddings=128,
    )
    transformers.BertModel(config).save_pretrained(hf)
    transformer = Transformer(str(hf), max_seq_length=128)
    pooling = Pooling(32, "mean")
    SentenceTransformer(modules=[transformer, pooling], device="cpu").save(str(folder / "st"))


def _block_network(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
