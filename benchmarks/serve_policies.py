"""Live serving experiment: the HTTP server under each policy, load swept upward.

    python benchmarks/serve_policies.py [--policies dilaserve,fcfs,infaas,llumnix]
        [--rates 20,30,40,50] [--seconds 30] [--slo-ms 300] [--layout 1,1] [--repeats 1]

For each policy, starts `dilaserve serve` (bundled model, local instances) in a subprocess,
waits for /health, then runs `dilaserve bench`'s load generator at each Poisson rate (chat
endpoint, held-out bundled-task problems, every request with the same SLO) and stops the
server. The baselines run at their fixed threshold 0.9. Writes a run folder: config, one row per
(policy, rate) with SLO attainment, latency, time to first text and accuracy, a report that
answers the issue's question (at the highest load where fcfs meets fewer than half its SLOs,
how many more does dilaserve meet, at what accuracy cost; reported at the first and at the
highest such load of the sweep), and plots.

Near the knee one run is one noisy sample: the policies share two cores with the load
generator, and a queue that builds in a run does not drain. `--repeats N` runs the whole sweep
N times (repeat r with trace seed `seed + r`, the policies in alternating order so that a slow
spell of the machine does not fall on one of them); the table and the verdict then use each
(policy, rate)'s mean, with the lowest and highest SLO attainment beside it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import subprocess
import sys
import time
from math import nan
from pathlib import Path

import httpx
from reliability_phases import metric_values

from dilaserve.bench.loadgen import BenchSpec, run_bench
from dilaserve.runs import create_run_dir, environment, markdown_table, write_json, write_records

COLUMNS = (
    "slo_attainment",
    "accuracy",
    "accuracy_answered",
    "latency_mean",
    "latency_p50",
    "latency_p99",
    "ttft_mean",
    "ok",
    "mean_threshold",  # the server's, over its steps at this rate (`/metrics`)
    "quality_loss",  # the quality budget's loss read at the rate's end (nan: no budget)
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(policy: str, port: int, options: list[str]) -> subprocess.Popen:
    """`dilaserve serve --policy POLICY --port PORT OPTIONS...`, once its /health answers."""
    command = [sys.executable, "-m", "dilaserve.cli", "serve", "--policy", policy]
    command += ["--port", str(port), *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"the {policy} server did not come up: {server.stderr.read()[-2000:]}")


def server_view(url: str) -> dict[str, float]:
    """What the server says of itself (`/metrics`): its step thresholds' sum and count, and
    its quality budget's loss (nan where it keeps none)."""
    values = metric_values(httpx.get(f"{url}/metrics", timeout=10).text)
    return {
        "sum": float(values.get("dilaserve_step_threshold_sum", 0.0)),
        "count": float(values.get("dilaserve_step_threshold_count", 0.0)),
        "quality_loss": float(values.get("dilaserve_quality_loss", nan)),
    }


def run_policy(policy: str, args, repeat: int = 0) -> list[dict]:
    port = free_port()
    options = ["--layout", args.layout, "--slo", str(args.slo_ms / 1000)]
    server = start_server(policy, port, options + args.server_args.split())
    rows = []
    try:
        for rate in args.rates:
            spec = BenchSpec(
                url=f"http://127.0.0.1:{port}",
                trace=f"poisson:{rate}:{args.seconds}",
                slo_ms=args.slo_ms,
                seed=args.seed + repeat,
            )
            before = server_view(spec.url)
            _, summary = run_bench(spec)
            after = server_view(spec.url)
            steps = max(after["count"] - before["count"], 1.0)
            summary["mean_threshold"] = round((after["sum"] - before["sum"]) / steps, 4)
            summary["quality_loss"] = round(after["quality_loss"], 5)
            row = {"policy": policy, "rps": rate, "repeat": repeat}
            row |= {c: summary[c] for c in COLUMNS}
            print(row, flush=True)
            rows.append(row)
    finally:
        server.terminate()
        server.wait(60)
    return rows


