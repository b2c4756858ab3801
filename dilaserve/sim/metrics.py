"""What a run measured: per-request records, the summary, and the same per time interval.

SLO attainment counts a request as met when it finished by its deadline; requests still running
when the run ends count as missed. Latency is arrival to the last committed token; time to first
block is arrival to the first fully committed block (the first text a streaming user sees).
Quality is the quality model's accuracy at each request's token-weighted mean threshold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dilaserve.protocol import CACHED_KINDS
from dilaserve.request import Request


def request_records(
    finished: Sequence[Request], unfinished: Sequence[Request], quality: Callable | None
) -> list[dict]:
    rows = []
    for r in list(finished) + list(unfinished):
        done = r.finish_time is not None
        latency = r.finish_time - r.arrival_time if done else float("nan")
        threshold = r.mean_threshold
        rows.append(
            {
                "request_id": r.request_id,
                "arrival": round(r.arrival_time, 6),
                "prompt_tokens": r.prompt_len,
                "output_tokens": r.gen_len,
                "finished": done,
                "latency": round(latency, 6),
                "slo": round(r.deadline - r.arrival_time, 6),
                "met_slo": done and r.finish_time <= r.deadline + 1e-9,
                "first_block": round(r.first_block_time - r.arrival_time, 6)
                if r.first_block_time is not None
                else float("nan"),
                "steps": r.num_steps,
                # steps over the whole sequence (full, recompute, prefill); the rest ran blocks
                "sequence_steps": sum(
                    n for kind, n in r.steps_by_kind.items() if kind not in CACHED_KINDS
                ),
                "mean_threshold": round(threshold, 4),
                "quality": round(quality(threshold), 4) if quality else float("nan"),
            }
        )
    rows.sort(key=lambda row: (row["arrival"], row["request_id"]))
    return rows


def summarize(rows: Sequence[dict]) -> dict:
    if not rows:
        return {"requests": 0}
    latency = np.array([r["latency"] for r in rows if r["finished"]])
    first = np.array([r["first_block"] for r in rows if r["first_block"] == r["first_block"]])

    def pct(a: np.ndarray, q: float) -> float:
        return round(float(np.percentile(a, q)), 4) if a.size else float("nan")

    tokens = np.array([r["output_tokens"] for r in rows], dtype=np.float64)
    thresholds = np.array([r["mean_threshold"] for r in rows])
    quality = np.array([r["quality"] for r in rows])
    return {
        "requests": len(rows),
        "finished": int(sum(r["finished"] for r in rows)),
        "slo_attainment": round(float(np.mean([r["met_slo"] for r in rows])), 4),
        "latency_mean": round(float(latency.mean()), 4) if latency.size else float("nan"),
        "latency_p50": pct(latency, 50),
        "latency_p90": pct(latency, 90),
        "latency_p99": pct(latency, 99),
        "first_block_mean": round(float(first.mean()), 4) if first.size else float("nan"),
        "mean_threshold": round(float(np.average(thresholds, weights=tokens)), 4),
        "quality": round(float(np.mean(quality)), 4),
    }


def by_interval(rows: Sequence[dict], interval: float) -> list[dict]:
    """`summarize` over the requests arriving in each `interval`-second window."""
    if not rows:
        return []
    last = max(r["arrival"] for r in rows)
    out = []
    for k in range(int(last // interval) + 1):
        window = [r for r in rows if k * interval <= r["arrival"] < (k + 1) * interval]
        if window:
            out.append({"start": k * interval, **summarize(window)})
    return out


def instances_at(log: Sequence[tuple[float, dict[int, int]]], times: Sequence[float]) -> list:
    """Instances per TP degree in effect at each time (the log holds every change)."""
    out, i, current = [], 0, {}
    for t in times:
        while i < len(log) and log[i][0] <= t:
            current = log[i][1]
            i += 1
        out.append(dict(current))
    return out


def mean_queue(log: Sequence[tuple[float, int]], starts: Sequence[float], interval: float) -> list:
    """Mean number of requests waiting to be placed, sampled at ticks, per interval."""
    out = []
    for start in starts:
        window = [n for t, n in log if start <= t < start + interval]
        out.append(round(sum(window) / len(window), 2) if window else 0.0)
    return out
