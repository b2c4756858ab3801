"""Carrying out a cluster reconfiguration, launch by launch, for either driver.

The planner's `Reconfiguration` is a list of launch steps, each "stop the instances in the way,
then start one instance". The steps run in order; a step that stops nothing starts at once, even
while earlier launches are still loading, and a step that stops instances waits until every
launch before it is up, so capacity is taken away one step at a time and only once what was
added is serving. Four TP-1 instances replacing a TP-4 then load together, and its GPUs idle
for one start-up rather than four (`Reconfiguration.serial`, from
`PlannerConfig.serial_launches`: every launch waits for the one before it, the paper's "one at
a time" read literally). Stopping an instance drains it (its waiting batch goes elsewhere, its
running step finishes, its requests move on at their next step) and removes it once idle.
`Rollout` keeps that progress; the driver does what it cannot (start a model, wait for it to
load, log) through three calls:

- `apply(decisions, now, event)`: carry out the scheduler's decisions;
- `start_instance(spec, now)`: begin loading an instance, then call `on_up(spec, now)` once it
  takes work (or `on_failed(instance_id, now)` if it dies while loading);
- `instance_removed(instance_id, now)` and `instance_added(spec, now)`: bookkeeping.

Pure: no clock, no I/O; the simulator and the cluster runtime share it, so reconfiguration
decisions are the same in both.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from dilaserve.control.decisions import Decisions, InstanceSpec, Reconfiguration, RolloutStep
from dilaserve.control.scheduler import Scheduler


class Driver(Protocol):
    def apply(self, decisions: Decisions, now: float, event: str) -> None: ...

    def start_instance(self, spec: InstanceSpec, now: float) -> None: ...

    def instance_added(self, spec: InstanceSpec, now: float) -> None: ...

    def instance_removed(self, instance_id: str, now: float) -> None: ...


class Rollout:
    def __init__(self, scheduler: Scheduler, driver: Driver, default_batch_tokens: int):
        self.scheduler = scheduler
        self.driver = driver
        self.default_batch_tokens = default_batch_tokens
        self._serial = False  # the plan in progress launches one instance at a time
        self.log: list[dict] = []  # one entry per reconfiguration begun
        self._steps: deque[RolloutStep] = deque()
        self._stop_after: tuple[str, ...] = ()
        self._blocked: set[str] = set()  # instances to remove before the next launch
        self._next_start: InstanceSpec | None = None
        self._starting: dict[str, InstanceSpec] = {}  # loading, by instance id

    @property
    def active(self) -> bool:
        return bool(
            self._steps
            or self._stop_after
            or self._blocked
            or self._next_start is not None
            or bool(self._starting)
        )

    def add(self, spec: InstanceSpec, now: float) -> None:
        """An instance that is up: the scheduler may give it work."""
        limit = spec.max_batch_tokens or self.default_batch_tokens
        self.scheduler.add_instance(spec.instance_id, spec.tp, limit, spec.node, spec.gpus)
        self.driver.instance_added(spec, now)

    def begin(self, plan: Reconfiguration, now: float) -> bool:
        """Start carrying out `plan`, unless one is in progress (the planner asks again).
        Returns whether a move began (a plan of batch limits alone sets them and moves nothing)."""
        if self.active:
            return False
        if plan.batch_limits is not None:
            self.scheduler.set_batch_limits(plan.batch_limits)
        if not plan.steps and not plan.stop_after:
            return False
        self.log.append({"time": now, "target": plan.target})
        self._steps = deque(plan.steps)
        self._stop_after = plan.stop_after
        self._serial = plan.serial
        self._advance(now)
        return True

    def replace(self, spec: InstanceSpec, now: float) -> None:
        """Start `spec` again (its instance failed), after whatever is in progress."""
        self._steps.append(RolloutStep((), spec))
        self._advance(now)

    def on_up(self, spec: InstanceSpec, now: float) -> None:
        self._starting.pop(spec.instance_id, None)
        self.add(spec, now)
        self.driver.apply(self.scheduler.on_tick(now), now, f"u{spec.instance_id}")
        self._advance(now)

    def on_step_done(self, instance_id: str, now: float) -> None:
        """After the scheduler has seen the step: a draining instance may now go."""
        if instance_id in self._blocked and self.scheduler.is_idle(instance_id):
            self._remove(instance_id, now)

    def on_failed(self, instance_id: str, now: float) -> None:
        """An instance died: its requests resume elsewhere; a plan waiting on it moves on."""
        if instance_id in self._starting:
            del self._starting[instance_id]
        elif instance_id in self.scheduler.instances:
            self._remove(instance_id, now, event="x")
            return
        self._advance(now)

    # -- progress ----------------------------------------------------------------------------

    def _remove(self, instance_id: str, now: float, event: str = "r") -> None:
        self._blocked.discard(instance_id)
        decisions = self.scheduler.remove_instance(instance_id, now)
        self.driver.instance_removed(instance_id, now)
        self.driver.apply(decisions, now, f"{event}{instance_id}")
        self._advance(now)

    def _stop_all(self, instance_ids, now: float) -> None:
        """Drain the instances, removing each once its running step is done."""
        live = [i for i in instance_ids if i in self.scheduler.instances]
        self._blocked.update(live)
        for instance_id in live:
            decisions = self.scheduler.drain_instance(instance_id, now)
            self.driver.apply(decisions, now, f"s{instance_id}")
        for instance_id in live:
            if instance_id in self._blocked and self.scheduler.is_idle(instance_id):
                self._remove(instance_id, now)

    def _advance(self, now: float) -> None:
        """Start every planned instance that may start now: in order, each once its GPUs are
        free, and one that needs instances stopped only once nothing before it is loading."""
        while not self._blocked:
            if self._next_start is None:
                if self._starting and (self._serial or (self._steps and self._steps[0].stop)):
                    return  # take nothing away while capacity is being added
                if not self._steps:
                    if not self._starting:
                        stops, self._stop_after = self._stop_after, ()
                        self._stop_all(stops, now)
                    return
                step = self._steps.popleft()
                self._next_start = step.start
                self._stop_all(step.stop, now)  # the last removal comes back here and launches
                continue
            spec, self._next_start = self._next_start, None
            self._starting[spec.instance_id] = spec
            self.driver.start_instance(spec, now)
