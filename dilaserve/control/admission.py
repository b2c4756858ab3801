"""Admission by capacity: Algorithm 2's feasibility test, asked of each new request.

Load control (papers.md 1.5, `control/load_control.py`) walks requests in service order and
grants each the widest threshold range whose worst case still fits the cluster's capacity over
one SLO window, every later request counted at the lowest threshold. A new request comes after
every request of its priority or higher; if their load at the lowest threshold plus its own
already exceeds that capacity, no threshold lets them all finish in time: the newcomer cannot
meet its SLO without others missing theirs. Nor can one that, alone at the lowest threshold,
would not finish by its deadline (it waited too long before it got here). It is then refused
(`reject`: the HTTP layer's 429 with Retry-After) or admitted at the lowest priority
(`deprioritize`: served after everything else). Load and capacity are load control's own:
predicted remaining steps times the tokens each step processes (Alg. 4 with a KV cache) against
`instance_capacity` summed over the instances. Policies without load control (fixed
thresholds) admit every request; the count limit (`max_in_flight`) still holds.

Measured slowdown (an extension): the profile was measured on an idle machine. Each step's
round trip (launch to result, as the controller sees it) is compared with what the profile
predicts for its batch, and capacity is divided by the running ratio when steps run slower
(never multiplied: on a machine as fast as when it was profiled, the capacity is Algorithm
2's). Without it, on this project's loaded 2-core
machine, admission refused nothing at 3x capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dilaserve.control.features import request_states
from dilaserve.control.thresholds import (
    InstanceLoad,
    LoadView,
    instance_capacity,
    load_matrix,
    predicted_time_left,
)
from dilaserve.protocol import CACHED_KINDS, StepBatch
from dilaserve.request import Request

OVERLOAD_MODES = ("reject", "deprioritize")
SLOWDOWN_WEIGHT = 0.05  # each step's share of the running measured/predicted ratio
LOWEST_PRIORITY = -(2**31)  # (intake.PRIORITIES[0]) where a deprioritized request goes


@dataclass(frozen=True)
class Refusal:
    reason: str
    over_capacity: bool  # (else: too late for its own deadline)


class Admission:
    def __init__(self, scheduler, mode: str = "reject"):
        if mode not in OVERLOAD_MODES:
            raise ValueError(f"overload mode {mode!r} must be one of {OVERLOAD_MODES}")
        self.scheduler = scheduler  # control.scheduler.Scheduler, read on the controller thread
        self.mode = mode
        self._loads = scheduler.load_control  # None for fixed-threshold policies
        self.slowdown = 1.0  # steps' measured time over the profile's prediction (running)

    @property
    def enabled(self) -> bool:
        return self._loads is not None and self._loads.enabled

    def refusal(self, request: Request, now: float) -> Refusal | None:
        """Why `request` cannot meet its SLO now (None: admit it): the load of it and of every
        request served before it exceeds capacity (`excess`), or even alone, at the lowest
        threshold, it would not finish by its deadline (it waited too long to get here)."""
        if not self.enabled or not self.scheduler.instances:
            return None
        lowest = self._loads.ladder[-1]
        steps = self._predicted_steps(request, lowest)
        excess = self.excess(request, steps)
        if excess > 0:
            reason = f"over capacity: the load in flight exceeds it by {excess:.0f} token-steps"
            return Refusal(reason, over_capacity=True)
        deadline = request.deadline if request.deadline is not None else now + self._slo
        needed = self._fastest_seconds(request, lowest, steps)
        if needed > deadline - now:
            left = max(deadline - now, 0.0)
            return Refusal(f"it needs at least {needed:.2f} s and {left:.2f} s are left", False)
        return None

    @property
    def _slo(self) -> float:
        return self.scheduler.config.slo

    def excess(self, request: Request, steps: float) -> float:
        """How far the load of `request` (`steps` left at the lowest threshold) and of every
        request served before it, all at the lowest threshold, exceeds the cluster's capacity
        over one SLO window (<= 0: it fits)."""
        ahead = [
            t.request
            for t in self.scheduler.requests.values()
            if t.request.priority >= request.priority
        ]
        lowest = self._loads.ladder[-1]
        counts = [self._loads.steps_left(r.request_id, [lowest])[0] for r in ahead]
        everyone = [*ahead, request]
        return self._load(everyone, [*counts, steps]) - self._capacity(everyone)

    def _fastest_seconds(self, request: Request, threshold: float, steps: float) -> float:
        """Seconds `request` needs alone on the fastest instance, at the measured slowdown."""
        view = LoadView(
            request.request_id,
            0.0,
            request.num_tokens,
            {threshold: steps},
            request.num_blocks_to_recompute,
        )
        costs = self.scheduler.config.costs
        seconds = min(
            predicted_time_left(
                view, threshold, InstanceLoad(tp, request.num_tokens, 1), self._profile, costs
            )
            for tp in {inst.tp for inst in self.scheduler.instances.values()}
        )
        return seconds * max(self.slowdown, 1.0)

    @property
    def _profile(self):
        return self.scheduler.profile

    def observe_step(self, tp: int, batch: StepBatch, seconds: float) -> None:
        """A step of `batch` took `seconds`: update the measured slowdown. (Call it
        before the scheduler hears of the step: its requests are still tracked.)"""
        costs = self.scheduler.config.costs
        tokens, kind = 0, costs.inner_kind
        for item in batch.items:
            tracked = self.scheduler.requests.get(item.request_id)
            if item.kind in CACHED_KINDS:
                tokens += costs.tokens(item.kind, 0)
            elif tracked is not None:
                tokens, kind = tokens + tracked.request.num_tokens, costs.sequence_kind
        predicted = self.scheduler.profile.step_latency(tp, tokens, kind)
        if tokens and predicted > 0:
            ratio = seconds / predicted
            self.slowdown += SLOWDOWN_WEIGHT * (ratio - self.slowdown)

    def _predicted_steps(self, request: Request, threshold: float) -> float:
        if request.prior_steps is not None:  # DWS's estimate, as load control uses it
            return request.prior_steps[threshold]
        predictor = self._loads.predictor
        column = list(predictor.thresholds).index(threshold)
        rows = predictor.predict([request.request_id], request_states([request]))
        return float(rows[0, column])

    def _load(self, requests: list[Request], steps: list[float]) -> float:
        loads = load_matrix(
            np.maximum(np.array(steps, dtype=np.float64)[:, None], 1.0),
            [r.num_tokens for r in requests],
            [r.num_blocks_to_recompute for r in requests],
            self.scheduler.config.costs,
        )
        return float(loads.sum())

    def _capacity(self, requests: list[Request]) -> float:
        """`LoadControl`'s cluster capacity, for these requests' mean size, over the measured
        slowdown."""
        config = self.scheduler.config
        mean_tokens = sum(r.num_tokens for r in requests) / len(requests)
        per_tp = {
            tp: instance_capacity(
                self.scheduler.profile,
                tp,
                config.slo,
                config.costs,
                mean_tokens,
                config.max_requests_per_instance,
            )
            for tp in {inst.tp for inst in self.scheduler.instances.values()}
        }
        total = sum(per_tp[inst.tp] for inst in self.scheduler.instances.values())
        return total / max(self.slowdown, 1.0)
