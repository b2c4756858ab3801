"""The DWS predictor on ONNX Runtime (dilaserve/dws/onnx_export.py exports it,
dilaserve/dws/onnx_predictor.py runs it; papers.md 2.5).

The bundled predictor exported to a temporary folder: the FP32 graph reproduces PyTorch's
surfaces, the INT8 graph stays close, the batch is dynamic, the gen_len support projection is
the same; the sentence-transformers variant (token ids in, the transformer in the graph, INT8
on its nodes) on a tiny random BERT.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import onnx  # noqa: E402

from dilaserve.config import BUNDLED_DWS  # noqa: E402
from dilaserve.dws.model import DWSPredictor  # noqa: E402
from dilaserve.dws.onnx_export import export_onnx  # noqa: E402
from dilaserve.dws.onnx_predictor import FLOAT_NAME, INT8_NAME, ONNXDWSPredictor  # noqa: E402
from dilaserve.tasks import arith  # noqa: E402

FP32_ATOL = 1e-4
# INT8: ONNX Runtime's dynamic mode quantizes the 8192 x 96 hash-embedding table per tensor
# (UInt8, scale = range / 255 = 0.037 for the bundled table, so at most 0.019 per entry before
# the bag mean averages the rounding errors down); heads stay FP32. Measured on the bundled
# predictor: max |surface diff| ~0.005 and expected steps within 0.3%. The bounds below leave
# ~6x of room and still catch a broken graph (a wrong bag or head moves steps by far more).
INT8_SURFACE_ATOL = 0.03
INT8_STEPS_RTOL = 0.02


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dws-onnx")
    predictor = DWSPredictor.load(BUNDLED_DWS)
    path = export_onnx(predictor, folder)
    return predictor, folder, path


@pytest.fixture(scope="module")
def prompts():
    texts = [p.question for p in arith.generate(64, seed=3, split="test")]
    texts += ["", "hi", "Write a long essay about block diffusion decoding " * 20]
    rng = np.random.default_rng(0)
    return texts, rng.integers(5, 300, len(texts)).tolist()


def test_export_writes_both_files_and_embeds_the_meta(exported):
    predictor, folder, path = exported
    assert path == folder / INT8_NAME
    assert (folder / FLOAT_NAME).is_file() and path.is_file()
    fp32, int8 = onnx.load(str(folder / FLOAT_NAME)), onnx.load(str(path))
    assert [i.name for i in fp32.graph.input] == ["ids", "offsets", "length", "prompt_tokens"]
    assert fp32.opset_import[0].version == 17
    props = {p.key: p.value for p in int8.metadata_props}
    assert props["precision"] == "int8"
    assert json.loads(props["dws_meta"])["encoder"] == predictor.meta["encoder"]
    # the hash-embedding table is INT8; the heads' weights stay FP32
    types = {i.name: i.data_type for i in int8.graph.initializer}
    assert types["model.encoder.bag.weight_quantized"] == onnx.TensorProto.UINT8
    assert "model.encoder.bag.weight" not in types
    heads = [n for n in types if n.startswith(("model.count_head", "model.step_head"))]
    assert heads and all(types[n] == onnx.TensorProto.FLOAT for n in heads)
    assert path.stat().st_size < 0.4 * (folder / FLOAT_NAME).stat().st_size


def test_fp32_graph_matches_pytorch(exported, prompts):
    predictor, folder, _ = exported
    texts, tokens = prompts
    onnx_predictor = ONNXDWSPredictor(folder / FLOAT_NAME)  # no dws.json there: embedded meta
    want = predictor.predict(texts, tokens).surface
    got = onnx_predictor.predict(texts, tokens).surface
    assert got.shape == want.shape == (len(texts), predictor.max_blocks, predictor.block_len)
    np.testing.assert_allclose(got, want, rtol=0, atol=FP32_ATOL)


def test_int8_graph_is_close(exported, prompts):
    predictor, folder, path = exported
    texts, tokens = prompts
    want = predictor.predict(texts, tokens)
    got = ONNXDWSPredictor(path, BUNDLED_DWS).predict(texts, tokens)
    assert np.abs(got.surface - want.surface).max() <= INT8_SURFACE_ATOL
    np.testing.assert_allclose(got.expected_steps, want.expected_steps, rtol=INT8_STEPS_RTOL)
    np.testing.assert_allclose(got.expected_blocks, want.expected_blocks, atol=0.05)


def test_dynamic_batch_and_single_prompts_agree(exported, prompts):
    _, folder, _ = exported
    texts, tokens = prompts
    onnx_predictor = ONNXDWSPredictor(folder / FLOAT_NAME, BUNDLED_DWS)
    batch = onnx_predictor.predict(texts[:7], tokens[:7]).surface
    assert batch.shape[0] == 7
    for i in (0, 3, 6):
        one = onnx_predictor.predict([texts[i]], [tokens[i]]).surface
        np.testing.assert_allclose(one[0], batch[i], rtol=0, atol=1e-6)
    assert onnx_predictor.latency_ms(texts[:3], tokens[:3], repeats=1) > 0


def test_gen_len_support_matches_pytorch(exported, prompts):
    predictor, folder, _ = exported
    texts, tokens = prompts
    onnx_predictor = ONNXDWSPredictor.load(folder, int8=False)  # embedded meta (no dws.json)
    assert (onnx_predictor.block_len, onnx_predictor.threshold) == (
        predictor.block_len,
        predictor.threshold,
    )
    for gen_len in (1, 32, 33, 64):
        want = predictor.predict(texts, tokens, gen_len).surface
        got = onnx_predictor.predict(texts, tokens, gen_len).surface
        reach = -(-gen_len // predictor.block_len)
        assert (got[:, reach:] == 0).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=FP32_ATOL)


def test_stale_or_mismatched_files_are_refused(exported, tmp_path):
    predictor, folder, _ = exported
    meta = {**predictor.meta, "max_blocks": predictor.max_blocks + 1}
    (tmp_path / "dws.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="max_blocks"):
        ONNXDWSPredictor(folder / FLOAT_NAME, tmp_path)
    with pytest.raises(FileNotFoundError):
        ONNXDWSPredictor(tmp_path / FLOAT_NAME)
    # an FP32-only export removes an INT8 file that no longer matches it
    (tmp_path / INT8_NAME).write_bytes(b"stale")
    assert export_onnx(predictor, tmp_path, int8=False) == tmp_path / FLOAT_NAME
    assert not (tmp_path / INT8_NAME).exists()


def test_sentence_transformers_graph_holds_the_transformer(tmp_path, monkeypatch):
    pytest.importorskip("sentence_transformers")
    import huggingface_hub.constants
    from dws_helpers import SYN_WORDS, _tiny_sentence_transformer

    from dilaserve.dws.encoders import SentenceTransformerEncoder
    from dilaserve.dws.model import DWSModel

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    _tiny_sentence_transformer(tmp_path, SYN_WORDS)
    encoder = SentenceTransformerEncoder(tmp_path / "st")
    meta = {"encoder": encoder.config(), "max_blocks": 2, "block_len": 32, "threshold": 0.9}
    predictor = DWSPredictor(DWSModel(encoder, 2, 32), meta)  # random heads suffice here

    path = export_onnx(predictor, tmp_path / "out" / "st-dws.onnx")
    assert path == tmp_path / "out" / "st-dws.int8.onnx"
    graph = onnx.load(str(tmp_path / "out" / "st-dws.onnx")).graph
    names = ["input_ids", "attention_mask", "length", "prompt_tokens"]
    assert [i.name for i in graph.input] == names
    int8 = onnx.load(str(path)).graph
    assert any(n.op_type in ("MatMulInteger", "DynamicQuantizeLinear") for n in int8.node)
    texts = ["red cat runs", "the big dog sits on the old bird " * 3, "new"]
    want = predictor.predict(texts, [3, 50, 7], 40).surface
    fp32 = ONNXDWSPredictor(tmp_path / "out" / "st-dws.onnx")
    np.testing.assert_allclose(fp32.predict(texts, [3, 50, 7], 40).surface, want, atol=FP32_ATOL)
    for i, text in enumerate(texts):  # one at a time (no padding) as in the batch
        got = fp32.predict([text], [[3, 50, 7][i]], 40).surface[0]
        np.testing.assert_allclose(got, want[i], rtol=0, atol=FP32_ATOL)
    quantized = ONNXDWSPredictor(path)
    assert quantized.precision == "int8"
    got = quantized.predict(texts, [3, 50, 7], 40).surface
    np.testing.assert_allclose(got, want, rtol=0, atol=INT8_SURFACE_ATOL)


def test_the_estimator_takes_the_int8_graph_where_the_folder_has_one(exported, tmp_path):
    from dilaserve.dws.estimate import DWSEstimator

    predictor, folder, _ = exported
    assert isinstance(DWSEstimator.load(folder).predictor, ONNXDWSPredictor)
    predictor.save(tmp_path)  # no graph exported there
    assert isinstance(DWSEstimator.load(tmp_path).predictor, DWSPredictor)
