"""What each request may run at: step-predictor refreshes and adaptive load control (Alg. 2/4).

The scheduler hands over the requests it tracks (objects with `request`, `order`,
`refreshed_at`, `allowed` and `needs_threshold`); this keeps their predicted remaining steps in
a `LoadTable` and decides when to refresh them and when to re-run load control:

- a new request is predicted at once; a request `refresh_every_tokens` past its last refresh is
  due, and every due request is predicted together, at most once per `refresh_interval`, in one
  predictor call (a DWS step prior stands in before a request's first step), each prediction
  held within the steps the request's decoding knobs allow (`step_limits.py`);
- load control re-runs when requests come or go, and when refreshes change the picture at most
  once per `load_control_interval`; a request whose highest allowed threshold changes, or whose
  predictions refresh, is marked for threshold selection (Alg. 1/5, in the scheduler).

The cluster's capacity is its throughput times a window: one SLO, as Alg. 2/4 write it, or
(`LoadWindow.BUDGET_LEFT`, the default policy's) the mean budget left to the requests it
counts (a lost request leaves the window as it leaves the table, `lost_work.py`). The work
is priced at the predicted steps, as written, or (`LoadEstimate.QUANTILE`, the default
policy's) at Alg. 1's calibrated factor: the work in flight times how much longer than
estimated requests took, at the on-time target's quantile. Under continuous batching every
request in flight shares the throughput, so the work in flight fits one SLO window until the
*mean* request has a whole SLO of work ahead of it: the written bound binds only once most
requests already miss, and with lost work on it binds nowhere (docs/control/thresholds.md).
With a quality budget (`quality_budget.py`) the lowest threshold Alg. 2/4 may leave a request
is the budget's floor.

With `last_block_caps` (the default policy's) the caps reach only the requests in their last
block. Alg. 1 chooses a request's threshold again at every refresh, so one with blocks to go
is lowered by its own deadline when that needs it; capped early by the cluster's load, the
requests capped were mostly not at risk (89-95% of those held below Alg. 1's own pick on a
GSM8K burst), they spent the quality budget ahead of the peak, and load control lost 2-3 points
to its ablation there. A request in its last block chooses for the last time: there the cap is
the only lever left (docs/control/thresholds.md, "Caps in the last block").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from dilaserve.control.decisions import SchedulerConfig
from dilaserve.control.features import request_states
from dilaserve.control.instance import InstanceState
from dilaserve.control.load_table import LoadTable
from dilaserve.control.on_time import OnTimeCalibration
from dilaserve.control.policy import LoadWindow
from dilaserve.control.profile import LatencyProfile
from dilaserve.control.quality_budget import QualityBudget
from dilaserve.control.speed import MeasuredSpeed
from dilaserve.control.step_limits import within_limits
from dilaserve.control.thresholds import instance_capacity
from dilaserve.request import Request


class LoadControl:
    def __init__(
        self,
        ladder: tuple[float, ...],
        predictor,
        profile: LatencyProfile,
        config: SchedulerConfig,
        tracked: Mapping,  # request id -> the scheduler's record of it, kept by the scheduler
        enabled: bool,  # Alg. 2/4 runs (the policy's load control, with dynamic thresholds)
        window: LoadWindow = LoadWindow.SLO,  # the time the capacity covers
        speed: MeasuredSpeed | None = None,  # capacity is divided by its slowdown
        last_block_caps: bool = False,  # caps reach only a request in its last block
    ):
        self.ladder = ladder  # candidate thresholds, descending
        self._rank = {g: i for i, g in enumerate(ladder)}
        self.predictor = predictor.at(ladder)  # (the ladder's columns, in its order)
        self.profile = profile
        self.config = config
        self._costs = config.costs  # (a property that builds one: read once)
        self.enabled = enabled
        self.window = window
        self.speed = speed
        self.last_block_caps = last_block_caps
        self._deadlines: dict[str, float] = {}  # request -> deadline (BUDGET_LEFT only)
        self._tracked = tracked
        # Alg. 1's calibration where work is priced at its quantile
        self.calibration: OnTimeCalibration | None = None
        self.quality: QualityBudget | None = None  # its floor is Alg. 2/4's lowest threshold
        self._width = len(ladder)  # the ladder's thresholds at or above that floor, last run
        self._table = LoadTable(len(ladder))
        self._unpredicted: dict[str, np.ndarray | None] = {}  # admitted, not in the table yet
        # (insertion order), with the steps admission had predicted for it if it had
        self._asked: tuple[str, np.ndarray] | None = None  # `predict_arrival`'s latest
        self._due: dict[str, None] = {}  # `refresh_every_tokens` committed since the last one
        self._last_refresh = float("-inf")
        self._last_run = float("-inf")

    def predict_arrival(self, request) -> np.ndarray:
        """The predictor's steps over the ladder for a request not admitted yet (admission
        asks); if it is the next admitted, its first `refresh` takes them rather than asking
        the predictor again (the same request, the same state: the same numbers)."""
        states = request_states([request])
        row = self.predictor.predict([request.request_id], states)[0]
        self._asked = (request.request_id, row)
        return row

    def admit(self, request_id: str) -> None:
        asked, self._asked = self._asked, None
        self._unpredicted[request_id] = asked[1] if asked and asked[0] == request_id else None
        if self.window is LoadWindow.BUDGET_LEFT:
            self._deadlines[request_id] = self._tracked[request_id].request.deadline

    def stepped(self, tracked: Sequence) -> None:
        """One step done for each of `tracked` (requests that go on): predicted ones count down
        a step, and those `refresh_every_tokens` past their last refresh fall due."""
        k = self.config.refresh_every_tokens
        predicted = []
        for t in tracked:
            if t.refreshed_at >= 0:  # predicted, so in the table
                r = t.request
                predicted.append(r)
                if r.num_committed - t.refreshed_at >= k:
                    self._due[r.request_id] = None
        self._table.count_step(predicted)

    def leave_out(self, request_id: str) -> None:
        """Alg. 2/4 no longer counts the request (it is lost, `lost_work.py`)."""
        if request_id in self._table:
            self._table.leave_out(request_id)
        self._deadlines.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self._table.remove(request_id)
        self._unpredicted.pop(request_id, None)
        self._due.pop(request_id, None)
        self._deadlines.pop(request_id, None)

    def refresh(self, now: float) -> bool:
        """Predict for every request that has none yet and, at most once per
        `refresh_interval`, for every request due (running or not): one batched predictor
        call. Returns whether anything was predicted."""
        given = self._unpredicted
        due = list(given)
        if self._due and now - self._last_refresh >= self.config.refresh_interval:
            self._last_refresh = now
            due += self._due
            self._due = {}
        if not due:
            return False
        self._unpredicted = {}
        tracked = [self._tracked[rid] for rid in due]
        requests = [t.request for t in tracked]
        rows = self._predicted(due, requests, given)
        for i, t in enumerate(tracked):
            r = t.request
            if r.num_steps == 0 and r.prior_steps is not None:  # the DWS one-shot prior
                rows[i] = [r.prior_steps[g] for g in self.ladder]
            t.refreshed_at = r.num_committed
            t.needs_threshold = True
            if r.request_id not in self._table:
                self._table.add(r.request_id, t.order, r.num_tokens)
        rows = within_limits(rows, requests)  # the request's decoding knobs (`step_limits.py`)
        self._table.set_rows(due, rows, [r.num_blocks_to_recompute for r in requests])
        return True

    def _predicted(self, due: list[str], requests: list, given: dict) -> np.ndarray:
        """The predictor's steps over the ladder for `due` (one batched call), but for those
        `given` has already (`predict_arrival`)."""
        rows, ask = np.empty((len(due), len(self.ladder))), []
        for k, rid in enumerate(due):
            row = given.get(rid)
            if row is None:
                ask.append(k)
            else:
                rows[k] = row
        if ask:
            states = request_states([requests[k] for k in ask])
            rows[ask] = self.predictor.predict([due[k] for k in ask], states)
        return rows

    def run_if_due(self, now: float, load_changed: bool, refreshed: bool, instances) -> None:
        """Alg. 2/4 over every request in flight, when requests came or went (`load_changed`)
        or refreshes changed the picture and the last run is `load_control_interval` old."""
        if not self.enabled or not self._tracked:
            return
        stale = now - self._last_run >= self.config.load_control_interval
        width = self._width_above_floor(now)
        if not (load_changed or (refreshed and stale) or width != self._width):
            return
        self._last_run, self._width = now, width
        capacity = self.throughput(instances) * self.window_seconds(now) / self._factor(now)
        for rid, rank in self._table.run(capacity, self._costs, width):
            t = self._tracked[rid]
            if self.last_block_caps and t.request.blocks_left > 1:
                rank = 0  # blocks to go: Alg. 1 chooses again at its next refresh
            t.allowed = self.ladder[rank:]
            t.needs_threshold = True

    def _width_above_floor(self, now: float) -> int:
        """How many of the ladder's thresholds are at or above the quality budget's floor now."""
        if self.quality is None:
            return len(self.ladder)
        return len(self.quality.above_floor(self.ladder, now))

    def window_seconds(self, now: float) -> float:
        """Seconds the capacity covers: one SLO, or the mean budget left to the requests
        counted (>= 0). The deadlines are summed afresh, exactly: a running sum lost the
        deadlines beside a far one (an SLO of 1e300 ms) when that one left, and the window
        stayed short, so that Alg. 2/4 held every request at the lowest threshold for good."""
        if self.window is LoadWindow.SLO or not self._deadlines:
            return self.config.slo
        return max(math.fsum(self._deadlines.values()) / len(self._deadlines) - now, 0.0)

    def _factor(self, now: float) -> float:
        """How much longer than predicted the work in flight may take: 1 (the point estimate,
        as Alg. 2/4 write it), or Alg. 1's calibrated factor at its on-time quantile."""
        return 1.0 if self.calibration is None else self.calibration.factor(now)

    def throughput(self, instances, mean_tokens: float | None = None) -> float:
        """Token-steps per second the instances process (Alg. 4's throughput) for requests of
        `mean_tokens` (default: those in flight), at the measured speed (`speed.py`)."""
        if mean_tokens is None:
            mean_tokens = self._table.mean_tokens()
        shapes = [self._batch_shape(inst) for inst in instances]
        per_shape = {
            key: instance_capacity(self.profile, key[0], 1.0, self._costs, mean_tokens, key[1])
            for key in set(shapes)
        }
        slowdown = self.speed.slowdown if self.speed is not None else 1.0
        return sum(per_shape[key] for key in shapes) / slowdown

    def _batch_shape(self, inst: InstanceState) -> tuple[int, int]:
        """(tp, Alg. 4's maxNumSeqPerBatch): the sequences whose cache-step blocks fit the
        batch size the plan chose for the instance, else `max_requests_per_instance`."""
        planned, costs = inst.planned_batch, self._costs
        if planned is None or planned[1] is None or not costs.cached:
            return inst.tp, self.config.max_requests_per_instance
        return inst.tp, max(planned[1] // costs.block_len, 1)

    def lowest(self, now: float) -> float:
        """The lowest threshold a request may run at now: the ladder's, or the quality
        budget's floor."""
        return self.ladder[self._width_above_floor(now) - 1]

    def lowest_load(self, min_priority: float, now: float) -> tuple[float, float, int]:
        """(load, tokens, requests) of the requests in flight of priority >= `min_priority`,
        each at the lowest threshold now (what admission weighs a newcomer against)."""
        column = self._width_above_floor(now) - 1
        return self._table.lowest_load(min_priority, self._costs, column)

    def lowest_rows(self, now: float):
        """Each request in flight's steps left at the lowest threshold now
        (`LoadTable.lowest_rows`)."""
        return self._table.lowest_rows(self._width_above_floor(now) - 1)

    def lowest_priority(self) -> float:
        """The lowest priority in flight (+inf: none)."""
        return self._table.lowest_priority()

    def steps_per_block(self, request: Request) -> float:
        """The steps each block the request has left is predicted to take at its threshold
        (its steps left over its blocks left); one for a threshold off the ladder."""
        if request.threshold not in self._rank:
            return 1.0
        steps = self._table.steps_of(request.request_id)[self._rank[request.threshold]]
        return steps / max(request.blocks_left, 1)

    def steps_left(self, request_id: str, thresholds: Sequence[float]) -> list[float]:
        """What threshold selection reads: the request's predicted steps left now at each of
        `thresholds` (ladder thresholds, in any order)."""
        steps = self._table.steps_of(request_id)
        return [steps[self._rank[g]] for g in thresholds]
