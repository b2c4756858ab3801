"""PNG plots of a simulation run, when matplotlib is installed (`pip install dilaserve[plots]`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_run(run, folder: Path) -> list[Path]:
    """Latency CDF; attainment and mean threshold per interval; instances and queue over time."""
    if not available():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    latency = np.sort([r["latency"] for r in run.rows if r["finished"]])
    ax = axes[0, 0]
    ax.plot(latency, np.arange(1, latency.size + 1) / max(latency.size, 1))
    ax.axvline(run.slo, color="red", linestyle="--", label=f"SLO {run.slo:.1f} s")
    ax.set(xlabel="latency (s)", ylabel="fraction of requests", title="latency CDF")
    ax.legend()
    starts = [row["start"] for row in run.intervals]
    ax = axes[0, 1]
    for key, label in (("slo_attainment", "SLO attainment"), ("mean_threshold", "mean threshold")):
        ax.plot(starts, [row[key] for row in run.intervals], marker="o", label=label)  # 1 row too
    ax.set(xlabel="arrival time (s)", ylim=(0, 1.05), title="per interval")
    ax.legend()
    ax = axes[1, 0]
    log = run.result.instance_log + run.result.instance_log[-1:]
    log[-1] = (run.result.end_time, log[-1][1])  # hold the last mix to the end
    for tp in sorted({tp for _, counts in log for tp in counts}):
        ax.step([t for t, _ in log], [c.get(tp, 0) for _, c in log], where="post", label=f"TP-{tp}")
    ax.set(xlabel="time (s)", ylabel="instances", title="instances per TP degree")
    ax.legend()
    ax = axes[1, 1]
    queue = run.result.queue_log
    ax.plot([t for t, _ in queue], [n for _, n in queue])
    ax.set(xlabel="time (s)", ylabel="requests", title="in flight, first step not yet run")
    spec = run.spec
    fig.suptitle(
        f"{spec.policy} on {spec.trace}, {spec.profile}, {spec.gpus} GPUs: "
        f"{run.summary['slo_attainment']:.1%} within SLO"
    )
    fig.tight_layout()
    path = folder / "run.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def bar_chart(
    rows: list[dict], x: str, ys: list[str], title: str, path: Path, ylabel: str = ""
) -> Path | None:
    """Grouped bars of `ys` columns for each row (ours beside the paper's, for instance); a
    missing value (None) leaves its bar out."""
    if not available() or not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    crowded = len(rows) > 6  # long label rows: a wider figure, labels slanted
    inches = max(7.0, 0.6 * len(rows) + 2)
    fig, ax = plt.subplots(figsize=(inches, 4.5 if crowded else 4))
    width = 0.8 / len(ys)
    for k, y in enumerate(ys):
        values = [float("nan") if r[y] is None else float(r[y]) for r in rows]
        ax.bar(np.arange(len(rows)) + k * width, values, width, label=y)
    ticks = np.arange(len(rows)) + width * (len(ys) - 1) / 2
    ax.set_xticks(ticks, [str(r[x]) for r in rows])
    if crowded:
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    ax.set(title=textwrap.fill(title, int(9 * inches)), ylabel=ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
