"""Plots of a `dws.py` run folder: chat cost error and chat SJF latency, as PNGs.

    python benchmarks/dws_plots.py runs/dws-YYYYMMDD-HHMMSS [--docs docs/img]

Writes `chat_cost.png` (mean and median relative cost error per predictor, one panel per
profile) and `chat_sjf.png` (mean latency, time to first block p99 and the worst latency per
policy against the request rate) into the run folder, and copies them to `--docs`.
"""

from __future__ import annotations

import argparse
import csv
import shutil
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def plot_cost(folder: Path, plt) -> Path:
    rows = [r for r in _rows(folder / "chat_cost.csv") if r["mean_relative_error"]]
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    fig, axes = plt.subplots(1, len(profiles), figsize=(6 * len(profiles), 5), squeeze=False)
    for ax, profile in zip(axes[0], profiles):
        mine = [r for r in rows if r["profile"] == profile]
        names = [r["predictor"] for r in mine]
        y = range(len(mine))
        ax.barh(
            [i - 0.2 for i in y], [float(r["mean_relative_error"]) for r in mine], 0.4, label="mean"
        )
        ax.barh(
            [i + 0.2 for i in y],
            [float(r["median_relative_error"]) for r in mine],
            0.4,
            label="median",
        )
        ax.set_yticks(list(y), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("relative cost error (log scale)")
        ax.set_title(f"cost error on held-out ShareGPT prompts, {profile}")
        ax.legend()
    fig.tight_layout()
    out = folder / "chat_cost.png"
    fig.savefig(out, dpi=110)
    return out


def plot_sjf(folder: Path, plt) -> Path:
    rows = _rows(folder / "chat_sjf.csv")
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    metrics = (
        ("latency_mean", "mean latency (s)"),
        ("first_block_p99", "first block p99 (s)"),
        ("latency_max", "worst latency (s)"),
    )
    fig, axes = plt.subplots(1, len(metrics), figsize=(16, 4.5))
    for ax, (key, label) in zip(axes, metrics):
        for policy in policies:
            mine = [r for r in rows if r["policy"] == policy]
            ax.plot(
                [float(r["rps"]) for r in mine], [float(r[key]) for r in mine], "o-", label=policy
            )
        ax.set_xlabel("requests per second")
        ax.set_ylabel(label)
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle("ShareGPT first turns on one LLaDA-8B H200 instance (simulator)")
    fig.tight_layout()
    out = folder / "chat_sjf.png"
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--docs", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for plot in (plot_cost, plot_sjf):
        out = plot(args.folder, plt)
        target = args.docs / f"dws-{out.name}"
        shutil.copyfile(out, target)
        print(f"{out} -> {target}")


if __name__ == "__main__":
    main()
