"""DWS as a cost predictor: `dws.py`'s minilm and cost parts (see its docstring and docs/dws/).

`minilm_dws` trains a DWS predictor with the packaged MiniLM encoder on the `--labels`, for the
parts after it. `cost_error` judges each DWS predictor of the target (`dws_target.py`) on
held-out prompts of the bundled task, run alone on its engine: DWS's cost against the scalar
proxies trained on the same labels with the same encoder, a constant, and two floors. It
schedules nothing: DWS's use as an SJF order or a step prior is `dws_scheduling.py`'s.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import numpy as np
from dws_chat import _cached_minilm as _new_cached_minilm
from dws_target import GEN_LEN, dws_encoder_name, target


@functools.cache
def _cached_minilm():
    """The packaged MiniLM encoder, memoised per text, one for the whole run (it is frozen)."""
    return _new_cached_minilm()


def cost_error(args, log) -> tuple[list[dict], dict]:
    from dilaserve.dws.cost import CostKernel
    from dilaserve.dws.estimate import DWSEstimator
    from dilaserve.dws.profile import run_probes
    from dilaserve.dws.surface import Labels
    from dilaserve.tasks import arith

    t = target(args)
    llm = t.llm
    held_out = [p.question for p in arith.generate(args.prompts, seed=77, split="test")]
    labels = Labels.load(t.labels)
    calibration = labels.texts[: args.calibration]
    log(f"probing {len(held_out)} held-out and {len(calibration)} calibration prompts")
    probes = _probes(llm, held_out, run_probes)
    truth = np.array([p.total_ms for p in probes])
    calib_probes = _probes(llm, calibration, run_probes)
    calib_truth = np.array([p.total_ms for p in calib_probes])
    retimed = np.array([p.total_ms for p in _probes(llm, held_out, run_probes)])
    tokens = [len(llm.encode_prompt(x, chat=True)) for x in held_out]
    calib_tokens = [len(llm.encode_prompt(x, chat=True)) for x in calibration]
    predictions, summary = {}, {}
    for encoder, folder in t.dws.items():
        estimator = DWSEstimator.load(folder, t.kernel)
        start = time.perf_counter()
        dws = np.array([c for c, _ in estimator.estimate(held_out, tokens, GEN_LEN)])
        dws_ms = 1e3 * (time.perf_counter() - start) / len(held_out)
        calib = np.array([c for c, _ in estimator.estimate(calibration, calib_tokens, GEN_LEN)])
        scale = _rescale(calib_truth, calib)  # this machine's ms now
        predictions |= {
            f"DWS (surface x kernel), {encoder}": dws,
            f"DWS, kernel rescaled on calibration, {encoder}": scale * dws,
            **_proxies(labels, calibration, calib_truth, held_out, folder, encoder),
        }
        summary[f"dws_ms_per_prompt, {encoder}"] = round(dws_ms, 3)
        summary[f"kernel_rescale, {encoder}"] = round(scale, 4)
    constant = np.full(len(truth), float(np.median(calib_truth)))  # knows nothing of a prompt
    predictions["constant: the calibration probes' median ms"] = constant
    kernel = CostKernel.load(t.kernel)
    calib = np.array([kernel.cost_of_run(p) for p in calib_probes])
    scale = _rescale(calib_truth, calib)  # the kernel alone, rescaled as above
    predictions["floor: true steps x kernel, rescaled"] = scale * np.array(
        [kernel.cost_of_run(p) for p in probes]
    )
    predictions["floor: a second timing of the same runs"] = retimed
    rows = _error_rows(predictions, truth)
    summary |= _proxy_over_dws(rows, t.dws)
    summary = {
        "model": str(t.model),
        "kv_cache": t.kv_cache.value,
        "held_out_prompts": len(held_out),
        "true_ms_mean": round(float(truth.mean()), 3),
        "true_ms_cv": round(float(truth.std() / truth.mean()), 3),
        **summary,
    }
    return rows, summary


def _rescale(truth: np.ndarray, predicted: np.ndarray) -> float:
    """The least-squares factor from `predicted` ms to `truth` (this machine's ms now)."""
    return float(truth @ predicted / (predicted @ predicted))


def _error_rows(predictions: dict[str, np.ndarray], truth: np.ndarray) -> list[dict]:
    return [
        {
            "predictor": name,
            "mean_relative_error": round(float(np.mean(np.abs(p - truth) / truth)), 4),
            "mae_ms": round(float(np.mean(np.abs(p - truth))), 3),
        }
        for name, p in predictions.items()
    ]


def _proxy_over_dws(rows: list[dict], encoders) -> dict:
    """Per encoder, the best proxy's error over DWS's, as stored and rescaled."""
    error = {r["predictor"]: r["mean_relative_error"] for r in rows}
    ratios = {}
    for encoder in encoders:
        best = min(error[f"{proxy}, {encoder}"] for proxy in PROXIES)
        for kind, dws in (
            ("dws", "DWS (surface x kernel)"),
            ("rescaled_dws", "DWS, kernel rescaled on calibration"),
        ):
            ratios[f"error_ratio_best_proxy_over_{kind}, {encoder}"] = round(
                best / error[f"{dws}, {encoder}"], 3
            )
    return ratios


# the scalar proxies the paper compares against: (name, its training target from the labels)
PROXIES = {
    "predicted output length": lambda lab: lab.output_tokens,
    "predicted total steps": lambda lab: lab.steps.sum(axis=1),
}


def _proxies(labels, calibration, calib_truth, held_out, dws_folder, encoder_name) -> dict:
    """The scalar proxies' ms for the held-out prompts: each trained on the labels with the
    encoder of the DWS predictor in `dws_folder` (as `train-dws` split them), then mapped to ms
    by a linear fit on the calibration probes."""
    from dilaserve.dws.encoders import MINILM
    from dilaserve.dws.surface import split
    from dilaserve.dws.train import DWSTrainConfig, train_scalar

    encoder = json.loads((Path(dws_folder) / "dws.json").read_text())["encoder"].get("folder")
    shared = _cached_minilm() if encoder == MINILM else None  # frozen: encode each text once
    train, val = split(labels, 0.2, 5)
    out = {}
    for name, target_of in PROXIES.items():
        cfg = DWSTrainConfig(encoder=encoder)
        proxy = train_scalar(train, val, target_of, cfg, encoder=shared)
        a, b = np.polyfit(proxy(calibration), calib_truth, 1)  # scalar -> ms
        out[f"{name}, {encoder_name}"] = a * proxy(held_out) + b
    return out


def _probes(llm, texts, run_probes) -> list:
    prompts = [llm.encode_prompt(t, chat=True) for t in texts]
    return run_probes(llm, prompts, GEN_LEN, natural=True)


def minilm_dws(args, log) -> list[dict]:
    """DWS with the packaged MiniLM encoder on the `--labels` (the `--dws` predictor's labels
    and split), saved and exported into the run folder for the cost, sim, prior and live parts:
    its validation error beside the `--dws` predictor's."""
    from dilaserve.dws.encoders import MINILM
    from dilaserve.dws.model import DWSPredictor
    from dilaserve.dws.onnx_export import export_onnx
    from dilaserve.dws.surface import Labels, split
    from dilaserve.dws.train import DWSTrainConfig, train_dws

    train, val = split(Labels.load(args.labels), 0.2, 5)  # as train-dws split them
    predictor = train_dws(train, val, DWSTrainConfig(encoder=MINILM), log)
    args.minilm_dws = args.folder / "dws-minilm"
    predictor.save(args.minilm_dws)
    export_onnx(predictor, args.minilm_dws)
    hashed = DWSPredictor.load(args.dws).meta["validation"]
    return [
        {"encoder": f"{dws_encoder_name(args.dws)} (--dws)", **hashed},
        {"encoder": "all-MiniLM-L6-v2", **predictor.meta["validation"]},
    ]
