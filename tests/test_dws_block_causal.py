"""DWS on the bundled block-diffusion model (`assets/tiny-llada2`, exact block cache).

Its blocks sit at absolute positions, so a 64-token window that starts inside a block spans
three blocks: `train-dws` labels and learns that third block, the predictor's support keeps it
for such prompts only, and `benchmarks/dws.py --model` judges the model's DWS in its own cache
mode (probes on its engine, the simulator's prefill, block and commit steps). A handful of
prompts and a hand-made kernel keep it to seconds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dilaserve.config import BUNDLED_LLADA2_MODEL, BUNDLED_MODEL, BUNDLED_PROFILE
from dilaserve.dws.cost import CostKernel
from dilaserve.dws.estimate import DWSEstimator
from dilaserve.dws.model import DWSPredictor
from dilaserve.dws.surface import Labels
from dilaserve.dws.train import DWSCommandConfig, train_dws_command
from dilaserve.protocol import StepKind

from conftest import import_benchmark

PROFILE = BUNDLED_LLADA2_MODEL / "dilaserve-calibration" / "cpu-float32" / "profile.json"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """train-dws on 12 bundled-task prompts of tiny-llada2: (its run folder, the predictor)."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("llada2-dws")
    cfg = DWSCommandConfig(
        str(BUNDLED_LLADA2_MODEL), str(tmp / "dws"), num=12, encoder="hashed", runs=str(tmp)
    )
    return train_dws_command(cfg, log=lambda _: None), tmp / "dws"


def test_train_dws_labels_the_block_causal_window(trained):
    run, _ = trained
    labels = Labels.load(run / "labels.npz")
    assert labels.aligned_blocks and labels.block_len == 32
    assert labels.steps.shape == (12, 3)  # a 64-token window at absolute positions: 3 blocks
    assert (labels.prompt_tokens % 32 != 0).any()  # windows that start inside a block
    assert (labels.steps[:, 0] > 0).all()
    for row in labels.steps:  # nothing after the first unreached block
        zero = np.flatnonzero(row == 0)
        assert not zero.size or not row[zero[0] :].any(), row


def test_the_block_causal_predictor_keeps_the_third_block_where_the_window_reaches_it(trained):
    _, folder = trained
    predictor = DWSPredictor.load(folder)
    assert predictor.aligned_blocks and predictor.max_blocks == 3
    texts = ["Tom has 3 apples. How many apples does Tom have now?"] * 2
    surface = predictor.predict(texts, [64, 70], gen_len=64).surface
    raw = predictor.predict(texts, [64, 70]).surface
    assert not surface[0, 2].any()  # P = 64: the window is blocks 0 and 1
    np.testing.assert_array_equal(surface[1], raw[1])  # P = 70: it reaches block 2
    kernel = _kernel()
    (cost, _), _ = DWSEstimator(predictor, kernel).estimate(texts, [64, 70], 64)
    assert cost == pytest.approx(kernel.expected_cost(surface[0], 64))


def _kernel() -> CostKernel:
    """A hand-made kernel of the model's shape (3 blocks of 32 cells)."""
    return CostKernel(
        W=np.full((3, 32), 8.0),
        delta=0.0,
        alpha=1.2,
        beta=1.0,
        m_bar=1.0,
        block_len=32,
        lambda_s=1e-4,
        lambda_b=1e-4,
        train_mse=0.0,
        val_mse=0.0,
        num_probes=5,
    )


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("dws")


def test_alone_step_ms_prices_the_exact_cache_steps(bench):
    import sjf_sim

    from dilaserve.control.profile import LatencyProfile

    profile = LatencyProfile.from_file(PROFILE)
    steps = sjf_sim.alone_step_ms(profile, 42 + 64, [2, 3, 1], "block", prompt_len=42)
    ms = {
        kind: 1e3 * profile.step_latency(1, n, kind)
        for kind, n in (
            (
                StepKind.PREFILL,
                64,
            ),  # the prompt from its first block's start (32) to that block's end
            (StepKind.BLOCK, 32),
            (StepKind.COMMIT, 64),
        )
    }
    kinds = [StepKind.PREFILL, StepKind.BLOCK, StepKind.COMMIT, StepKind.BLOCK, StepKind.BLOCK]
    kinds.append(StepKind.COMMIT)
    assert [(b, s) for b, s, _ in steps] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert [x for _, _, x in steps] == pytest.approx([ms[k] for k in kinds])
    # an approximate cache, as before: a recompute step over the sequence, then cache steps
    dual = LatencyProfile.from_file(BUNDLED_PROFILE)
    recompute = 1e3 * dual.step_latency(1, 106, StepKind.RECOMPUTE)
    cache = 1e3 * dual.step_latency(1, 32, StepKind.CACHE)
    steps = sjf_sim.alone_step_ms(dual, 106, [2, 1])
    assert [x for _, _, x in steps] == pytest.approx([recompute, cache, recompute])


def test_the_benchmark_needs_the_models_own_dws_and_skips_bundled_parts(bench):
    model = ["--model", str(BUNDLED_LLADA2_MODEL)]
    own = ["--labels", "l.npz", "--dws", "d", "--dws-cost", "k.json"]
    with pytest.raises(SystemExit):
        bench.parse_args([*model, "--skip", "prior"])  # no labels, DWS or kernel of its own
    with pytest.raises(SystemExit):
        bench.parse_args([*model, *own])  # the prior part serves the bundled model only
    args = bench.parse_args([*model, *own, "--skip", "prior"])
    assert Path(args.profile) == PROFILE  # the model's own calibration
    bundled = bench.parse_args([])
    assert bundled.model == str(BUNDLED_MODEL) and bundled.labels == bench.BUNDLED_LABELS


def test_the_benchmark_judges_the_block_causal_model(bench, trained, tmp_path):
    run, folder = trained
    kernel = tmp_path / "kernel.json"
    _kernel().save(kernel)
    args = bench.parse_args(
        [
            *("--model", str(BUNDLED_LLADA2_MODEL), "--labels", str(run / "labels.npz")),
            *("--dws", str(folder), "--dws-cost", str(kernel), "--skip", "prior"),
            *("--prompts", "6", "--calibration", "6", "--rates", "40", "--seconds", "1"),
        ]
    )
    rows, summary = bench.cost_error(args, lambda _: None)
    assert summary["kv_cache"] == "block" and summary["held_out_prompts"] == 6
    names = [r["predictor"] for r in rows]
    assert names[:4] == [
        "DWS (surface x kernel), hashed",
        "DWS, kernel rescaled on calibration, hashed",
        "predicted output length, hashed",
        "predicted total steps, hashed",
    ]
    assert all(np.isfinite(r["mean_relative_error"]) for r in rows)
    assert "error_ratio_best_proxy_over_dws, hashed" in summary
    sim = bench.simulated_sjf(args, lambda _: None)
    assert [r["policy"] for r in sim] == ["fcfs", "dws-sjf", "oracle-sjf"]
    assert all(r["finished"] == 40 for r in sim)
