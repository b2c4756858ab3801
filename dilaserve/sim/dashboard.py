"""A simulation run as the dashboard's data (`dashboard-data.js` in its run folder).

The run's events are replayed, in time order, into the same `Timeline` the live server feeds:
arrivals and finishes (requests in flight, attainment, latency, thresholds per step), the queue
the simulator sampled at every tick, the instance mix and the reconfigurations begun. Requests
still running when the run ended count as missed, at its end. The simulator keeps no per-step or
per-instance record, so the page's per-instance charts stay empty for a simulated run.
"""

from __future__ import annotations

import math
from pathlib import Path

from dilaserve.dashboard.page import write_data
from dilaserve.dashboard.timeline import Timeline

NICE_INTERVALS = (0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600)
TARGET_INTERVALS = 60  # about this many points across a run


def interval_for(duration: float) -> float:
    """A round interval that splits `duration` seconds into about `TARGET_INTERVALS`."""
    wanted = duration / TARGET_INTERVALS
    return next((s for s in NICE_INTERVALS if s >= wanted), NICE_INTERVALS[-1])


def run_data(run) -> dict:
    """The dashboard data of a `SimulationRun`."""
    result, end = run.result, run.result.end_time
    interval = interval_for(end)
    timeline = Timeline(interval, keep=math.ceil(end / interval) + 2)
    in_flight = queue = 0
    for now, kind, payload in _events(run):
        if kind == "arrival":
            in_flight += 1
        elif kind == "finish":
            in_flight -= 1
            _finish(timeline, now, payload)
        elif kind == "queue":
            queue = payload
        elif kind == "mix":
            timeline.set_tp_mix(now, payload)
        else:
            timeline.event(now, "reconfiguration", f"to {_mix_text(payload)}")
        timeline.sample(now, queue, in_flight)
    budget = run.summary.get("quality_budget")
    quality = None if budget is None else (run.summary["quality_loss_read"], budget)
    timeline.sample(end, queue, in_flight, None, run.summary.get("deadline_factor"), quality)
    for r in result.unfinished:  # still running at the end: missed
        timeline.request_done(end, None, False, r.priority, r.threshold_steps, 0)
    meta = {
        "source": "simulation",
        "title": f"dilaserve simulation: {run.spec.policy}",
        "model": run.spec.profile,
        "policy": run.spec.policy,
        "calibration": {"profile": run.spec.profile, "trace": run.spec.trace},
        "slo_s": round(run.slo, 4),
        "notes": ["the simulator keeps no per-step record: no per-instance charts"],
    }
    return timeline.to_json(end, meta)


def _events(run) -> list[tuple[float, str, object]]:
    """Everything the page shows, in time order (at equal times: the listed order)."""
    order = {"mix": 0, "reconfiguration": 1, "arrival": 2, "finish": 3, "queue": 4}
    result, events = run.result, []
    for r in result.requests + result.unfinished:
        events.append((r.arrival_time, "arrival", r))
        if r.finish_time is not None:
            events.append((r.finish_time, "finish", r))
    events += [(t, "queue", n) for t, n in result.queue_log]
    events += [(t, "mix", mix) for t, mix in result.instance_log]
    events += [(e["time"], "reconfiguration", e["target"]) for e in result.reconfigurations]
    events.sort(key=lambda e: (e[0], order[e[1]]))
    return events


def _finish(timeline: Timeline, now: float, r) -> None:
    met = r.finish_time <= r.deadline + 1e-9
    latency = r.finish_time - r.arrival_time
    timeline.request_done(now, latency, met, r.priority, r.threshold_steps, r.gen_len)


def _mix_text(by_tp: dict[int, int]) -> str:
    return ", ".join(f"{n} x TP-{tp}" for tp, n in sorted(by_tp.items())) or "no instance"


def write_dashboard(run, folder: str | Path) -> Path:
    """`folder`/dashboard-data.js: the run as the live page would show it, for the shared page
    (`dilaserve dashboard FOLDER` serves both)."""
    return write_data(run_data(run), folder)
