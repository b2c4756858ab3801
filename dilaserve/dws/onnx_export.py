"""Export the DWS predictor to an ONNX graph, FP32 and INT8 (papers.md 2.5).

`export_onnx` writes the part of a `DWSPredictor` after feature extraction (the encoder's
learnable part, the heads and the surface) with `torch.onnx.export` (opset 17, dynamic batch)
as `dws.onnx`, and with `int8=True` also `dws.int8.onnx`: ONNX Runtime dynamic quantization
(`quantize_dynamic`, QInt8 weights, per channel) restricted to the encoder's nodes, heads in
FP32 as in the paper. With a sentence-transformers encoder the transformer, its mean pooling
and normalisation are in the graph, so INT8 quantizes the transformer's nodes. The graph's
inputs, and running it (`ONNXDWSPredictor`), are `onnx_predictor.py`'s; `export_dws_command`
is `dilaserve export-dws`: export, then compare the graphs with PyTorch.

Two rewrites make the graph export cleanly with the TorchScript exporter (checked for equality):
`torch.cumprod` has no opset-17 symbolic, so the survivals are unrolled products (the same
multiplications in the same order, bit-identical); `nn.EmbeddingBag` does export, but as a
`Loop` over bags whose table lookup sits inside the loop body, where ONNX Runtime's quantizer
does not reach it (the 8192 x 96 table would stay FP32), so the wrapper uses a flat `Gather` +
segment mean (a one-hot [batch, total] matmul) instead.

Quantization detail (ONNX Runtime's dynamic mode): the linear layers get per-channel QInt8
weights (`MatMulInteger`); a `Gather` table is quantized per tensor with the activation type
(UInt8), whatever `per_channel` says - that is how ORT's dynamic `GatherQuant` works.
"""

from __future__ import annotations

import inspect
import json
import logging
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dilaserve.dws.model import DWSModel, DWSPredictor
from dilaserve.dws.onnx_predictor import (
    FLOAT_NAME,
    HASHED_INPUTS,
    INT8_NAME,
    TOKEN_INPUTS,
    ONNXDWSPredictor,
    create_session,
    graph_features,
    graph_inputs,
    is_hashed,
)

OPSET = 17
ENCODER_PREFIX = "model.encoder."  # initializer names of the encoder's weights in the graph
HEAD_SCOPES = ("count_head/", "step_head/", "remainder/")  # in the names of the heads' nodes
WEIGHTED_OPS = ("MatMul", "Gemm", "Gather")  # the ops INT8 quantizes when they read weights
FP32_TOLERANCE = 1e-4  # export_onnx checks the FP32 graph against PyTorch to this
_CHECK_TEXTS = [
    "What is 12 plus 7?",
    "Tom has 3 apples and buys 5 more. How many apples does he have now?",
    "",
    "Write a long story about a dragon who learns to count, with many chapters and details.",
]


def _survival(logits: torch.Tensor, dim: int) -> torch.Tensor:
    """cumprod(cat(1, sigmoid(logits)), dim) unrolled: the same products, exportable."""
    hazards = torch.sigmoid(logits).unbind(dim)
    out = [torch.ones_like(hazards[0])]
    for h in hazards:
        out.append(out[-1] * h)
    return torch.stack(out, dim)


class _SurfaceGraph(nn.Module):
    """Pooled state + prompt tokens -> surface; the heads of `DWSModel.surface`."""

    def __init__(self, model: DWSModel):
        super().__init__()
        self.model = model

    def surface(self, h: torch.Tensor, prompt_tokens: torch.Tensor) -> torch.Tensor:
        m = self.model
        remainder = m.remainder(prompt_tokens % m.block_len)
        counts = m.count_head(torch.cat((h, remainder), dim=1))
        steps = m.step_head(h).view(-1, m.max_blocks, m.block_len - 1)
        return _survival(counts, 1)[:, :, None] * _survival(steps, 2)


class _HashedGraph(_SurfaceGraph):
    input_names = HASHED_INPUTS
    dynamic_axes = {
        "ids": {0: "total"},
        "offsets": {0: "batch"},
        "length": {0: "batch"},
        "prompt_tokens": {0: "batch"},
        "surface": {0: "batch"},
    }

    def forward(self, ids, offsets, length, prompt_tokens):
        enc = self.model.encoder
        emb = enc.bag.weight[ids]  # [total, dim]: one flat Gather
        pos = torch.cumsum(torch.ones_like(ids), 0) - 1  # 0..total-1
        bag = (offsets[None, :] <= pos[:, None]).sum(1) - 1  # each id's prompt
        rows = torch.cumsum(torch.ones_like(offsets), 0) - 1  # 0..batch-1
        member = (bag[None, :] == rows[:, None]).to(emb.dtype)  # [batch, total]
        mean = (member @ emb) / member.sum(1, keepdim=True).clamp_min(1.0)
        return self.surface(mean + enc.length(length), prompt_tokens)


