"""DWS evaluation: cost-prediction error against scalar proxies, and DWS-SJF against FCFS.

    python benchmarks/dws.py [--prompts 300] [--rates 20,40,60,80] [--chat-rates 1.0,1.5]
                             [--skip chat-cost,chat,latency,minilm,cost,sim,prior] [--live]

0. On real prompts (`dws_chat.py`, needs the `dws` extra): ShareGPT first turns with their real
   answer lengths, DWS and the proxies with the packaged all-MiniLM-L6-v2 and with the hashed
   encoder: cost error with ceilings (`chat-cost`), SJF in the simulator (`chat`), and each
   predictor's latency per prompt (`latency`). `minilm` trains a MiniLM DWS on the bundled
   labels, used beside the hashed one by the prior and live parts.

1. Cost prediction on held-out prompts of the bundled task. Each prompt runs alone (batch 1) on
   the engine at threshold 0.9; its measured ms is the truth. DWS predicts the cost from the
   prompt alone: the bundled predictor's surface times the bundled cost kernel, as is and with
   the kernel rescaled by one factor fitted on the calibration probes (this machine's speed
   today: the kernel's shape is kept, its scale follows the machine, as the proxies' linear
   fits do). The scalar proxies the paper compares against are trained on the same labels with
   the same encoder: predicted output length and predicted total steps, each mapped to ms by a
   linear fit on probes of training prompts. Two floors no prompt-only predictor can beat are
   reported beside them: the kernel applied to each run's true steps (a perfect surface), and a
   second timing of the same held-out runs (the measurement's own noise). Reported: mean
   relative error and MAE of each.
2. DWS-SJF against FCFS in the simulator: the held-out prompts' true steps per block replayed
   (`BlockStepsBehaviour`), their DWS costs as the SJF order, the bundled CPU latency profile,
   one TP-1 instance taking at most `--batch` requests per step, Poisson load swept upward.
   A third row, `oracle-sjf`, runs the same policy ordered by each request's true cost (its
   replayed steps priced by the profile at batch 1): the most any cost predictor could gain on
   this workload. Reported: mean and p99 latency and mean time to first block per policy and
   load, and each SJF's mean-latency ratio over FCFS.
3. The DWS step prior: `dilaserve` on an in-process cluster with and without DWS's expected
   steps as the step predictor's prior before the first step (SLO attainment).
4. With `--live`: DWS-SJF against FCFS on `dilaserve serve` (each variant's server up once,
   the load run A B C then C B A per rate).

Writes one run folder with every table and the report.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from dws_chat import chat_cost, chat_sjf, encoder_latency
from sjf_sim import alone_ms, latency_row, simulate

from dilaserve.config import BUNDLED_DWS, BUNDLED_DWS_COST, BUNDLED_MODEL
from dilaserve.runs import create_run_dir, environment, markdown_table, write_json, write_records

GEN_LEN = 64


def cost_error(args, log) -> tuple[list[dict], dict]:
    from dilaserve.config import EngineConfig
    from dilaserve.dws.cost import run_probes
    from dilaserve.dws.estimate import DWSEstimator
    from dilaserve.dws.train import Labels
    from dilaserve.engine.llm import LLM
    from dilaserve.tasks import arith

    llm = LLM(BUNDLED_MODEL, EngineConfig())
    held_out = [p.question for p in arith.generate(args.prompts, seed=77, split="test")]
    labels = Labels.load(args.labels)
    calibration = labels.texts[: args.calibration]
    log(f"probing {len(held_out)} held-out and {len(calibration)} calibration prompts")
    probes = _probes(llm, held_out, run_probes)
    truth = np.array([p.total_ms for p in probes])
    calib_truth = np.array([p.total_ms for p in _probes(llm, calibration, run_probes)])
    retimed = np.array([p.total_ms for p in _probes(llm, held_out, run_probes)])
    estimator = DWSEstimator.load(BUNDLED_DWS, BUNDLED_DWS_COST)
    tokens = [len(llm.encode_prompt(t, chat=True)) for t in held_out]
    start = time.perf_counter()
    dws = np.array([c for c, _ in estimator.estimate(held_out, tokens, GEN_LEN)])
    dws_ms = 1e3 * (time.perf_counter() - start) / len(held_out)
    calib_tokens = [len(llm.encode_prompt(t, chat=True)) for t in calibration]
    calib_dws = np.array([c for c, _ in estimator.estimate(calibration, calib_tokens, GEN_LEN)])
    scale = float(calib_truth @ calib_dws / (calib_dws @ calib_dws))  # this machine's ms now
    predictions = {
        "DWS (surface x kernel)": dws,
        "DWS, kernel rescaled on calibration": scale * dws,
        **_proxies(labels, calibration, calib_truth, held_out),
        "floor: true steps x kernel, rescaled": scale
        * np.array([estimator.kernel.cost_of_run(p) for p in probes]),
        "floor: a second timing of the same runs": retimed,
    }
    rows = [
        {
            "predictor": name,
            "mean_relative_error": round(float(np.mean(np.abs(p - truth) / truth)), 4),
            "mae_ms": round(float(np.mean(np.abs(p - truth))), 3),
        }
        for name, p in predictions.items()
    ]
    best_proxy = min(r["mean_relative_error"] for r in rows[2:4])
    summary = {
        "held_out_prompts": len(held_out),
        "true_ms_mean": round(float(truth.mean()), 3),
        "true_ms_cv": round(float(truth.std() / truth.mean()), 3),
        "dws_ms_per_prompt": round(dws_ms, 3),
        "kernel_rescale": round(scale, 4),
        "error_ratio_best_proxy_over_dws": round(best_proxy / rows[0]["mean_relative_error"], 3),
        "error_ratio_best_proxy_over_rescaled_dws": round(
            best_proxy / rows[1]["mean_relative_error"], 3
        ),
    }
    return rows, summary


def _proxies(labels, calibration, calib_truth, held_out) -> dict[str, np.ndarray]:
    """The scalar proxies' ms for the held-out prompts: each trained on the labels with the
    same encoder, then mapped to ms by a linear fit on the calibration probes."""
    from dilaserve.dws.train import DWSTrainConfig, split, train_scalar

    train, val = split(labels, 0.2, 5)
    out = {}
    for name, target in (
        ("predicted output length", lambda lab: lab.output_tokens),
        ("predicted total steps", lambda lab: lab.steps.sum(axis=1)),
    ):
        proxy = train_scalar(train, val, target, DWSTrainConfig())
        a, b = np.polyfit(proxy(calibration), calib_truth, 1)  # scalar -> ms
        out[name] = a * proxy(held_out) + b
    return out


def _probes(llm, texts, run_probes) -> list:
    prompts = [llm.encode_prompt(t, chat=True) for t in texts]
    return run_probes(llm, prompts, GEN_LEN, natural=True)


def simulated_sjf(args, log) -> list[dict]:
    from dilaserve.config import BUNDLED_PROFILE
    from dilaserve.control.profile import LatencyProfile
    from dilaserve.dws.estimate import DWSEstimator
    from dilaserve.dws.train import collect_labels
    from dilaserve.tasks import arith

    texts = [p.question for p in arith.generate(args.prompts, seed=78, split="test")]
    labels = collect_labels(BUNDLED_MODEL, texts, GEN_LEN)
    costs = [
        c
        for c, _ in DWSEstimator.load(BUNDLED_DWS, BUNDLED_DWS_COST).estimate(
            texts, labels.prompt_tokens.tolist(), GEN_LEN
        )
    ]
    profile = LatencyProfile.from_file(BUNDLED_PROFILE)
    true_costs = [
        alone_ms(profile, int(tokens) + GEN_LEN, steps)
        for tokens, steps in zip(labels.prompt_tokens, labels.steps)
    ]
    orders = {"fcfs": ("fcfs", costs), "dws-sjf": ("dws-sjf", costs)}
    orders["oracle-sjf"] = ("dws-sjf", true_costs)
    rows = []
    for rate in args.rates:
        rng = np.random.default_rng(3)
        arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * args.seconds)))
        picks = rng.integers(0, len(texts), len(arrivals)).tolist()
        fcfs_mean = None  # fcfs runs first at each rate
        for name, (policy, order) in orders.items():
            done = _simulate_one(args, profile, labels, policy, order, arrivals.tolist(), picks)
            rows.append(latency_row(rate, name, done, fcfs_mean))
            fcfs_mean = fcfs_mean or rows[-1]["latency_mean"]
            log(rows[-1])
    return rows


def _simulate_one(args, profile, labels, policy: str, costs, arrivals, picks) -> list:
    """One TP-1 instance under `policy`, requests ordered by `costs`: the finished requests."""
    from dilaserve.request import Request

    requests, steps = [], {}
    for i, (t, k) in enumerate(zip(arrivals, picks)):
        steps[f"r{i}"] = labels.steps[k]
        prompt = (3,) * int(labels.prompt_tokens[k])
        requests.append(Request(f"r{i}", prompt, GEN_LEN, 32, 1, 0.9, t, cost=costs[k]))
    return simulate(profile, policy, requests, steps, args.batch)


def bundled_minilm(args, log) -> list[dict]:
    """DWS with the packaged MiniLM encoder on the bundled task's labels (the hashed bundled
    predictor's labels and split), saved and exported into the run folder for the cost and
    prior parts: its validation error beside the bundled hashed predictor's."""
    from dilaserve.dws.encoders import MINILM
    from dilaserve.dws.model import DWSPredictor
    from dilaserve.dws.onnx_export import export_onnx
    from dilaserve.dws.train import DWSTrainConfig, Labels, split, train_dws

    train, val = split(Labels.load(args.labels), 0.2, 5)  # as train-dws split them
    predictor = train_dws(train, val, DWSTrainConfig(encoder=MINILM), log)
    args.minilm_dws = args.folder / "dws-bundled-minilm"
    predictor.save(args.minilm_dws)
    export_onnx(predictor, args.minilm_dws)
    hashed = DWSPredictor.load(BUNDLED_DWS).meta["validation"]
    return [
        {"encoder": "hashed (bundled)", **hashed},
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


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--calibration", type=int, default=100)
    parser.add_argument("--labels", default="docs/results/train-dws-20261129-161600/labels.npz")
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
    args = parser.parse_args()
    for name in ("rates", "live_rates", "chat_rates"):
        setattr(args, name, [float(r) for r in getattr(args, name).split(",")])
    return args


# the report's parts: (name, what runs it, its records file, its heading); `--skip NAME`
# leaves one out, and the live part runs only with `--live`
PARTS = (
    ("chat-cost", chat_cost, "chat_cost.csv", "Cost prediction on chat prompts"),
    ("chat", chat_sjf, "chat_sjf.csv", "SJF on chat prompts (simulator)"),
    ("latency", encoder_latency, "encoder_latency.csv", "Predictor latency per prompt"),
    ("minilm", bundled_minilm, "bundled_minilm.csv", "MiniLM DWS on the bundled task"),
    ("cost", cost_error, "cost_error.csv", "Cost prediction"),
    ("sim", simulated_sjf, "sim_sjf.csv", "DWS-SJF vs FCFS (simulator)"),
    ("prior", step_prior, "prior.csv", "The DWS step prior (live cluster)"),
    ("live", live_sjf, "live_sjf.csv", "DWS-SJF vs FCFS (live server)"),
)


def main() -> None:
    args = parse_args()
    folder = create_run_dir(args.out, "dws")
    args.folder = folder
    write_json(folder / "config.json", {**vars(args), "environment": environment()})
    lines, summary = ["# DWS evaluation", ""], {}
    for name, run, records, heading in PARTS:
        if (not args.live) if name == "live" else name in args.skip.split(","):
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
