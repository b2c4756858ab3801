"""What a running `Cluster` shows of itself (`runtime.py`): its load, the estimates admission
and Alg. 1 count on, the planner; the figures `/metrics`, the dashboard and the periodic log
line read, from any thread. A mixin over the cluster's `controller`, `scheduler` and `now`."""

from __future__ import annotations


class ClusterReadings:
    @property
    def in_flight(self) -> int:
        return len(self.controller.handles)

    def queue_length(self) -> int:
        """Requests waiting to be placed on an instance."""
        return len(self.controller.arrivals) + self.scheduler.num_waiting

    @property
    def step_slowdown(self) -> float:
        """Steps' measured time over the latency profile's, running and decaying toward 1 when
        no step reports (`control/speed.py`)."""
        return self.scheduler.speed.ratio

    @property
    def instances_stalled(self) -> int:
        """Instances whose running step is overdue: they take no new work until it ends."""
        return self.scheduler.num_stalled

    @property
    def step_slowdown_stale_seconds(self) -> float:
        """How long the slowdown has been decaying for want of steps (0: it is current)."""
        return self.scheduler.speed.stale_seconds()

    @property
    def slo(self) -> float:
        """The server's SLO, seconds: a request's that names none."""
        return self.scheduler.config.slo

    @property
    def on_time(self):
        """Admission's on-time calibration (`control/on_time.py`)."""
        return self.controller.admission.on_time

    @property
    def admission_capacity(self) -> tuple[float, float] | None:
        """Token-steps per second admission counts on (before its on-time factor), and load
        control's model of it alone (`control/admission.py`); None without load control."""
        admission = self.controller.admission
        if not admission.enabled:
            return None
        return admission.capacity(self.now()), admission.modelled_capacity()

    @property
    def admission_predicted(self) -> float:
        """Seconds admission predicted the latest request it priced needs (`Admission`)."""
        return self.controller.admission.predicted

    @property
    def admission_pace(self) -> float:
        """Seconds each request queued ahead of a newcomer delays its pricing (`gate.Pace`)."""
        return self.controller.admitting.pace.at(self.now())

    @property
    def on_time_factor(self) -> float:
        """How many times its predicted time admission allows a request now (>= 1)."""
        return self.on_time.factor(self.now())

    @property
    def deadline(self):
        """Alg. 1's on-time calibration (`control/on_time.py`), or None (the policy has none)."""
        return self.scheduler.deadline

    @property
    def quality_budget(self):
        """The policy's quality budget (`control/quality_budget.py`), or None (it has none)."""
        return self.scheduler.quality

    @property
    def planner(self):
        """The planner (`control/reconfigure.py`: its rounds, the start-up it prices), or None."""
        return self.scheduler.reconfigurer

    @property
    def deadline_factor(self) -> float | None:
        """How many times its estimated remaining time Alg. 1 prices a request at now."""
        return None if self.deadline is None else self.deadline.factor(self.now())

    @property
    def step_time_ratio(self) -> float:
        """Steps' measured time over the profile's, each summed over every step so far."""
        return self.scheduler.speed.run_ratio

    @property
    def step_time_ratio_by_batch(self) -> dict[int, float]:
        """`step_time_ratio` per batch size (`MeasuredSpeed.run_ratio_by_batch`)."""
        return self.scheduler.speed.run_ratio_by_batch()

    def instances_by_tp(self) -> dict[int, int]:
        return dict(self.controller.instance_log[-1][1]) if self.controller.instance_log else {}