def _pooling_mode(pooling: nn.Module) -> str | None:
    """'mean' for a mean-pooling module (sentence-transformers 6, or the older flags)."""
    config = pooling.get_config_dict()
    mode = config.get("pooling_mode")
    if isinstance(mode, (list, tuple)) and len(mode) == 1:
        mode = mode[0]
    return "mean" if mode == "mean" or config.get("pooling_mode_mean_tokens") else mode


class _TransformerGraph(_SurfaceGraph):
    """A sentence-transformers encoder (transformer, mean pooling, optional normalisation) and
    the heads in one graph; its nodes are named under /transformer/ (what INT8 quantizes)."""

    input_names = TOKEN_INPUTS
    dynamic_axes = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "sequence"},
        "length": {0: "batch"},
        "prompt_tokens": {0: "batch"},
        "surface": {0: "batch"},
    }

    def __init__(self, model: DWSModel):
        super().__init__(model)
        modules = list(model.encoder.model)
        pooling = _pooling_mode(modules[1]) if len(modules) > 1 else None
        if pooling != "mean":
            raise ValueError(f"the ONNX export takes mean-pooled encoders, not {pooling!r}")
        self.transformer = modules[0].auto_model
        self.normalize = any(type(m).__name__ == "Normalize" for m in modules[2:])

    def forward(self, input_ids, attention_mask, length, prompt_tokens):
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask)[0]
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
        if self.normalize:
            pooled = nn.functional.normalize(pooled, p=2.0, dim=1)
        return self.surface(torch.cat((pooled, length), dim=1), prompt_tokens)


def _graph_class(encoder_config: dict) -> type[_SurfaceGraph]:
    return _HashedGraph if is_hashed(encoder_config) else _TransformerGraph


def _max_seq_length(encoder: nn.Module) -> int | None:
    model = getattr(encoder, "model", None)  # a sentence-transformers encoder's model
    return None if model is None else int(model.max_seq_length)


def _paths(path: str | Path) -> tuple[Path, Path]:
    path = Path(path)
    if path.suffix == ".onnx":  # a file name: the INT8 copy goes next to it
        return path, path.with_name(path.name[: -len(".onnx")] + ".int8.onnx")
    return path / FLOAT_NAME, path / INT8_NAME


def _torch_export(graph: nn.Module, args: tuple, path: Path) -> None:
    kwargs = {}
    if "dynamo" in inspect.signature(torch.onnx.export).parameters:
        kwargs["dynamo"] = False  # the TorchScript exporter: no onnxscript needed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation notice and tracer warnings
        torch.onnx.export(
            graph,
            args,
            str(path),
            input_names=list(graph.input_names),
            output_names=["surface"],
            dynamic_axes=graph.dynamic_axes,
            opset_version=OPSET,
            do_constant_folding=True,
            **kwargs,
        )


def _add_metadata(path: Path, meta: dict, precision: str, max_len: int | None) -> None:
    import onnx

    proto = onnx.load(str(path))
    del proto.metadata_props[:]
    props = {"dws_meta": json.dumps(meta), "precision": precision}
    if max_len is not None:  # the tokenizer's truncation, for the ONNX predictor
        props["max_seq_length"] = str(max_len)
    for key, value in props.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, str(path))


def _is_encoder_node(node, weights: set[str]) -> bool:
    """A node of the encoder: it reads the encoder's weights by name, or it is a weighted op
    outside the heads (constant folding renames a transformer's transposed weights)."""
    if any(name.startswith(ENCODER_PREFIX) for name in node.input):
        return True
    is_head = any(scope in node.name for scope in HEAD_SCOPES)
    reads_weights = any(name in weights for name in node.input)
    return node.op_type in WEIGHTED_OPS and reads_weights and not is_head


