"""`bench.png` of a load-generator run, when matplotlib is installed: the latency of every
request against when it was sent (those that missed their SLO, and errors, marked), and the
latency CDF with the SLO. No server is contacted; it reads the run's records."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dilaserve.sim.plots import available


def plot_bench(records: list[dict], slo_s: float, title: str, folder: Path) -> Path | None:
    if not available() or not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (over_time, cdf) = plt.subplots(1, 2, figsize=(11, 3.8))
    answered = [r for r in records if r.get("latency") is not None and r["status"] == 200]
    for met, colour, label in ((True, "tab:green", "within SLO"), (False, "tab:red", "missed")):
        mine = [r for r in answered if bool(r["met_slo"]) == met]
        over_time.scatter(
            [r["arrival"] for r in mine], [r["latency"] for r in mine], s=6, c=colour, label=label
        )
    failed = [r["arrival"] for r in records if r["status"] != 200]
    if failed:
        over_time.scatter(failed, [0] * len(failed), s=10, marker="x", c="k", label="error / 4xx")
    over_time.axhline(slo_s, color="tab:red", linestyle="--", linewidth=1)
    over_time.set(xlabel="sent at (s since start)", ylabel="latency (s)", title="each request")
    over_time.legend(fontsize=8)
    latency = np.sort([r["latency"] for r in answered])
    cdf.plot(latency, np.arange(1, latency.size + 1) / max(len(records), 1))
    cdf.axvline(slo_s, color="tab:red", linestyle="--", label=f"SLO {slo_s:g} s")
    cdf.set(xlabel="latency (s)", ylabel="share of requests sent", title="latency CDF", ylim=(0, 1))
    cdf.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = folder / "bench.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
