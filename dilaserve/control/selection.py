"""Threshold selection (Algorithm 1/5) for a request placed on an instance.

Within the thresholds load control allows (`load_control.py`) and the request accepts, the
highest whose remaining time fits the budget left: predicted steps at each threshold times the
step seconds of the instance as the request's later steps will find it (everything assigned
there, at the measured speed, `speed.py`), fitted into `slo_headroom` of the budget left (the
policy's, else the config's: 1.0, the paper's rule). With an on-time target
(`Policy.on_time_target`, the default policy's) the remaining time is priced at the calibrated
quantile of taken over estimated time (`on_time.py`), and each request's first estimate joins
the calibration; the scheduler reports when it finishes or goes. With a quality budget
(`Policy.quality_budget`, the default policy's) no request is given a threshold below the
budget's floor (`quality_budget.py`), which finished requests' thresholds move.
"""

from __future__ import annotations

from dilaserve.control.decisions import SchedulerConfig
from dilaserve.control.instance import InstanceState
from dilaserve.control.on_time import OnTimeCalibration
from dilaserve.control.policy import LoadEstimate, Policy
from dilaserve.control.profile import LatencyProfile
from dilaserve.control.quality_budget import QualityBudget
from dilaserve.control.speed import MeasuredSpeed
from dilaserve.control.thresholds import InstanceLoad, highest_fitting, seconds_left, step_seconds
from dilaserve.protocol import StepKind
from dilaserve.request import Request


class ThresholdSelection:
    def __init__(
        self,
        policy: Policy,
        profile: LatencyProfile,
        config: SchedulerConfig,  # its costs, Alg. 1's share of the budget, the quality curve
        speed: MeasuredSpeed,
        load_control,  # LoadControl, or None for a fixed-threshold policy
    ):
        self.policy = policy
        self.profile = profile
        self._costs = config.costs
        self._headroom = policy.slo_headroom or config.slo_headroom
        self.speed = speed
        self.load_control = load_control
        # Alg. 1 at a quantile of taken over estimated time, learned from finished requests
        self.deadline = (
            OnTimeCalibration(policy.on_time_target)
            if policy.on_time_target is not None and policy.is_dynamic
            else None
        )
        if load_control is not None and policy.load_estimate is LoadEstimate.QUANTILE:
            load_control.calibration = self.deadline  # Alg. 2/4 prices work at its quantile
        self.quality = None  # the policy's quality budget, kept on finished requests
        if policy.quality_budget is not None and policy.is_dynamic:
            self.quality = QualityBudget(config.quality, policy.candidates, policy.quality_budget)
            if load_control is not None:
                load_control.quality = self.quality  # Alg. 2/4's lowest threshold is its floor

    def choose(self, t, inst: InstanceState, now: float) -> float:
        """Alg. 1 for the scheduler's record `t` of a request on `inst`: its threshold (kept
        until its predictions refresh or it moves, `t.needs_threshold`); a request whose bounds
        exclude every allowed threshold gets the nearest it accepts."""
        r = t.request
        fixed = self.policy.fixed_threshold
        if fixed is not None:  # not a dynamic policy
            return r.clamp_threshold(fixed)
        if not t.needs_threshold:
            return r.threshold
        t.needs_threshold = False
        allowed = r.within_bounds(self.above_floor(t.allowed, now))
        if not allowed:
            return r.clamp_threshold(t.allowed[0])
        if len(allowed) == 1 and self.deadline is None:  # load control left one choice
            return allowed[0]
        if t.lost and self.quality is not None:  # no deadline left: only its quality to lose
            return (r.within_bounds(self.load_control.ladder) or allowed)[0]
        assert r.deadline is not None and self.load_control is not None  # set at arrival; dynamic
        seconds = self._step_seconds(inst)
        slo_left = (r.deadline - now) * self._headroom
        steps = self.load_control.steps_left(r.request_id, allowed)
        if self._costs.exact and r.request_id not in inst.holds:  # it prefills there first
            slo_left -= self._prefill_extra(r, inst)
        factor = self.factor(now)
        recompute = r.num_blocks_to_recompute
        chosen = highest_fitting(allowed, steps, recompute, slo_left / factor, seconds)
        if self.deadline is not None and not t.lost and r.request_id not in self.deadline:
            estimate = seconds_left(steps[allowed.index(chosen)], recompute, seconds)
            self.deadline.admitted(r.request_id, estimate, now)
        return chosen

    def above_floor(self, allowed: tuple[float, ...], now: float) -> tuple[float, ...]:
        """The thresholds of `allowed` (descending) at or above the quality budget's floor now;
        the floor itself if load control allowed none of them (`quality_budget.py`)."""
        return allowed if self.quality is None else self.quality.above_floor(allowed, now)

    def finished(self, r: Request, now: float) -> None:
        """`r` finished at `now`: Alg. 1's calibration and the quality budget learn from it.
        The budget counts what the controller chose: not a request whose own bounds kept it
        below the top threshold (its client chose that loss; counted, one such request could
        close the lower thresholds to every other until requests at the top paid it back)."""
        if self.deadline is not None:
            self.deadline.finished_at(r.request_id, now)
        if self.quality is not None and r.within_bounds((self.quality.top,)):
            self.quality.finished_at(r.mean_threshold, now)

    def forget(self, request_id: str) -> None:
        """The request ended (finished and measured, or not finished): forget it."""
        if self.deadline is not None:
            self.deadline.forget(request_id)

    def factor(self, now: float) -> float:
        """Alg. 1's calibrated factor on the point estimate now (1: the point estimate)."""
        return 1.0 if self.deadline is None else self.deadline.factor(now)

    def low_factor(self, now: float) -> float:
        """The calibration's low quantile of taken over estimated time (1: none kept)."""
        return 1.0 if self.deadline is None else self.deadline.low_factor(now)

    def lowest_time_left(self, t, inst: InstanceState, now: float) -> float:
        """The point estimate of the request's remaining time on `inst` at the lowest threshold
        it may run at."""
        r = t.request
        allowed = self.above_floor(t.allowed, now)
        lowest = (r.within_bounds(allowed) or allowed)[-1]
        steps = self.load_control.steps_left(r.request_id, [lowest])[0]
        return seconds_left(steps, r.num_blocks_to_recompute, self._step_seconds(inst))

    def _step_seconds(self, inst: InstanceState) -> tuple[float, float]:
        """(inner, boundary) step seconds on `inst` as the request's later steps will find it:
        everything assigned there, at the measured speed."""
        key = (inst.resident_tokens, inst.residents)
        if inst.seconds_memo[0] != key:  # the same for every request placed there this round
            load = InstanceLoad(inst.tp, *key)
            inst.seconds_memo = (key, step_seconds(load, self.profile, self._costs))
        slowdown = self.speed.slowdown
        return tuple(s * slowdown for s in inst.seconds_memo[1])

    def _prefill_extra(self, r: Request, inst: InstanceState) -> float:
        """What a prefill of `r` on `inst` costs beyond the block step it replaces."""
        costs = self._costs
        prefill = inst.full_curve.at(costs.request_tokens(StepKind.PREFILL, r))
        assert inst.cache_curve is not None  # an exact cache has its curve
        return max(prefill - inst.cache_curve.at(costs.inner_tokens(r.num_tokens)), 0.0)