def mean_rows(rows: list[dict]) -> list[dict]:
    """One row per (policy, rate): the mean over repeats, with the SLO attainment's range."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["rps"]), []).append(r)
    out = []
    for (policy, rps), runs in groups.items():
        attainment = [r["slo_attainment"] for r in runs]
        row = {"policy": policy, "rps": rps, "runs": len(runs)}
        # (a column a run folder of before it lacks reads nan)
        row |= {c: round(sum(r.get(c, nan) for r in runs) / len(runs), 4) for c in COLUMNS}
        out.append(row | {"slo_min": min(attainment), "slo_max": max(attainment)})
    return out


def verdict(rows: list[dict]) -> dict:
    """The issue's comparison where fcfs meets fewer than half its SLOs: at the first such load
    of the sweep (the knee) and at the highest (where every policy may have collapsed)."""
    fcfs = {r["rps"]: r for r in rows if r["policy"] == "fcfs"}
    ours = {r["rps"]: r for r in rows if r["policy"] == "dilaserve"}
    loads = sorted(rps for rps, r in fcfs.items() if r["slo_attainment"] < 0.5 and rps in ours)
    if not loads:
        return {"note": "fcfs met at least half its SLOs at every load"}
    return {
        name: _compare(fcfs[rps], ours[rps])
        for name, rps in (("knee", loads[0]), ("highest", loads[-1]))
    }


def _compare(fcfs: dict, ours: dict) -> dict:
    return {
        "rps": fcfs["rps"],
        "fcfs_attainment": fcfs["slo_attainment"],
        "dilaserve_attainment": ours["slo_attainment"],
        "gain_points": round(100 * (ours["slo_attainment"] - fcfs["slo_attainment"]), 1),
        "fcfs_accuracy": fcfs["accuracy"],
        "dilaserve_accuracy": ours["accuracy"],
        "accuracy_cost_points": round(100 * (fcfs["accuracy"] - ours["accuracy"]), 1),
        # what the lower thresholds cost the answers given (refusals aside)
        "answered_accuracy_cost_points": round(
            100 * (fcfs["accuracy_answered"] - ours["accuracy_answered"]), 1
        ),
        "fcfs_answered": fcfs["ok"],
        "dilaserve_answered": ours["ok"],
    }


UNITS = {
    "slo_attainment": "share of requests within their SLO",
    "accuracy": "exact-match accuracy",
    "latency_p50": "median latency (s)",
    "ttft_mean": "mean time to first text (s)",
}


def plot(rows: list[dict], folder, title: str) -> list[str]:
    """One chart per metric: each policy's mean over the repeats against the offered load, the
    bars spanning the repeats' lowest to highest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for metric, unit in UNITS.items():
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for policy in dict.fromkeys(r["policy"] for r in rows):
            runs: dict[float, list[float]] = {}
            for r in rows:
                if r["policy"] == policy:
                    runs.setdefault(r["rps"], []).append(r[metric])
            rates = sorted(runs)
            mean = [sum(runs[x]) / len(runs[x]) for x in rates]
            low = [m - min(runs[x]) for m, x in zip(mean, rates)]
            high = [max(runs[x]) - m for m, x in zip(mean, rates)]
            ax.errorbar(rates, mean, yerr=[low, high], marker="o", capsize=3, label=policy)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(folder / f"{metric}.png", dpi=110)
        plt.close(fig)
        names.append(f"{metric}.png")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="dilaserve,fcfs,infaas,llumnix")
    parser.add_argument("--rates", default="20,30,40,50")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--slo-ms", type=float, default=300.0)
    parser.add_argument("--layout", default="1,1", help="TP degree of each instance")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="run the sweep this many times")
    parser.add_argument(
        "--server-args", default="", help="more `dilaserve serve` options, e.g. '--slo-headroom 1'"
    )
    parser.add_argument("--out", default="runs")
    parser.add_argument("--report-only", default=None, help="rebuild a run folder's report")
    args = parser.parse_args()
    if args.report_only:
        folder = Path(args.report_only)
        rows = [_typed(r) for r in csv.DictReader((folder / "records.csv").open())]
    else:
        args.rates = [float(r) for r in args.rates.split(",")]
        rows, policies = [], args.policies.split(",")
        for repeat in range(args.repeats):
            for policy in policies if repeat % 2 == 0 else policies[::-1]:
                rows += run_policy(policy, args, repeat)
        folder = create_run_dir(args.out, "serve-policies")
        write_json(folder / "config.json", {**vars(args), "environment": environment()})
        write_records(folder / "records.csv", rows)
    report(rows, folder)


def _typed(row: dict) -> dict:
    return {k: v if k == "policy" else float(v) for k, v in row.items()}


def report(rows: list[dict], folder: Path) -> None:
    means = mean_rows(rows)
    result = verdict(means)
    write_json(folder / "summary.json", {"verdict": result, "rows": means})
    table = markdown_table(means, ["policy", "rps", "runs", *COLUMNS, "slo_min", "slo_max"])
    lines = ["# live serving: policies under rising load", "", f"verdict: {result}", "", table]
    config = json.loads((folder / "config.json").read_text())
    layout = config.get("layout") or config.get("instances")
    repeats = max(int(r.get("repeat", 0)) for r in rows) + 1
    title = (
        f"{folder.name}\nbundled model, TP layout {layout}, SLO {config['slo_ms']:g} ms; "
        f"bars: range of {repeats} repeat(s)"
    )
    lines += [f"\n![{name}]({name})" for name in plot(rows, folder, title)]
    (folder / "report.md").write_text("\n".join(lines) + "\n")
    print(table)
    print(f"verdict: {result}")
    print(f"run folder: {folder}")


if __name__ == "__main__":
    main()
