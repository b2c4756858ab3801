"""Admission by capacity: Algorithm 2's feasibility test, asked of each new request.

Load control (papers.md 1.5, `control/load_control.py`) walks requests in service order and
grants each the widest threshold range whose worst case still fits the cluster's capacity over
one SLO window, every later request counted at the lowest threshold. A new request comes after
every request of its priority or higher; if their load at the lowest threshold plus its own
already exceeds that capacity, no threshold lets them all finish in time: the newcomer cannot
meet its SLO without others missing theirs. It is then refused (`reject`: the HTTP layer's 429
with Retry-After) or admitted at the lowest priority (`deprioritize`: served after everything
else). Load and capacity are load control's own: predicted remaining steps times the tokens
each step processes (Alg. 4 with a KV cache) against `instance_capacity` summed over the
instances. Policies without load control (fixed thresholds) admit every request; the count
limit (`max_in_flight`) still holds.
"""

from __future__ import annotations

import numpy as np

from dilaserve.control.features import request_states
from dilaserve.control.thresholds import instance_capacity, load_matrix
from dilaserve.request import Request

OVERLOAD_MODES = ("reject", "deprioritize")
LOWEST_PRIORITY = -(2**31)  # (intake.PRIORITIES[0]) where a deprioritized request goes


class Admission:
    def __init__(self, scheduler, mode: str = "reject"):
        if mode not in OVERLOAD_MODES:
            raise ValueError(f"overload mode {mode!r} must be one of {OVERLOAD_MODES}")
        self.scheduler = scheduler  # control.scheduler.Scheduler, read on the controller thread
        self.mode = mode
        self._loads = scheduler._loads  # its load control; None for fixed-threshold policies

    @property
    def enabled(self) -> bool:
        return self._loads is not None and self._loads.enabled

    def excess(self, request: Request) -> float:
        """How far the load of `request` and of every request served before it, all at the
        lowest threshold, exceeds the cluster's capacity over one SLO window (<= 0: fits)."""
        if not self.enabled or not self.scheduler.instances:
            return 0.0
        ahead = [
            t.request
            for t in self.scheduler.requests.values()
            if t.request.priority >= request.priority
        ]
        lowest = self._loads.ladder[-1]
        steps = [self._loads.steps_left(r.request_id, [lowest])[0] for r in ahead]
        steps.append(self._predicted_steps(request, lowest))
        everyone = [*ahead, request]
        load = self._load(everyone, steps)
        return load - self._capacity(everyone)

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
            self.scheduler.config.cache_block,
        )
        return float(loads.sum())

    def _capacity(self, requests: list[Request]) -> float:
        """`LoadControl`'s cluster capacity, for these requests' mean size."""
        config = self.scheduler.config
        mean_tokens = sum(r.num_tokens for r in requests) / len(requests)
        per_tp = {
            tp: instance_capacity(
                self.scheduler.profile,
                tp,
                config.slo,
                config.cache_block,
                mean_tokens,
                config.max_requests_per_instance,
            )
            for tp in {inst.tp for inst in self.scheduler.instances.values()}
        }
        return sum(per_tp[inst.tp] for inst in self.scheduler.instances.values())
