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

Capacity and the time a request needs are at the measured speed (`speed.py`): without it, on
this project's loaded 2-core machine, admission refused nothing at 3x capacity.

Between events the controller publishes a `Room` (what is left for a request served after
everything in flight), which the HTTP front reads to refuse at once, before tokenizing or
queueing for the controller; what it does not refuse is asked in full here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dilaserve.control.features import request_states
from dilaserve.control.thresholds import (
    InstanceLoad,
    LoadView,
    load_matrix,
    predicted_time_left,
)
from dilaserve.request import Request

OVERLOAD_MODES = ("reject", "deprioritize")
LOWEST_PRIORITY = -(2**31)  # (intake.PRIORITIES[0]) where a deprioritized request goes


@dataclass(frozen=True)
class Room:
    """Admission's answer between events, for requests that come after everything in flight:
    `refuses(priority)` without asking the controller (the HTTP front asks it of each request
    before reading its prompt). A request at or below the lowest priority in flight is refused
    when the capacity over one SLO window, less the load in flight at the lowest threshold, is
    below the least any request adds (one step over one block); others are asked in full."""

    lowest_priority: float = float("inf")  # in flight (+inf: nothing is)
    spare: float = float("inf")  # token-steps
    least: float = 0.0  # the least load a request adds

    def refuses(self, priority: int) -> bool:
        return priority <= self.lowest_priority and self.spare < self.least


class Admission:
    def __init__(self, scheduler, mode: str = "reject"):
        if mode not in OVERLOAD_MODES:
            raise ValueError(f"overload mode {mode!r} must be one of {OVERLOAD_MODES}")
        self.scheduler = scheduler  # control.scheduler.Scheduler, read on the controller thread
        self.mode = mode
        self._loads = scheduler.load_control  # None for fixed-threshold policies

    @property
    def enabled(self) -> bool:
        return self._loads is not None and self._loads.enabled

    def room(self) -> Room:
        """What is left for a request served after everything in flight (`Room`)."""
        if not self.enabled or not self.scheduler.instances:
            return Room()
        load, tokens, count = self._loads.lowest_load(float("-inf"))
        capacity = self._capacity(tokens / count if count else 0.0)
        least = self.scheduler.config.costs.block_len  # one step over one block
        return Room(self._loads.lowest_priority(), capacity - load, least)

    def refusal(self, request: Request, now: float) -> str | None:
        """Why `request` cannot meet its SLO now (None: admit it): the load of it and of every
        request served before it exceeds capacity, or even alone, at the lowest
        threshold, it would not finish by its deadline (it waited too long to get here)."""
        if not self.enabled or not self.scheduler.instances:
            return None
        lowest = self._loads.ladder[-1]
        ahead = self._loads.lowest_load(request.priority)
        excess = self._excess(ahead, request, 1.0)  # over with one step of its own: refused
        if excess <= 0:
            steps = self._predicted_steps(request, lowest)
            excess = self._excess(ahead, request, steps)
        if excess > 0:
            return f"over capacity: the load in flight exceeds it by {excess:.0f} token-steps"
        deadline = request.deadline if request.deadline is not None else now + self._slo
        needed = self._fastest_seconds(request, lowest, steps)
        if needed > deadline - now:
            left = max(deadline - now, 0.0)
            return f"it needs at least {needed:.2f} s and {left:.2f} s are left"
        return None

    @property
    def _slo(self) -> float:
        return self.scheduler.config.slo

    def _excess(self, ahead: tuple[float, float, int], request: Request, steps: float) -> float:
        """How far the load of `request` (`steps` left at the lowest threshold) and of every
        request served before it (`ahead`: their load at the lowest threshold, tokens and
        number) exceeds the cluster's capacity over one SLO window (<= 0: it fits)."""
        load, tokens, count = ahead
        mean_tokens = (tokens + request.num_tokens) / (count + 1)
        return load + self._load([request], [steps]) - self._capacity(mean_tokens)

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
        return seconds * self.scheduler.speed.slowdown

    @property
    def _profile(self):
        return self.scheduler.profile

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

    def _capacity(self, mean_tokens: float) -> float:
        """Load control's cluster capacity over one SLO window, for requests of `mean_tokens`."""
        return self._loads.throughput(self.scheduler.instances.values(), mean_tokens) * self._slo