def _quantize(src: Path, dst: Path) -> list[str]:
    """Dynamic QInt8 per-channel quantization of the encoder's nodes only; their names."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = onnx.load(str(src)).graph
    weights = {w.name for w in graph.initializer}
    nodes = [n.name for n in graph.node if _is_encoder_node(n, weights)]
    if not nodes:
        shutil.copyfile(src, dst)
        return []
    quiet = logging.getLogger()
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "consider pre-processing" notices
    try:
        quantize_dynamic(
            src,
            dst,
            weight_type=QuantType.QInt8,
            per_channel=True,
            nodes_to_quantize=nodes,
        )
    finally:
        quiet.setLevel(level)
    return nodes


@torch.inference_mode()
def export_onnx(predictor: DWSPredictor, path: str | Path, int8: bool = True) -> Path:
    """Write `dws.onnx` (and with `int8`, `dws.int8.onnx` next to it); the file to deploy.

    `path` is a folder (files `dws.onnx`, `dws.int8.onnx` in it) or a `NAME.onnx` file (the
    INT8 copy is `NAME.int8.onnx`). Returns the INT8 file with `int8`, else the FP32 one. The
    FP32 graph is checked against PyTorch on a few prompts (max abs surface difference
    <= 1e-4) before anything is quantized. Without `int8`, an INT8 file left there by an
    earlier export is removed (it would no longer match the FP32 one).
    """
    model = predictor.model.eval()
    encoder_config = model.encoder.config()
    graph = _graph_class(encoder_config)(model).eval()
    float_path, int8_path = _paths(path)
    float_path.parent.mkdir(parents=True, exist_ok=True)

    texts = _CHECK_TEXTS
    tokens = [5, 40, 0, 77]
    feats = model.encoder.features(texts)
    max_len = _max_seq_length(model.encoder)
    graph_feats = graph_features(encoder_config, max_len).features(texts)
    inputs = graph_inputs(encoder_config, graph_feats, tokens)
    _torch_export(graph, tuple(torch.from_numpy(v) for v in inputs.values()), float_path)
    meta = {**predictor.meta, "encoder": encoder_config}
    _add_metadata(float_path, meta, "fp32", max_len)

    expect = model.surface(feats, torch.tensor(tokens, dtype=torch.long)).numpy()
    got = create_session(float_path).run(["surface"], inputs)[0]
    error = float(np.abs(got - expect).max())
    if not error <= FP32_TOLERANCE:
        raise RuntimeError(f"the exported DWS graph differs from PyTorch by {error:.3g}")
    if not int8:
        int8_path.unlink(missing_ok=True)
        return float_path
    nodes = _quantize(float_path, int8_path)
    _add_metadata(int8_path, meta, "int8" if nodes else "fp32 (no encoder nodes)", max_len)
    return int8_path


def export_dws_command(
    folder: str | Path,
    int8: bool = True,
    model: str | Path | None = None,
    num: int = 200,
    seed: int = 0,
    log=print,
) -> dict:
    """`dilaserve export-dws`: export into the DWS folder, then compare with PyTorch on `num`
    bundled-task prompts (prompt lengths under `model`'s chat template) and time one prompt at
    a time on one thread. Returns the figures it prints."""
    from dilaserve.config import BUNDLED_MODEL
    from dilaserve.models.registry import load_config
    from dilaserve.models.tokenizer import Tokenizer
    from dilaserve.tasks import arith

    folder = Path(folder)
    predictor = DWSPredictor.load(folder)
    export_onnx(predictor, folder, int8=int8)
    model = Path(model or BUNDLED_MODEL)
    tokenizer = Tokenizer(model, load_config(model))
    texts = [p.question for p in arith.generate(num, seed=seed, split="test")]
    tokens = [len(tokenizer.encode_chat(t)) for t in texts]
    want = predictor.predict(texts, tokens)
    report = {"prompts": num, "latency_ms": {"pytorch": predictor.latency_ms(texts, tokens)}}
    for name, use_int8 in [("onnx_fp32", False)] + ([("onnx_int8", True)] if int8 else []):
        onnx_predictor = ONNXDWSPredictor.load(folder, int8=use_int8)
        got = onnx_predictor.predict(texts, tokens)
        steps = np.abs(got.expected_steps - want.expected_steps) / want.expected_steps
        report[name] = {
            "file": str(onnx_predictor.path),
            "bytes": onnx_predictor.path.stat().st_size,
            "max_abs_surface_diff": float(np.abs(got.surface - want.surface).max()),
            "max_rel_expected_steps_diff": float(steps.max()),
        }
        report["latency_ms"][name] = onnx_predictor.latency_ms(texts, tokens)
    log(f"exported to {folder}; {num} bundled-task prompts (seed {seed}, test split)")
    for name in ("onnx_fp32", "onnx_int8"):
        if name in report:
            r = report[name]
            log(
                f"{name}: {Path(r['file']).name} ({r['bytes'] / 1e6:.2f} MB), max |surface - "
                f"pytorch| = {r['max_abs_surface_diff']:.3g}, max relative expected-steps "
                f"difference = {r['max_rel_expected_steps_diff']:.3g}"
            )
    latency = ", ".join(f"{k} {v:.3f} ms" for k, v in report["latency_ms"].items())
    log(f"median latency per prompt (1 thread): {latency}")
    return report
