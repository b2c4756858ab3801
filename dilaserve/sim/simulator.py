"""The discrete-event simulator: a virtual clock driving the unchanged control plane.

Events, in time order (ties in the order they were scheduled): request arrivals, step
completions on each instance, scheduler ticks, and instances coming up after their start-up
delay. Each goes to the `Scheduler`'s event API; its decisions come back as step launches, whose
duration comes from the latency profile (the same table the scheduler predicts with, optionally
with noise) and whose outcome comes from a behaviour model (`sim.behaviour`), and as cluster
reconfigurations, carried out by the same `Rollout` as the cluster runtime: before each launch the
instances in the way are drained and removed, then the new instance loads for `startup_delay`
seconds before it takes work.

Nothing here reads a clock or draws a random number outside the seeded generators, so the same
inputs give the same decisions; `SimResult.decision_digest` fingerprints every decision
(`DecisionLog`). A `durations` callable may replace the latency profile, and a recorded
behaviour the parametric one: fed a cluster run's recorded step outcomes and durations, the
simulator makes that run's decisions (`sim.replay`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dilaserve.control.decision_log import DecisionLog
from dilaserve.control.decisions import Decisions, InstanceSpec
from dilaserve.control.profile import LatencyProfile
from dilaserve.control.rollout import Rollout
from dilaserve.control.speed import batch_bin, batch_seconds
from dilaserve.protocol import StepBatch, StepOutput
from dilaserve.request import Request

ARRIVAL, STEP_DONE, TICK, INSTANCE_UP = range(4)


@dataclass(frozen=True, slots=True)
class SimConfig:
    tick: float = 1.0  # seconds between scheduler ticks (deferred retries, planner rounds)
    startup_delay: float = 30.0  # seconds a new instance loads before it takes work
    latency_noise: float = 0.0  # sigma of a log-normal factor on each step's duration
    max_batch_tokens: int = 65536  # for instances the planner starts without a batch size
    seed: int = 0
    measured_speed: bool = False  # report step durations to the scheduler's measured speed
    # (`control/speed.py`), as the cluster runtime does (replay: its durations are measured)
    # every step takes the latency model's time times this: a host's measured slowdown while
    # serving (its drift since it was profiled, the controller's share of shared cores), for a
    # prediction of that host (`sim/run_prediction.py`; a calibration run's `step_time_ratio`)
    step_slowdown: float = 1.0
    # batch_bin -> the slowdown of a step of that many requests instead (`run_ratio_by_batch`;
    # bins it lacks take `step_slowdown`)
    slowdown_by_batch: Mapping[int, float] = field(default_factory=dict)
    # instance id -> a further factor on its steps' time (stragglers the control plane is not
    # told about; `SimulationSpec.stragglers`)
    instance_slowdown: Mapping[str, float] = field(default_factory=dict)
    slowdown_from: float = 0.0  # the simulated second `instance_slowdown` starts to apply
    # (seconds, ring): every `seconds` after `slowdown_from` each instance's slowdown passes
    # to the instance len(instance_slowdown) places on in `ring` (the starting instances, in
    # order; around it); (0, ()): it stays
    slowdown_moves: tuple[float, tuple[str, ...]] = (0.0, ())

    def __post_init__(self):
        if self.tick <= 0 or self.startup_delay < 0 or self.latency_noise < 0:
            raise ValueError(f"{self}: tick must be positive, delays and noise non-negative")
        if self.step_slowdown <= 0 or min(self.slowdown_by_batch.values(), default=1.0) <= 0:
            raise ValueError(f"{self.step_slowdown=}, {self.slowdown_by_batch=}: must be > 0")


@dataclass
class SimResult:
    requests: list[Request]  # finished ones, with their timing and thresholds
    unfinished: list[Request]
    instance_log: list[tuple[float, dict[int, int]]]  # (time, instances per TP degree)
    queue_log: list[tuple[float, int]]  # (time, requests admitted whose first step has not run)
    decision_digest: str
    events: int
    end_time: float
    reconfigurations: list[dict] = field(default_factory=list)
    # releases: a request's state dropped where it was because it moved on (migrations, as the
    # cluster runtime counts them, `cluster/controller.py`), or after a failed step
    migrations: int = 0


class Simulator:
    def __init__(
        self,
        scheduler: Any,  # a Scheduler, or one behind admission control (`sim/run_prediction.py`)
        profile: LatencyProfile,
        behaviour,
        instances: list[InstanceSpec],
        config: SimConfig = SimConfig(),
        durations: Callable[[str, StepBatch, float], float] | None = None,
        log: DecisionLog | None = None,
        unmeasured: Collection[tuple[str, float]] = (),
    ):
        self.scheduler = scheduler
        self.profile = profile
        self.behaviour = behaviour
        self.config = config
        self._costs = scheduler.config.costs  # (a property that builds one: read once)
        self.durations = durations or self._profile_duration
        # (instance, launched at) of steps the measured speed does not learn (a replay: those a
        # stall of the cluster's controller held up, `cluster/stalls.py`)
        self.unmeasured = frozenset(unmeasured)
        self.log = log or DecisionLog()
        self.rng = np.random.default_rng(config.seed)
        self.rollout = Rollout(scheduler, self, config.max_batch_tokens)
        self._heap: list = []
        self._seq = 0
        self._releases = 0
        # instance -> (batch, seconds, launched at)
        self._running: dict[str, tuple[StepBatch, float, float]] = {}
        self._done: list[Request] = []
        self.instance_log: list[tuple[float, dict[int, int]]] = []
        self.queue_log: list[tuple[float, int]] = []
        for spec in instances:
            self.rollout.add(spec, 0.0)

    # -- the event loop ----------------------------------------------------------------------

    def _push(self, time: float, kind: int, payload) -> None:
        heapq.heappush(self._heap, (time, self._seq, kind, payload))
        self._seq += 1

    def run(self, requests: list[Request], until: float | None = None, progress=None) -> SimResult:
        self._unfinished = {r.request_id: r for r in requests}
        arrivals = iter(sorted(requests, key=lambda r: (r.arrival_time, r.request_id)))
        pending = next(arrivals, None)
        if pending is not None:
            self._push(pending.arrival_time, ARRIVAL, pending)
        self._push(self.config.tick, TICK, None)
        events, now = 0, 0.0
        total = len(requests)
        while self._heap:
            now, _, kind, payload = heapq.heappop(self._heap)
            if until is not None and now > until:
                break
            events += 1
            if kind == ARRIVAL:
                self.apply(self.scheduler.on_arrival(payload, now), now, f"a{payload.request_id}")
                pending = next(arrivals, None)
                if pending is not None:
                    self._push(pending.arrival_time, ARRIVAL, pending)
            elif kind == STEP_DONE:
                self._step_done(payload, now)
            elif kind == TICK:
                self.queue_log.append((now, self._not_started()))
                self.apply(self.scheduler.on_tick(now), now, "t")
                if progress is not None:
                    progress(now, len(self._done), total)
                if pending is not None or self.scheduler.requests or self.rollout.active:
                    self._push(now + self.config.tick, TICK, None)
            else:  # INSTANCE_UP
                self.rollout.on_up(payload, now)
        return SimResult(
            self._done,
            list(self._unfinished.values()),
            self.instance_log,
            self.queue_log,
            self.log.digest,
            events,
            now,
            self.rollout.log,
            self._releases,
        )

    def _step_done(self, instance_id: str, now: float) -> None:
        batch, seconds, launched = self._running.pop(instance_id)
        requests = self.scheduler.requests
        if self.config.measured_speed and (instance_id, launched) not in self.unmeasured:
            tp = self.scheduler.instances[instance_id].tp
            self.scheduler.speed.observe(tp, batch, seconds, instance_id, now)
        results = tuple(
            self.behaviour.step(requests[i.request_id].request, i.threshold, i.kind)
            for i in batch.items
        )
        output = StepOutput(results, 0)
        self.apply(self.scheduler.on_step_done(instance_id, output, now), now, f"d{instance_id}")
        self.rollout.on_step_done(instance_id, now)

    # -- the driver's side of the control plane (also what `Rollout` calls) ------------------

    def apply(self, d: Decisions, now: float, event: str) -> None:
        self.log.record(now, event, d)
        self._releases += len(d.releases)
        for launch in d.launches:
            seconds = self.durations(launch.instance_id, launch.batch, now)
            self._running[launch.instance_id] = (launch.batch, seconds, now)
            self._push(now + seconds, STEP_DONE, launch.instance_id)
        for rid in d.finished:
            self._finish(rid)
        if d.reconfiguration is not None:
            self.rollout.begin(d.reconfiguration, now)

    def start_instance(self, spec: InstanceSpec, now: float) -> None:
        self._push(now + self.config.startup_delay, INSTANCE_UP, spec)

    def instance_added(self, spec: InstanceSpec, now: float) -> None:
        self._log_instances(now)

    def instance_removed(self, instance_id: str, now: float) -> None:
        self._log_instances(now)

    def _finish(self, rid: str) -> None:
        forget = getattr(self.behaviour, "forget", None)
        if forget is not None:
            forget(rid)
        self._done.append(self._unfinished.pop(rid))  # the request object carries the record

    def _profile_duration(self, instance_id: str, batch: StepBatch, now: float) -> float:
        """The profile's latency of the batch, as the scheduler prices it, times the host's
        slowdown (with noise)."""
        tp = self.scheduler.instances[instance_id].tp
        seconds = batch_seconds(self.profile, tp, batch, self._costs, self.scheduler.requests)
        slowdown = self.config.step_slowdown
        if self.config.slowdown_by_batch:
            bin_ = batch_bin(len(batch.items))
            slowdown = self.config.slowdown_by_batch.get(bin_, slowdown)
        if now >= self.config.slowdown_from:
            slowdown *= self._straggling(instance_id, now)
        seconds *= slowdown
        if self.config.latency_noise:
            seconds *= float(self.rng.lognormal(0.0, self.config.latency_noise))
        return seconds

    def _straggling(self, instance_id: str, now: float) -> float:
        """The further factor on the instance's steps at `now` (`SimConfig.instance_slowdown`,
        moved on `slowdown_moves`' turns since `slowdown_from`)."""
        period, ring = self.config.slowdown_moves
        slow = self.config.instance_slowdown
        if not period:
            return slow.get(instance_id, 1.0)
        if instance_id not in ring:
            return 1.0  # (started later, by a reconfiguration: never slowed)
        turn = int((now - self.config.slowdown_from) // period)
        return slow.get(ring[(ring.index(instance_id) - turn * len(slow)) % len(ring)], 1.0)

    def _not_started(self) -> int:
        """Requests in flight that have not run a step: queued, or gathered for a batch that
        has not started (placement gathers at once, so few wait to be placed as such)."""
        return sum(1 for t in self.scheduler.requests.values() if not t.request.num_steps)

    def _log_instances(self, now: float) -> None:
        self.instance_log.append((now, self.scheduler.instances_by_tp()))
