"""Two code versions' engine benchmarks side by side: median steps/s per configuration.

    python benchmarks/engine_compare.py --before RUN,RUN,... --after RUN,RUN,...

Each RUN is a run folder of `benchmarks/engine.py` (its summary.json); run the two versions
back to back, alternating, several times each (a shared machine's load moves between runs), and
give the folders here. For every (model, kv_cache, prompt, batch) found in both, the median
steps/s of each side (per wall second and, where recorded, per second of the process's CPU
time) and the after/before ratios, and the median CPU ms of a step run wholly against the
cache. Writes a run folder (summary, report) under `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from dilaserve.runs import create_run_dir, markdown_table, write_json

KEY = ("model", "kv_cache", "prompt_len", "batch")


def medians(runs: list[str]) -> dict[tuple, dict]:
    """Per configuration, the median steps/s and ms per step over the runs."""
    seen: dict[tuple, list[dict]] = {}
    for run in runs:
        summary = json.loads((Path(run) / "summary.json").read_text())
        for record in summary["records"]:
            seen.setdefault(tuple(record.get(k, "tiny-llada") for k in KEY), []).append(record)
    return {
        key: {
            "runs": len(records),
            "steps_per_s": statistics.median(r["steps"] / r["seconds"] for r in records),
            "steps_per_cpu_s": statistics.median(r.get("steps_per_cpu_s", 0) for r in records),
            "cache_step_cpu_ms": _median([r.get("cache_step_cpu_ms") for r in records]),
        }
        for key, records in seen.items()
    }


def compare(before: dict, after: dict) -> list[dict]:
    rows = []
    for key in sorted(before.keys() & after.keys()):
        b, a = before[key], after[key]
        rows.append(
            {
                **dict(zip(KEY, key)),
                "runs": f"{b['runs']}/{a['runs']}",
                "before_steps_per_s": round(b["steps_per_s"], 2),
                "after_steps_per_s": round(a["steps_per_s"], 2),
                "speedup": round(a["steps_per_s"] / b["steps_per_s"], 2),
                "before_steps_per_cpu_s": b["steps_per_cpu_s"],
                "after_steps_per_cpu_s": a["steps_per_cpu_s"],
                "cpu_speedup": _ratio(a["steps_per_cpu_s"], b["steps_per_cpu_s"]),
                "before_cache_step_cpu_ms": b["cache_step_cpu_ms"],
                "after_cache_step_cpu_ms": a["cache_step_cpu_ms"],
            }
        )
    return rows


def _median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 2) if known else None


def _ratio(after: float, before: float) -> float | None:
    return round(after / before, 2) if before and after else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", required=True, help="engine.py run folders, comma-separated")
    ap.add_argument("--after", required=True, help="engine.py run folders, comma-separated")
    ap.add_argument("--out", default="runs")
    args = ap.parse_args()
    before, after = args.before.split(","), args.after.split(",")
    rows = compare(medians(before), medians(after))
    if not rows:
        raise SystemExit("no configuration appears in both --before and --after runs")
    run = create_run_dir(args.out, "engine_compare")
    write_json(run / "summary.json", {"before": before, "after": after, "rows": rows})
    report = markdown_table(rows, list(rows[0]))
    (run / "report.md").write_text(f"# engine benchmark, before and after\n\n{report}\n")
    print(report)
    print(f"run folder: {run}")


if __name__ == "__main__":
    main()
