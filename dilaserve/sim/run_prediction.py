"""The simulator's prediction of a cluster run, from its own models (predictive fidelity).

Parity (`replay.py`) feeds the simulator a recorded run's step outcomes and durations, which
shows that the decision logic is the same, not that the simulator predicts. Here the simulator
gets only what it would have before the run: the same requests arriving at the same times with
the same SLOs, the cluster's control spec (its measured latency profile and step predictor),
and recorded engine trajectories of *other* prompts of the same model (`ReplayBehaviour`, each
request tied to a random recorded prompt); step durations come from the profile, times the
host's slowdown while serving (`slowdown`: measured beforehand by a calibration run, its
steps' round trips summed over their profile prices; it is what the profile misses on a
host whose cores the workers share with the controller, and the machine's drift since it was
profiled; or one slowdown per batch size, since on such a host it grows with the batch).
The control plane learns that slowdown as the cluster's does
(`measured_speed`, `control/speed.py`). Admission by capacity (`control/admission.py`) runs as
in the cluster: a request it refuses never runs and counts as missed. Its metrics, set beside
the real run's, measure how well the simulator predicts this machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from dilaserve.control.admission import LOWEST_PRIORITY, Admission
from dilaserve.control.build import ControlSpec, build_scheduler
from dilaserve.control.decisions import Decisions, InstanceSpec
from dilaserve.request import Request
from dilaserve.sim import metrics
from dilaserve.sim.behaviour import ReplayBehaviour
from dilaserve.sim.simulator import SimConfig, SimResult, Simulator
from dilaserve.trajectory import load_trajectories


class AdmittingScheduler:
    """A scheduler behind the cluster's admission control: `on_arrival` asks `Admission` first,
    and finished requests teach its on-time calibration; everything else is the scheduler's."""

    def __init__(self, scheduler, overload: str = "reject", time_model: str = "batched"):
        self.scheduler = scheduler
        self.admission = Admission(scheduler, overload, model=time_model)
        self.refused = 0

    def __getattr__(self, name: str):
        return getattr(self.scheduler, name)

    def on_arrival(self, request: Request, now: float) -> Decisions:
        refusal = self.admission.refusal(request, now)
        if refusal is not None and self.admission.mode == "reject":
            self.refused += 1
            return Decisions()
        if refusal is not None:
            request.priority = LOWEST_PRIORITY
        self.admission.admitted(request, now)
        return self._learn(self.scheduler.on_arrival(request, now), now)

    def on_step_done(self, instance_id: str, output, now: float) -> Decisions:
        return self._learn(self.scheduler.on_step_done(instance_id, output, now), now)

    def on_tick(self, now: float) -> Decisions:
        return self._learn(self.scheduler.on_tick(now), now)

    def _learn(self, decisions: Decisions, now: float) -> Decisions:
        """The requests that `decisions` finish teach admission's on-time calibration, as the
        cluster's controller does."""
        for rid in decisions.finished:
            self.admission.finished(rid, now)
        return decisions


def predict(
    requests: list[Request],
    control: ControlSpec,
    trajectories: str | Path,
    instances: list[InstanceSpec],
    tick: float,
    max_batch_tokens: int,
    seed: int = 0,
    overload: str = "reject",
    slowdown: float = 1.0,
    measured_speed: bool = False,
    slowdown_by_batch: Mapping[int, float] | None = None,
    admission_time: str = "batched",
) -> SimResult:
    """Simulate `requests` (as admitted: arrival and deadline on the run's clock) on the
    instances, the behaviour drawn from `trajectories`, each step `slowdown` times the
    profile's time, or, with `slowdown_by_batch` (`MeasuredSpeed.run_ratio_by_batch`), the
    slowdown of its batch size; `measured_speed` and `admission_time`: the cluster's
    (`ClusterConfig`)."""
    recorded = load_trajectories(trajectories)
    behaviour = ReplayBehaviour(recorded)
    windows = {t.gen_len for t in recorded}
    rng = np.random.default_rng(seed)
    fresh = [r.fresh() for r in requests]
    for r in fresh:
        if r.gen_len not in windows:
            raise ValueError(
                f"request {r.request_id}: its window of {r.gen_len} tokens has no recorded "
                f"trajectories in {trajectories} (windows {sorted(windows)})"
            )
        behaviour.assign(r.request_id, int(rng.choice(behaviour.prompts)))
    scheduler = AdmittingScheduler(build_scheduler(control), overload, admission_time)
    config = SimConfig(
        tick=tick,
        max_batch_tokens=max_batch_tokens,
        seed=seed,
        measured_speed=measured_speed,
        step_slowdown=slowdown,
        slowdown_by_batch=dict(slowdown_by_batch or {}),
    )
    return Simulator(scheduler, scheduler.profile, behaviour, instances, config).run(fresh)


def prediction_summary(result: SimResult) -> dict:
    """SLO attainment and latency of the prediction, as `run-trace` reports the real run."""
    rows = metrics.request_records(result.requests, result.unfinished, None)
    summary = metrics.summarize(rows)
    keep = ("requests", "slo_attainment", "latency_mean", "latency_p50", "latency_p99")
    return {k: summary[k] for k in keep if k in summary}
