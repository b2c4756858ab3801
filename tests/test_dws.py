"""The Denoising Surface predictor (dilaserve/dws, papers.md 2.2-2.4): the surface algebra and
label targets by hand; the hashed encoder; labels saved and loaded, and collected on the
bundled model; the estimator the scheduler prices with; the simulator replaying labelled
steps. Training, and the sentence-transformers encoders, are in tests/test_dws_training.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dws_helpers import BLOCK_LEN, synthetic_labels

from dilaserve.config import BUNDLED_MODEL
from dilaserve.dws.encoders import HashedEncoder
from dilaserve.dws.surface import (
    HORIZONS,
    Labels,
    block_steps,
    collect_labels,
    horizon_targets,
    joint_target,
    support,
    surface_from_logits,
    window_blocks,
)
from dilaserve.tasks import arith

BIG = 1e4  # sigmoid(+-BIG) is exactly 1 / 0 in float32


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
