"""`dilaserve calibrate MODEL`: measure a model's control inputs on this device and dtype.

1. the latency profile at every TP degree asked for, through the cluster's own workers
   (`calibration/latency.py`);
2. trajectories of a prompt set at every candidate threshold on the engine, and the step
   predictor trained on them (`training/train_predictor.py`);
3. a calibration folder (`calibration/store.py`) keyed by the model's config hash, the device
   name and the dtype. TP degrees measured before in the same folder are kept.

Prompts: `--prompts FILE` (JSONL, a "prompt" per line), else the checkpoint's own
`calibration_prompts.jsonl` where it ships one (the bundled model does: its task), else the set
dilaserve ships (GSM8K questions and ShareGPT first turns, `assets/prompts`). The profiled
sequences are capped at the model's positions. Progress and the time left are logged after every
measurement (`calibration/progress.py`); a step predictor whose held-out error is over
`MAX_PREDICTOR_ERROR` is warned about, and refused with `strict`.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from dilaserve.calibration.latency import ProfileGrid, profile_instance
from dilaserve.calibration.plan import TRAJECTORIES, Plan, create_plan, device_name  # noqa: F401
from dilaserve.calibration.progress import Progress, expected_steps
from dilaserve.calibration.store import (
    DWS_COST_FILE,
    PREDICTOR_DIR,
    PROFILE_FILE,
    Calibration,
    CalibrationKey,
    processor_name,
    writable_folder,
)
from dilaserve.config import EDITING_CHOICES, MEASURED_THRESHOLDS
from dilaserve.runs import create_run_dir, environment, markdown_table, write_json, write_records

DEFAULT_THRESHOLDS = MEASURED_THRESHOLDS
# the paper's predictor from progress features alone errs 35.1% on LLaDA-8B (docs/control/): a
# full predictor that errs more has learned less than a request's progress already tells
MAX_PREDICTOR_ERROR = 0.351


@dataclass(frozen=True, slots=True)
class CalibrateConfig:
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    tp: tuple[int, ...] = (1,)
    prompts: str | None = None
    num_prompts: int = 64
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    max_tokens: int | None = None  # the trajectories' window; None: the model's default
    seq_len: int | None = None  # prompt + window of the profiled requests; None: twice the window
    requests: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    repeats: int = 3
    threads: int = 1  # torch threads per worker rank, as `serve` runs them
    cuda_graphs: int = 0
    calibration: str | None = None  # the folder to write; None: next to the model or the cache
    dws: bool = False  # also fit the DWS cost kernel (dws/profile.py) into the folder
    profile_only: bool = False  # add TP degrees to an existing calibration, keep its predictor
    strict: bool = False  # a step predictor over MAX_PREDICTOR_ERROR is an error, not a warning
    # token editing while trajectories are recorded (EngineConfig.editing; None: the
    # checkpoint's own), so that the step predictor learns the edit-only steps served
    editing: str | None = None

    def __post_init__(self):
        if self.editing not in EDITING_CHOICES:
            raise ValueError(f"{self.editing=} must be one of {EDITING_CHOICES}")
        if not self.tp or min(self.tp) < 1:
            raise ValueError(f"{self.tp=} must list TP degrees >= 1")
        if self.num_prompts < 5:
            raise ValueError(f"{self.num_prompts=} must be at least 5 (the predictor's split)")


def measure_profile(worker, tps, grid: ProfileGrid, mask_id: int, progress, kinds):
    """Profile entries and warnings of step `kinds` at every TP degree in `tps`, each through
    an instance of the cluster's local backend (`worker`: a `WorkerConfig`). Its engine never
    finishes a request early: a profiled request stays for the step after its untimed one."""
    from dilaserve.calibration.latency import InstanceTimer
    from dilaserve.cluster.backends import LocalBackend, start_all
    from dilaserve.control.decisions import InstanceSpec

    entries, warnings = [], []
    for tp in tps:
        backend = LocalBackend(replace(worker, engine=replace(worker.engine, early_finish=False)))
        spec = InstanceSpec(f"calibrate-tp{tp}", 0, tp, tuple(range(tp)), None)
        start_all(backend, [spec], timeout=600.0)
        progress.untimed()
        try:
            timer = InstanceTimer(backend, spec.instance_id)
            rows, notes = profile_instance(
                timer,
                tp,
                grid,
                mask_id,
                worker.engine.max_forward_tokens,
                lambda what, tp=tp: progress.advance(f"tp={tp} {what}"),
                kinds,
            )
        finally:
            backend.shutdown()
        entries += rows
        warnings += notes
    return entries, warnings


def _record(cfg, llm, plan, progress):
    """Trajectories at every threshold; after each, the steps the thresholds left will take are
    extrapolated from those measured (`expected_steps`), for the time left."""
    from dilaserve.engine.record import record_trajectories

    trajs, prompts, measured = [], list(plan.prompts), {}
    for i, threshold in enumerate(cfg.thresholds):
        trajs += record_trajectories(llm, prompts, (threshold,), plan.gen_len)
        steps = sum(t.num_steps for t in trajs[-len(prompts) :]) / len(prompts)
        measured[threshold] = steps
        later = expected_steps(measured, cfg.thresholds[i + 1 :], plan.gen_len)
        progress.revise(TRAJECTORIES, [plan.trajectory_cost(n) for n in later])
        progress.advance(f"trajectories at threshold {threshold:g}: {steps:.1f} steps/request")
    return trajs


def calibrate(cfg: CalibrateConfig, log=print) -> Calibration:
    """Measure, fit and write a calibration (`profile_only`: the profile at `cfg.tp` into an
    existing calibration of the same key, whose step predictor is kept)."""
    from dilaserve.cluster.worker import WorkerConfig

    plan = create_plan(cfg, with_prompts=not cfg.profile_only)
    folder = Path(cfg.calibration) if cfg.calibration else writable_folder(cfg.model, plan.key)
    earlier = _earlier(plan.key, folder, cfg.profile_only)
    folder.mkdir(parents=True, exist_ok=True)
    points = plan.num_points(cfg.tp)
    runs = 0 if cfg.profile_only else len(cfg.thresholds)
    progress = Progress(plan.profile_units(cfg.tp) + plan.trajectory_units(runs), log)
    log(
        f"calibrating {plan.key.describe(cfg.tp)} into {folder}: {points} profile points, "
        f"{len(plan.prompts) if runs else 0} prompts x {runs} thresholds ({plan.source})"
    )
    worker = WorkerConfig(cfg.model, plan.engine, cfg.threads)
    entries, warnings = measure_profile(
        worker, cfg.tp, plan.grid, plan.mask_id, progress, plan.kinds
    )
    for text in warnings:
        log(f"warning: {text}")
    fitted = None if cfg.profile_only else _fit_predictor(cfg, plan, folder, progress)
    warnings += _predictor_warnings(fitted)
    if cfg.dws:
        _fit_dws_cost(cfg, plan.gen_len, folder, log)
    kept = [e for e in earlier[0] if e["tp"] not in set(cfg.tp)]
    notes = _kept_warnings(earlier[1], cfg)
    profile = _profile_file(plan.key, plan.engine, cfg.threads, kept + entries)
    write_json(folder / PROFILE_FILE, profile)
    tps = tuple(sorted({e["tp"] for e in profile["entries"]}))
    calibration = Calibration(folder, plan.key, tps, processor_name(), tuple(notes + warnings))
    calibration.save({"created": time.strftime("%Y-%m-%dT%H:%M:%S"), **_provenance(cfg)})
    _write_run(plan, folder, cfg, entries, fitted, warnings)
    error = f"; step predictor held-out error {fitted['errors']['full']:.1%}" if fitted else ""
    edits = (fitted or {}).get("edit_steps_per_block")
    error += f"; {edits:.2f} edit-only steps a block ({plan.editing})" if edits is not None else ""
    log(f"calibration written to {folder} (tp={','.join(map(str, tps))}){error}")
    for text in _predictor_warnings(fitted):
        log(f"warning: {text}")
        if cfg.strict:
            raise ValueError(f"--strict: {text}")
    return calibration


def _kept_warnings(earlier: tuple[str, ...], cfg: CalibrateConfig) -> list[str]:
    """An earlier calibration's warnings that still hold: those of the TP degrees not measured
    again, and, with `profile_only`, those of the step predictor it keeps."""
    measured = tuple(f"tp={tp} " for tp in cfg.tp)
    return [
        w
        for w in earlier
        if not w.startswith(measured) and (cfg.profile_only or w.startswith("tp="))
    ]


def _predictor_warnings(fitted: dict | None) -> list[str]:
    """A line when the step predictor's held-out error is implausibly high."""
    error = fitted["errors"]["full"] if fitted else 0.0
    if error <= MAX_PREDICTOR_ERROR:
        return []
    return [
        f"step predictor held-out error {error:.1%} is over {MAX_PREDICTOR_ERROR:.1%} (the "
        "paper's predictor from progress alone): its predictions say little; record more "
        "prompts (--num-prompts) or prompts like the served ones (--prompts)"
    ]


