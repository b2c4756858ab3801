"""`bench.png` of a load-generator run, when matplotlib is installed: the latency of every
answered request against when it was sent (those that missed their SLO marked), the requests
refused or failed as ticks on the time axis (they have no latency), and the latency CDF with the
SLO. With no request answered there is nothing to draw, and no figure. No server is contacted;
it reads the run's records."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from dilaserve.sim.plots import available


def is_answered(record: dict) -> bool:
    """Answered in full, with a latency (not refused, failed or broken off)."""
    latency = record.get("latency")
    ok = record["status"] == 200 and not record.get("error")
    return ok and latency is not None and not math.isnan(latency)


def plot_bench(records: list[dict], slo_s: float, title: str, folder: Path) -> Path | None:
    """The figure's path, or None: no matplotlib, or no request answered."""
    if not available() or not any(map(is_answered, records)):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (over_time, cdf) = plt.subplots(1, 2, figsize=(11, 3.8))
    done = [r for r in records if is_answered(r)]
    for met, colour, label in ((True, "tab:green", "within SLO"), (False, "tab:red", "missed")):
        mine = [r for r in done if bool(r["met_slo"]) == met]
        over_time.scatter(
            [r["arrival"] for r in mine], [r["latency"] for r in mine], s=6, c=colour, label=label
        )
    over_time.axhline(slo_s, color="tab:red", linestyle="--", linewidth=1)
    over_time.set(ylabel="latency (s)", title="each request")
    over_time.legend(fontsize=8)
    _refusal_strip(over_time, [r["arrival"] for r in records if not is_answered(r)])
    latency = np.sort([r["latency"] for r in done])
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


def _refusal_strip(over_time, failed: list[float]) -> None:
    """The requests without a latency, as ticks at their send time in a strip of their own
    under the latency panel (which then shares its time axis)."""
    from mpl_toolkits.axes_grid1 import make_axes_locatable

    if not failed:
        over_time.set_xlabel("sent at (s since start)")
        return
    strip = make_axes_locatable(over_time).append_axes("bottom", "14%", pad=0.08, sharex=over_time)
    strip.scatter(failed, [0.0] * len(failed), s=40, marker="|", c="k")
    strip.set_yticks([])
    strip.set_ylabel(f"no answer\n({len(failed)})", rotation=0, ha="right", va="center", fontsize=8)
    strip.set_xlabel("sent at (s since start)")
    over_time.tick_params(labelbottom=False)
