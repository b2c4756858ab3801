"""An exported DWS graph run on ONNX Runtime, and the graph's inputs (papers.md 2.5).

`ONNXDWSPredictor` runs a file `onnx_export.export_onnx` wrote (`dws.onnx`, or the INT8
`dws.int8.onnx`) on `CPUExecutionProvider` with one intra-op and one inter-op thread, with the
same `predict` / `latency_ms` as `DWSPredictor`. The graph's inputs are built here
(`graph_features`, `graph_inputs`), for the predictor and for the exporter, which traces and
checks the graph on them; how the graph is built and quantized is `onnx_export.py`'s business.

Graph inputs by encoder:
- hashed: `ids` int64 [total] (every prompt's hashed n-gram ids, concatenated), `offsets` int64
  [batch] (where each prompt's ids start), `length` float32 [batch, 1] (log(1 + words)),
  `prompt_tokens` int64 [batch]. Feature extraction (`HashedEncoder.features`) is pure
  Python/numpy, so the ONNX predictor needs no torch weights.
- sentence-transformers: `input_ids`, `attention_mask` int64 [batch, seq] (the model's own
  tokenizer, `tokenizer.json`, with its truncation length), `length` float32 [batch, 1] (log(1 +
  words)) and `prompt_tokens`. The transformer, its mean pooling and normalisation are IN the
  graph (the paper's deployment), so the ONNX predictor needs neither torch nor
  sentence-transformers, only `tokenizers`.
Output: `surface` float32 [batch, blocks, block_len].
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dilaserve.dws.encoders import HashedEncoder, encoder_folder, log_words, make_encoder
from dilaserve.dws.model import DWSPrediction, median_latency_ms, window_support

FLOAT_NAME, INT8_NAME = "dws.onnx", "dws.int8.onnx"
HASHED_INPUTS = ("ids", "offsets", "length", "prompt_tokens")
TOKEN_INPUTS = ("input_ids", "attention_mask", "length", "prompt_tokens")


class TokenFeatures:
    """The graph's inputs for texts, without torch: the encoder folder's fast tokenizer,
    truncated at the length sentence-transformers used at export, padded to the longest."""

    def __init__(self, folder: str | Path, max_seq_length: int):
        from tokenizers import Tokenizer

        folder = encoder_folder(folder)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_seq_length)
        self.tokenizer.enable_padding(pad_id=self.tokenizer.token_to_id("[PAD]") or 0)

    def features(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray, float]]:
        return [
            (np.array(e.ids, np.int64), np.array(e.attention_mask, np.int64), log_words(t))
            for t, e in zip(texts, self.tokenizer.encode_batch(texts))
        ]


def is_hashed(encoder_config: dict) -> bool:
    return encoder_config["kind"] == HashedEncoder.kind


def graph_input_names(encoder_config: dict) -> tuple[str, ...]:
    """The graph's input names, in order, for the encoder."""
    return HASHED_INPUTS if is_hashed(encoder_config) else TOKEN_INPUTS


def graph_features(encoder_config: dict, max_seq_length: int | None):
    """What computes the graph's per-prompt features: the hashed encoder's hashing (no
    weights needed), or the sentence-transformers folder's tokenizer."""
    if is_hashed(encoder_config):
        return make_encoder(encoder_config)
    if max_seq_length is None:
        raise ValueError("a sentence-transformers graph needs its max_seq_length (export again)")
    return TokenFeatures(encoder_config["folder"], max_seq_length)


def graph_inputs(encoder_config: dict, feats: list, prompt_tokens) -> dict[str, np.ndarray]:
    """The graph's input arrays for `features(texts)` of the encoder and the prompt lengths."""
    tokens = np.asarray(prompt_tokens, dtype=np.int64).reshape(-1)
    if len(tokens) != len(feats):
        raise ValueError(f"{len(feats)} prompts but {len(tokens)} prompt token counts")
    if is_hashed(encoder_config):
        sizes = [len(f[0]) for f in feats]
        return {
            "ids": np.concatenate([f[0] for f in feats]).astype(np.int64),
            "offsets": np.cumsum([0] + sizes[:-1]).astype(np.int64),
            "length": np.array([[f[1]] for f in feats], dtype=np.float32),
            "prompt_tokens": tokens,
        }
    return {
        "input_ids": np.stack([f[0] for f in feats]),
        "attention_mask": np.stack([f[1] for f in feats]),
        "length": np.array([[f[2]] for f in feats], dtype=np.float32),
        "prompt_tokens": tokens,
    }


def create_session(path: Path):
    """An ONNX Runtime session for the graph on one CPU thread, logging errors only."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class ONNXDWSPredictor:
    """An exported DWS graph on ONNX Runtime (one CPU thread); the `DWSPredictor` API.

    The predictor's `dws.json` (encoder config, block sizes, threshold) is read from `folder`
    (default: the ONNX file's folder); where there is none, the copy `export_onnx` embedded in
    the file. A `dws.json` whose encoder or block sizes differ from the embedded copy is refused
    (the graph is stale).
    """

    def __init__(self, path: str | Path, folder: str | Path | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"ONNX file {self.path} does not exist")
        self.session = create_session(self.path)
        props = self.session.get_modelmeta().custom_metadata_map
        embedded = json.loads(props["dws_meta"]) if "dws_meta" in props else None
        self.precision = props.get("precision", "unknown")
        meta_file = Path(folder if folder is not None else self.path.parent) / "dws.json"
        if meta_file.is_file():
            self.meta = json.loads(meta_file.read_text())
        elif embedded is not None:
            self.meta = embedded
        else:
            raise FileNotFoundError(f"no {meta_file} for the DWS graph {self.path}")
        if embedded is not None:
            for key in ("encoder", "max_blocks", "block_len"):
                if embedded[key] != self.meta[key]:
                    raise ValueError(
                        f"{self.path} was exported for {key}={embedded[key]!r} but {meta_file} "
                        f"says {self.meta[key]!r}: export it again (dilaserve export-dws)"
                    )
        self.encoder_config = self.meta["encoder"]
        names = [i.name for i in self.session.get_inputs()]
        want = list(graph_input_names(self.encoder_config))
        if names != want:
            raise ValueError(f"{self.path} takes inputs {names}, the encoder needs {want}")
        max_len = props.get("max_seq_length")
        self.encoder = graph_features(self.encoder_config, max_len and int(max_len))
        self.block_len, self.max_blocks = self.meta["block_len"], self.meta["max_blocks"]
        self.threshold = self.meta.get("threshold")
        self.aligned_blocks = bool(self.meta.get("aligned_blocks", False))

    @classmethod
    def load(cls, folder: str | Path, int8: bool = True) -> ONNXDWSPredictor:
        """The graph `export_onnx(..., folder)` wrote into a DWS folder."""
        return cls(Path(folder) / (INT8_NAME if int8 else FLOAT_NAME), folder)

    def predict(
        self, texts: list[str], prompt_tokens: list[int], gen_len: int | None = None
    ) -> DWSPrediction:
        feats = self.encoder.features(texts)
        inputs = graph_inputs(self.encoder_config, feats, prompt_tokens)
        surface = self.session.run(["surface"], inputs)[0]
        if gen_len is not None:
            surface = window_support(self, surface, gen_len, prompt_tokens)
        return DWSPrediction(surface)

    def latency_ms(self, texts: list[str], prompt_tokens: list[int], repeats: int = 3) -> float:
        return median_latency_ms(self.predict, texts, prompt_tokens, repeats)
