"""DWS evaluation: cost-prediction error against scalar proxies, and DWS-SJF against FCFS.

    python benchmarks/dws.py [--prompts 300] [--rates 20,40,60,80] [--chat-rates 1.0,1.5]
                             [--skip chat-cost,chat,latency,minilm,cost,sim,prior] [--live]
                             [--model FOLDER --labels NPZ --dws FOLDER --dws-cost JSON]

`--model` is the model the minilm, cost and sim parts judge on the bundled arithmetic task:
the bundled LLaDA (`tiny-llada`) by default, with its bundled DWS, kernel and labels; another
(e.g. the bundled block-diffusion `tiny-llada2`) names its own train-dws labels, DWS predictor
and `profile --dws` kernel, and its latency profile is read from its calibration folder
(`--profile` to choose another). The engine runs it in the cache mode its family resolves
(`block`, the exact cache, for LLaDA2), and the simulator replays its steps in that mode. The
chat parts model LLaDA-8B whatever `--model` is; prior and live serve the bundled model only.

0. On real prompts (`dws_chat.py`, needs the `dws` extra): ShareGPT first turns with their real
   answer lengths, DWS and the proxies with the packaged all-MiniLM-L6-v2 and with the hashed
   encoder: cost error with ceilings (`chat-cost`), SJF in the simulator (`chat`), and each
   predictor's latency per prompt (`latency`). `minilm` trains a MiniLM DWS on `--labels`,
   judged beside the `--dws` one by the cost and sim parts and used by the prior and live parts.

1. Cost prediction on held-out prompts of the bundled task. Each prompt runs alone (batch 1) on
   the engine at threshold 0.9; its measured ms is the truth. DWS predicts the cost from the
   prompt alone: the predictor's surface times the cost kernel, as is and with the kernel
   rescaled by one factor fitted on the calibration probes (this machine's speed today: the
   kernel's shape is kept, its scale follows the machine, as the proxies' linear fits do). The
   scalar proxies the paper compares against are trained on the same labels with the same
   encoder as each DWS predictor: predicted output length and predicted total steps, each mapped
   to ms by a linear fit on probes of training prompts; and a constant, the calibration
   probes' median ms, which knows nothing of the prompt. Two floors no prompt-only predictor can
   beat are reported beside them: the kernel applied to each run's true steps (a perfect
   surface; rescaled on the calibration probes' true steps), and a second timing of the same
   held-out runs (the measurement's own noise). Reported: mean relative error and MAE of each.
2. DWS-SJF against FCFS in the simulator: other held-out prompts' true steps per block, measured
   on the engine (`collect_labels`) and replayed (`BlockStepsBehaviour`), their DWS costs as the
   SJF order, the model's CPU latency profile, one TP-1 instance taking at most `--batch`
   requests per step, Poisson load swept upward. A last row, `oracle-sjf`, runs the same policy
   ordered by each request's true cost (its replayed steps priced by the profile at batch 1):
   the most any cost predictor could gain on this workload. Reported: mean and p99 latency and
   mean time to first block per policy and load, and each SJF's mean-latency ratio over FCFS.
3. The DWS step prior: `dilaserve` on an in-process cluster with and without DWS's expected
   steps as the step predictor's prior before the first step (SLO attainment).
4. With `--live`: DWS-SJF against FCFS on `dilaserve serve` (each variant's server up once,
   the load run A B C then C B A per rate).

Writes one run folder with every table and the report.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from dws_chat import _cached_minilm as _new_cached_minilm
from dws_chat import chat_cost, chat_sjf, encoder_latency
from sjf_sim import alone_ms, latency_row, simulate

from dilaserve.config import BUNDLED_DWS, BUNDLED_DWS_COST, BUNDLED_MODEL, BUNDLED_PROFILE
from dilaserve.protocol import block_offset
from dilaserve.runs import create_run_dir, environment, markdown_table, write_json, write_records

BUNDLED_LABELS = "docs/results/train-dws-20261129-161600/labels.npz"  # the bundled DWS's labels
# the parts that serve the bundled model (its step predictor, its server): not with --model
BUNDLED_ONLY = ("prior", "live")

GEN_LEN = 64


@dataclass
class Target:
    """The model the cost and sim parts judge (`--model`) and what DWS brings for it."""

    model: str
    llm: object  # its engine (`engine.llm.LLM`), for probes, prompt tokens and its cache mode
    labels: str  # the labels (`train-dws`'s labels.npz) DWS and the proxies trained on
    dws: dict[str, str]  # DWS predictor folders by encoder name
    kernel: str  # its cost kernel (`dilaserve profile --dws`)
    profile: str  # its latency profile, for the simulator

    @property
    def kv_cache(self):
        return self.llm.config.kv_cache  # as the model's family resolved it

    @property
    def aligned(self) -> bool:
        return self.llm.engine.family.is_block_causal  # blocks at absolute positions

    def offset(self, prompt_len: int) -> int:
        return block_offset(prompt_len, self.llm.config.block_len, self.aligned)


def target(args) -> Target:
    """The judged model and its DWS (made once, shared by the parts): the bundled LLaDA and its
    bundled predictor, kernel and labels by default; any other model names its own."""
    if getattr(args, "target", None) is None:
        from dilaserve.config import EngineConfig
        from dilaserve.engine.llm import LLM

        dws = {_encoder_name(args.dws): args.dws}
        if args.minilm_dws:  # given, or trained by the minilm part
            dws[_encoder_name(args.minilm_dws)] = args.minilm_dws
        llm = LLM(args.model, EngineConfig())
        args.target = Target(args.model, llm, args.labels, dws, args.dws_cost, args.profile)
    return args.target


@functools.cache
def _cached_minilm():
    """The packaged MiniLM encoder, memoised per text, one for the whole run (it is frozen)."""
    return _new_cached_minilm()


def _encoder_name(folder) -> str:
    encoder = json.loads((Path(folder) / "dws.json").read_text())["encoder"]
    return encoder.get("folder", encoder["kind"])  # MINILM's name, a folder, or "hashed"


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


def simulated_sjf(args, log) -> list[dict]:
    from dilaserve.control.profile import LatencyProfile
    from dilaserve.dws.estimate import DWSEstimator
    from dilaserve.dws.surface import collect_labels
    from dilaserve.tasks import arith

    t = target(args)
    texts = [p.question for p in arith.generate(args.prompts, seed=78, split="test")]
    labels = collect_labels(t.model, texts, GEN_LEN)  # measured: the engine's steps per block
    tokens = labels.prompt_tokens.tolist()
    profile = LatencyProfile.from_file(t.profile)
    true_costs = [
        alone_ms(profile, int(n) + GEN_LEN, steps, t.kv_cache, int(n))
        for n, steps in zip(labels.prompt_tokens, labels.steps)
    ]
    orders = {"fcfs": ("fcfs", true_costs)}  # FCFS ignores the costs
    for encoder, folder in t.dws.items():
        estimator = DWSEstimator.load(folder, t.kernel)
        costs = [c for c, _ in estimator.estimate(texts, tokens, GEN_LEN)]
        orders["dws-sjf" if len(t.dws) == 1 else f"dws-sjf, {encoder}"] = ("dws-sjf", costs)
    orders["oracle-sjf"] = ("dws-sjf", true_costs)
    rows = []
    for rate in args.rates:
        rng = np.random.default_rng(3)
        arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * args.seconds)))
        picks = rng.integers(0, len(texts), len(arrivals)).tolist()
        fcfs_mean = None  # fcfs runs first at each rate
        for name, (policy, order) in orders.items():
            done = _simulate_one(args, t, profile, labels, policy, order, arrivals.tolist(), picks)
            rows.append(latency_row(rate, name, done, fcfs_mean))
            fcfs_mean = fcfs_mean or rows[-1]["latency_mean"]
            log(rows[-1])
    return rows


def _simulate_one(args, t: Target, profile, labels, policy: str, costs, arrivals, picks) -> list:
    """One TP-1 instance under `policy`, requests ordered by `costs`: the finished requests."""
    from dilaserve.request import Request

    requests, steps = [], {}
    for i, (when, k) in enumerate(zip(arrivals, picks)):
        steps[f"r{i}"] = labels.steps[k]
        n = int(labels.prompt_tokens[k])
        offset = t.offset(n)
        requests.append(
            Request(
                f"r{i}", (3,) * n, GEN_LEN, 32, 1, 0.9, when, cost=costs[k], block_offset=offset
            )
        )
    return simulate(profile, policy, requests, steps, args.batch, t.kv_cache)


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
        {"encoder": f"{_encoder_name(args.dws)} (--dws)", **hashed},
        {"encoder": "all-MiniLM-L6-v2", **predictor.meta["validation"]},
    ]


def step_prior(args, log) -> list[dict]:
    from dilaserve.cluster.runtime import ClusterConfig
    from dilaserve.cluster.trace_run import TraceRunSpec, run_trace
    from dilaserve.cluster.worker import WorkerConfig
    from dilaserve.control.build import ControlSpec
    from dilaserve.control.decisions import SchedulerConfig

    priors = {"none": None, "hashed": str(BUNDLED_DWS)}
    if args.minilm_dws:
        priors["all-MiniLM-L6-v2"] = str(args.minilm_dws)
    rows = []
    names = list(priors)
    for run, name in enumerate(names + names[::-1]):  # A B C C B A: drift weighs alike
        dws = priors[name]
        config = ClusterConfig(
            WorkerConfig(threads=1),
            ControlSpec(scheduler=SchedulerConfig(slo=args.slo, refresh_every_tokens=2)),
            dws=dws,
            dws_cost=None if dws is None else str(BUNDLED_DWS_COST),
            dws_prior=dws is not None,
        )
        spec = TraceRunSpec(f"poisson:{args.prior_rps}:{args.seconds}", slo=args.slo)
        s = run_trace(config, spec)["summary"]
        keys = ("slo_attainment", "latency_mean", "mean_threshold", "accuracy")
        rows.append({"dws_prior": name, "pass": 1 + run // len(names), **{k: s[k] for k in keys}})
        log(rows[-1])
    return rows


def live_sjf(args, log) -> list[dict]:
    """Each variant's server started once; at each rate the load runs against them in the
    order A B C, then C B A, so that a machine whose background load drifts (a shared one)
    weighs on every variant alike. A row per (rate, variant, pass)."""
    import sys
    from contextlib import ExitStack

    from dilaserve.bench.loadgen import BenchSpec, run_bench

    sys.path.insert(0, "benchmarks")
    from serve_policies import free_port, start_server

    variants = [("fcfs", "fcfs", []), ("dws-sjf (hashed)", "dws-sjf", [])]
    if args.minilm_dws:
        variants.append(("dws-sjf (minilm)", "dws-sjf", ["--dws", str(args.minilm_dws)]))
    rows = []
    with ExitStack() as servers:
        ports = {}
        for name, policy, extra in variants:
            ports[name] = free_port()
            options = ["--instances", "1", "--max-batch-requests", str(args.batch), *extra]
            servers.callback(_stop, start_server(policy, ports[name], options))
        names = [v[0] for v in variants]
        for rate in args.live_rates:
            for run, name in enumerate(names + names[::-1]):
                trace = f"poisson:{rate}:{args.seconds}"
                url = f"http://127.0.0.1:{ports[name]}"
                _, s = run_bench(BenchSpec(url=url, trace=trace, slo_ms=1e6))
                keys = ("latency_mean", "latency_p99", "ttft_mean", "ttft_p99", "ok")
                row = {"rps": rate, "policy": name, "pass": 1 + run // len(names)}
                rows.append({**row, **{k: s.get(k) for k in keys}})
                log(rows[-1])
    return rows


def _stop(server) -> None:
    server.terminate()
    server.wait(60)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=str(BUNDLED_MODEL),
        help="the model the cost, sim and minilm parts judge (default: the bundled LLaDA); "
        "another needs --labels, --dws and --dws-cost",
    )
    parser.add_argument(
        "--labels", default=None, help=f"train-dws labels.npz (bundled: {BUNDLED_LABELS})"
    )
    parser.add_argument("--dws", default=None, help="its DWS predictor folder (train-dws --out)")
    parser.add_argument("--dws-cost", default=None, help="its cost kernel (profile --dws)")
    parser.add_argument(
        "--profile",
        default=None,
        help="its latency profile for the simulator (default: the model's "
        "dilaserve-calibration/cpu-float32/profile.json)",
    )
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--calibration", type=int, default=100)
    parser.add_argument("--rates", default="20,40,60,80")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--batch", type=int, default=4, help="requests per step batch")
    parser.add_argument("--slo", type=float, default=0.3)
    parser.add_argument("--prior-rps", type=float, default=44.0)
    parser.add_argument("--live", action="store_true")
    parser.add_argument(
        "--minilm-dws",
        default=None,
        help="a MiniLM DWS folder for the bundled model (else the minilm part trains one)",
    )
    parser.add_argument("--live-rates", default="10,20,30")
    parser.add_argument("--chat-rates", default="0.5,1,1.5,2")
    parser.add_argument("--chat-seconds", type=float, default=1200.0)
    parser.add_argument(
        "--skip", default="", help="parts to skip: chat-cost,chat,latency,minilm,cost,sim,prior"
    )
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    for name in ("rates", "live_rates", "chat_rates"):
        setattr(args, name, [float(r) for r in getattr(args, name).split(",")])
    bundled = Path(args.model).resolve() == BUNDLED_MODEL.resolve()
    if bundled:
        args.model = str(BUNDLED_MODEL)
        args.labels = args.labels or BUNDLED_LABELS
        args.dws = args.dws or str(BUNDLED_DWS)
        args.dws_cost = args.dws_cost or str(BUNDLED_DWS_COST)
    else:
        needed = {"--labels": args.labels, "--dws": args.dws, "--dws-cost": args.dws_cost}
        missing = [name for name, value in needed.items() if not value]
        if missing:
            parser.error(f"--model {args.model} needs {', '.join(missing)} (its own DWS)")
        running = [p for p in BUNDLED_ONLY if _runs(args, p)]
        if running:
            parser.error(f"parts {running} serve the bundled model only: --skip them")
    default_profile = Path(args.model) / "dilaserve-calibration" / "cpu-float32" / "profile.json"
    args.profile = args.profile or str(BUNDLED_PROFILE if bundled else default_profile)
    args.target = None
    return args


# the report's parts: (name, what runs it, its records file, its heading); `--skip NAME`
# leaves one out, and the live part runs only with `--live`
PARTS = (
    ("chat-cost", chat_cost, "chat_cost.csv", "Cost prediction on chat prompts"),
    ("chat", chat_sjf, "chat_sjf.csv", "SJF on chat prompts (simulator)"),
    ("latency", encoder_latency, "encoder_latency.csv", "Predictor latency per prompt"),
    ("minilm", minilm_dws, "minilm_dws.csv", "MiniLM DWS on the labels"),
    ("cost", cost_error, "cost_error.csv", "Cost prediction"),
    ("sim", simulated_sjf, "sim_sjf.csv", "DWS-SJF vs FCFS (simulator)"),
    ("prior", step_prior, "prior.csv", "The DWS step prior (live cluster)"),
    ("live", live_sjf, "live_sjf.csv", "DWS-SJF vs FCFS (live server)"),
)


def _runs(args, part: str) -> bool:
    """Whether `part` runs: not named in `--skip`; the live part only with `--live`."""
    return args.live if part == "live" else part not in args.skip.split(",")


def main() -> None:
    args = parse_args()
    folder = create_run_dir(args.out, "dws")
    args.folder = folder
    write_json(
        folder / "config.json",
        {**{k: v for k, v in vars(args).items() if k != "target"}, "environment": environment()},
    )
    lines, summary = ["# DWS evaluation", ""], {}
    for name, run, records, heading in PARTS:
        if not _runs(args, name):
            continue
        rows = run(args, print)
        lines += [f"## {heading}", ""]
        if isinstance(rows, tuple):  # the cost part also returns its summary
            rows, summary[name] = rows
            lines += [str(summary[name]), ""]
        write_records(folder / records, rows)
        lines += [markdown_table(rows, list(rows[0])), ""]
    write_json(folder / "summary.json", summary)
    (folder / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"run folder: {folder}")


if __name__ == "__main__":
    main()