def _earlier(key: CalibrationKey, folder: Path, required: bool) -> tuple[list[dict], tuple]:
    """The profile entries and warnings of a calibration of the same key already in the folder
    (kept for the TP degrees not measured again); with `required`, there must be one."""
    try:
        found = Calibration.load(folder)
    except ValueError:
        found = None
    if found is None or not found.key.matches(key):
        if required:
            raise ValueError(
                f"--profile-only adds to a calibration of {key.describe()}, and "
                f"{folder} holds none: calibrate without --profile-only first"
            )
        return [], ()
    return json.loads(found.profile.read_text())["entries"], found.warnings


def _fit_predictor(cfg: CalibrateConfig, plan: Plan, folder: Path, progress) -> dict:
    """Trajectories at every candidate threshold on the engine (TP 1), and the predictor."""
    from dilaserve.engine.llm import LLM
    from dilaserve.training.train_predictor import PredictorConfig, fit_and_report
    from dilaserve.trajectory import save_trajectories

    with torch_threads(cfg.threads):
        llm = LLM(cfg.model, plan.engine)
        progress.untimed()
        trajs = _record(cfg, llm, plan, progress)
    save_trajectories(folder / "trajectories.npz", trajs)
    out = folder / PREDICTOR_DIR
    num = len(plan.prompts)
    predictor = PredictorConfig(cfg.model, str(out), num, cfg.thresholds, plan.gen_len)
    out.mkdir(exist_ok=True)
    return fit_and_report(trajs, predictor, out, lambda _: None, {"editing": plan.editing})


