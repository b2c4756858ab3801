"""DWS in scheduling: `dws.py`'s sim, prior and live parts (see its docstring and docs/dws/).

`simulated_sjf` replays the target's (`dws_target.py`) measured steps in the simulator, ordered
by each DWS predictor's costs, by none (FCFS) and by the true costs (`oracle-sjf`); `live_sjf`
runs DWS-SJF against FCFS on `dilaserve serve`; `step_prior` gives `dilaserve`'s step predictor
DWS's expected steps as its prior on an in-process cluster. The prior and live parts serve the
bundled model only. How well DWS predicts a cost is `dws_cost.py`'s.
"""

from __future__ import annotations

import numpy as np
from dws_target import GEN_LEN, Target, target
from sjf_sim import alone_ms, latency_row, simulate

from dilaserve.config import BUNDLED_DWS, BUNDLED_DWS_COST


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
