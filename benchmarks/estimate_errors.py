"""Where Alg. 1's point estimate is optimistic: one simulation, each request's first threshold
decision against what followed (issue 39 item 0; docs/control/thresholds.md, "Where the point
estimate misses").

At a request's first threshold selection Alg. 1 predicts its remaining time as predicted steps
(at the chosen threshold) x the profile's step seconds at its instance's batch then. Whatever
follows is split into the factors of that product and one the product leaves out:

- steps: steps it actually ran / steps predicted at the first chosen threshold (the predictor's
  error and every later re-selection together; `steps at first threshold` isolates the former
  for requests that kept their threshold);
- step time: mean seconds of the steps it ran / the predicted mean (the batch it actually
  shared, and the step kinds ahead);
- waiting: seconds between its steps (a finished step to its next launch), which the
  estimate leaves out.

Prints the quantiles of each ratio and of taken/predicted time, with the share of requests
late against their remaining budget.

    python benchmarks/estimate_errors.py --policy dilaserve --trace AZURE --duration 600 \
        --rate-scale 1.7
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

import numpy as np

from dilaserve.control import scheduler as scheduler_module
from dilaserve.control.thresholds import seconds_left
from dilaserve.sim.run import SimulationSpec, simulate

AZURE = "../shared/data/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv"


@dataclass
class Track:
    decided_at: float
    threshold: float
    predicted_steps: float
    predicted_seconds: float
    budget: float
    steps_at_threshold: int = 0  # steps run at the first chosen threshold
    steps: int = 0
    running: float = 0.0
    launched_at: float | None = None
    last_done: float | None = None
    waiting: float = 0.0
    finished_at: float | None = None
    thresholds: list[float] = field(default_factory=list)


def instrument(tracks: dict[str, Track]) -> None:
    """Wrap the scheduler's threshold choice, launches and step completions to fill `tracks`."""
    cls = scheduler_module.Scheduler
    choose, launch, done = cls._threshold, cls._launch, cls.on_step_done

    def _threshold(self, t, inst, now):
        fresh = t.needs_threshold and t.request.request_id not in tracks
        chosen = choose(self, t, inst, now)
        rid = t.request.request_id
        if fresh and self.policy.is_dynamic and self.load_control is not None:
            steps = self.load_control.steps_left(rid, [chosen])[0]
            seconds = tuple(s * self.speed.slowdown for s in inst.seconds_memo[1])
            predicted = seconds_left(steps, t.request.num_blocks_to_recompute, seconds)
            tracks[rid] = Track(now, chosen, steps, predicted, t.request.deadline - now)
        return chosen

    def _launch(self, now):
        launches = launch(self, now)
        for step in launches:
            for item in step.batch.items:
                tr = tracks.get(item.request_id)
                if tr is not None:
                    tr.launched_at = now
                    if tr.last_done is not None:
                        tr.waiting += now - tr.last_done
                    tr.thresholds.append(item.threshold)
        return launches

    def on_step_done(self, instance_id, output, now):
        for result in output.results:
            tr = tracks.get(result.request_id)
            if tr is None or tr.launched_at is None:
                continue
            tr.running += now - tr.launched_at
            tr.steps += 1
            tr.steps_at_threshold += tr.thresholds[-1] == tr.threshold
            tr.last_done, tr.launched_at = now, None
            if result.is_finished:
                tr.finished_at = now
        return done(self, instance_id, output, now)

    cls._threshold, cls._launch, cls.on_step_done = _threshold, _launch, on_step_done


def quantiles(values: np.ndarray) -> str:
    q = np.quantile(values, [0.05, 0.5, 0.95])
    return f"mean {values.mean():.2f}  p5 {q[0]:.2f}  p50 {q[1]:.2f}  p95 {q[2]:.2f}"


def report(tracks: dict[str, Track]) -> dict:
    done = [t for t in tracks.values() if t.finished_at is not None and t.steps > 0]
    taken = np.array([t.finished_at - t.decided_at for t in done])
    predicted = np.array([t.predicted_seconds for t in done])
    budget = np.array([t.budget for t in done])
    steps = np.array([t.steps / max(t.predicted_steps, 1e-9) for t in done])
    kept = [t for t in done if all(g == t.threshold for g in t.thresholds)]
    kept_steps = np.array([t.steps / max(t.predicted_steps, 1e-9) for t in kept])
    step_time = np.array(
        [(t.running / t.steps) / (t.predicted_seconds / max(t.predicted_steps, 1e-9)) for t in done]
    )
    waiting = np.array([t.waiting / (t.finished_at - t.decided_at) for t in done])
    fit = predicted <= budget
    rows = {
        "requests": len(done),
        "taken / predicted": quantiles(taken / predicted),
        "steps run / predicted": quantiles(steps),
        "steps / predicted (threshold kept)": quantiles(kept_steps) + f"  (n={len(kept)})",
        "step seconds / predicted": quantiles(step_time),
        "waiting share of time": quantiles(waiting),
        "predicted to fit": f"{fit.mean():.3f}",
        "late of those predicted to fit": f"{(taken[fit] > budget[fit]).mean():.3f}",
        "late of all": f"{(taken > budget).mean():.3f}",
    }
    for key, value in rows.items():
        print(f"{key:36s} {value}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="dilaserve")
    ap.add_argument("--trace", default=AZURE)
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--rate-scale", type=float, default=1.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--candidates", help="a dynamic policy's thresholds, e.g. 0.7,0.8,0.9")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    trace = AZURE if args.trace == "AZURE" else args.trace
    tracks: dict[str, Track] = {}
    instrument(tracks)
    spec = SimulationSpec(
        policy=args.policy,
        trace=trace,
        duration=args.duration,
        rate_scale=args.rate_scale,
        seed=args.seed,
        candidates=tuple(map(float, args.candidates.split(","))) if args.candidates else None,
    )
    run = simulate(spec)
    print(f"{args.policy}: attainment {run.summary['slo_attainment']:.3f}")
    rows = report(tracks)
    if args.json:
        with open(args.json, "w") as f:
            summary = {"attainment": run.summary["slo_attainment"], **rows}
            json.dump({"command": " ".join(sys.argv), "spec": vars(args), **summary}, f, indent=1)


if __name__ == "__main__":
    main()