@contextmanager
def torch_threads(threads: int):
    """torch's intra-op threads set to `threads` inside the block, as a worker rank runs them
    (torch's default, one per core, is far slower on a CPU that others share)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fit_dws_cost(cfg: CalibrateConfig, gen_len: int, folder: Path, log) -> None:
    from dilaserve.dws.profile import DWSProfileConfig, profile_dws

    kernel = folder / DWS_COST_FILE
    dws = DWSProfileConfig(
        cfg.model,
        gen_len=gen_len,
        dtype=cfg.dtype,
        device=cfg.device,
        cuda_graphs=cfg.cuda_graphs,
        out=str(folder / "dws-runs"),
        kernel_out=str(kernel),
    )
    profile_dws(dws, log)


def _profile_file(key, engine, threads: int, entries: list[dict]) -> dict:
    import torch

    from dilaserve.control.profile import SCHEMA

    return {
        "schema": SCHEMA,
        "model": key.model,
        "device": key.device,
        "dtype": key.dtype,
        "block_len": engine.block_len,
        "threads": threads,
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
        "entries": entries,
    }


def profile_command(cfg: CalibrateConfig, out: str, profile_out: str | None, log=print) -> Path:
    """`dilaserve profile`: the latency profile alone, at every TP degree of `cfg.tp`, into a
    run folder (and `profile_out`)."""
    from dilaserve.cluster.worker import WorkerConfig

    plan = create_plan(cfg, with_prompts=False)
    progress = Progress(plan.profile_units(cfg.tp), log)
    worker = WorkerConfig(cfg.model, plan.engine, cfg.threads)
    entries, warnings = measure_profile(
        worker, cfg.tp, plan.grid, plan.mask_id, progress, plan.kinds
    )
    profile = _profile_file(plan.key, plan.engine, cfg.threads, entries)
    run = create_run_dir(out, "profile")
    write_json(run / "config.json", {**asdict(cfg), "environment": environment()})
    write_records(run / "records.csv", entries)
    write_json(run / "summary.json", {**profile, "warnings": warnings})
    target = Path(profile_out) if profile_out else run / "profile.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    write_json(target, profile)
    for text in warnings:
        log(f"warning: {text}")
    log(f"profile written to {target}; run folder: {run}")
    return target


def _provenance(cfg: CalibrateConfig) -> dict:
    return {"config": asdict(cfg), "environment": environment()}


def _write_run(plan: Plan, folder: Path, cfg, entries, fitted: dict | None, warnings) -> None:
    """The calibration folder is also the run folder: config, records, summary, report."""
    config = {**asdict(cfg), "prompts_source": plan.source, "environment": environment()}
    write_json(folder / "config.json", config)
    write_records(folder / "records.csv", entries)
    summary = {"profile_points": len(entries), "warnings": warnings}
    if fitted is not None:
        summary |= {
            "num_prompts": len(plan.prompts),
            "predictor_errors": fitted["errors"],
            "refresh_every_tokens": fitted["refresh_every_tokens"],
            "editing": plan.editing,
            "edit_steps_per_block": fitted.get("edit_steps_per_block"),
        }
    write_json(folder / "summary.json", summary)
    columns = ["tp", "kind", "num_requests", "batch_tokens", "ms", "spread"]
    notes = "\n".join(f"- {w}" for w in warnings) or "none"
    errors = fitted["errors"] if fitted else "kept from the earlier calibration (--profile-only)"
    (folder / "report.md").write_text(
        f"# calibration of {cfg.model} ({cfg.device}, {cfg.dtype})\n\n"
        f"## latency profile\n\n{markdown_table(entries, columns)}\n\n"
        f"## implausible measurements kept\n\n{notes}\n\n"
        f"## step predictor (held-out mean relative error)\n\n{errors}\n"
    )
