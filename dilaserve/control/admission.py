"""Admission by capacity: Algorithm 2's feasibility test, asked of each new request.

Load control (papers.md 1.5, `control/load_control.py`) walks requests in service order and
grants each the widest threshold range whose worst case still fits the cluster's capacity over
one SLO window. Admission asks it of a newcomer, at the lowest threshold: if no threshold lets
it and the requests in flight finish in time, it is refused (`reject`: the HTTP layer's 429
with Retry-After) or admitted at the lowest priority (`deprioritize`: served after everything
else). Policies without load control (fixed thresholds) admit every request; the count limit
(`max_in_flight`) still holds.

The time a request needs (`ClusterConfig.admission_time`): by default (`batched`,
`batched_time.py`) its own predicted steps, each at the latency of the batch it shares with
the requests in flight, at the measured speed; and a newcomer is refused too if it would make
late a request in flight that would finish in time without it (not one held in an overdue
step, a stopped worker's: no refusal brings that step's end nearer; nor one in its last step,
which a newcomer cannot join: `BatchedTime.in_flight`). Or (`queue`) the load of
it and of every request served before it (predicted remaining steps times the tokens each step
processes, Alg. 4 with a KV cache) over the cluster's throughput: load control's model at the
measured speed (`speed.py`), or what each instance's steps measured where that is less
(`capacity`: `speed.ServedRates`), decaying back to the model when stale. Each request is
priced against its own SLO (`deadline - now`), not the server's default.

Predicted times are multiplied by admission's on-time factor (`on_time.py`: how much longer
than predicted admitted requests took), learnt only from the requests that ran every step at
the lowest threshold, the threshold admission prices every request at. A request that had room
ran higher and took longer by choice, not by an error of this estimate (Alg. 1's factor,
which measures from each request's chosen threshold, is another estimate's error:
docs/control.md). The factor decays toward 1 while no such request finishes (under light
load, few do).

Admission never refuses all work for good (DESIGN.md section 7): a request that comes while
nothing is in flight is admitted whatever the estimates say (a probe: its steps measure the
machine again, and the measured slowdown also decays by itself, `speed.py`), unless even at
the profile's speed it cannot finish in the time its deadline leaves. A request that no idle
cluster could serve (alone, at the lowest threshold, on the fastest instance, at the profile's
speed, it needs more than its SLO) is the request's fault, not the load's: `Refusal.param`
names the field, the HTTP layer's 400; with `deprioritize` it is served last, as any other.

Between events the controller publishes a `Room` (what is left for a request served after
everything in flight), which the HTTP front reads to refuse at once, before tokenizing or
queueing for the controller; what it does not refuse is asked in full here. It prices a
newcomer by the least load (queue) or time alone (batched) per output block of the latest 64
requests priced (times its blocks), and counts the requests queued for admission ahead of it
(`Cluster.is_full` asks again just before it queues a tokenized request); with the batched
model, also how many newcomers the requests in flight take (`Room.fits`). Refused in full, a
request waits for the controller's next event (at 3x capacity that was the refusals' tail:
docs/serving/reliability.md)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from dilaserve.control.batched_time import UNLIMITED, BatchedTime
from dilaserve.control.on_time import OnTimeCalibration
from dilaserve.control.room import RecentPrices, Room
from dilaserve.control.step_limits import within_limits
from dilaserve.control.thresholds import (
    InstanceLoad,
    LoadView,
    load_matrix,
    predicted_time_left,
)
from dilaserve.request import Request

OVERLOAD_MODES = ("reject", "deprioritize")
TIME_MODELS = ("batched", "queue")  # a request's predicted time (`batched_time.py`), or the
# load ahead of it over the cluster's throughput
LOWEST_PRIORITY = -(2**31)  # (intake.PRIORITIES[0]) where a deprioritized request goes


@dataclass(frozen=True)
class Refusal:
    """Why a request is not admitted. `param`: the request field at fault when no idle
    cluster could serve it (a 400); None when the load or the measured speed refuses it now
    (a 429: retry later)."""

    reason: str
    param: str | None = None

    def __str__(self) -> str:
        return self.reason


class Admission:
    def __init__(
        self,
        scheduler,
        mode: str = "reject",
        on_time: OnTimeCalibration | None = None,
        model: str = "batched",
        restoring=lambda: False,
    ):
        if mode not in OVERLOAD_MODES:
            raise ValueError(f"overload mode {mode!r} must be one of {OVERLOAD_MODES}")
        if model not in TIME_MODELS:
            raise ValueError(f"admission time model {model!r} must be one of {TIME_MODELS}")
        self.model = model
        # (`restoring`: is an instance starting to restore lost capacity? `BatchedTime`)
        self._batched = BatchedTime(scheduler, restoring) if model == "batched" else None
        self.scheduler = scheduler  # control.scheduler.Scheduler, read on the controller thread
        self.mode = mode
        self._loads = scheduler.load_control  # None for fixed-threshold policies
        self.on_time = on_time or OnTimeCalibration(age_each=True)
        self._priced: dict[str, Request] = {}  # admitted, their predicted time on record
        self._predicted = 0.0  # seconds the last request asked about needs (`refusal`)
        self.prices = RecentPrices()  # of the latest requests priced, what the `Room` reads
        self._mean_tokens = 0.0  # of the requests in flight, as of the latest `room`
        if getattr(scheduler, "lost_work", None) is not None:
            scheduler.lost_work.on_lost.append(self.lost)

    @property
    def predicted(self) -> float:
        """Seconds the latest request priced needs, before the on-time factor (`/metrics`)."""
        return self._predicted

    @property
    def enabled(self) -> bool:
        return self._loads is not None and self._loads.enabled

    def room(self, now: float) -> Room:
        """What is left at `now` for a request served after everything in flight (`Room`).
        One that refuses nothing unless admission refuses (`reject`): deprioritized, what it
        would refuse is served last, and the front must not answer it 429."""
        if not self.enabled or not self.scheduler.instances or self.mode != "reject":
            return Room()
        if not self.scheduler.requests:
            return self._idle_room(now)
        load, tokens, count = self._loads.lowest_load(float("-inf"), now)
        mean_tokens = self._mean_tokens = tokens / count if count else 0.0
        factor = self.on_time.factor(now)
        throughput = self.capacity(now, mean_tokens) / factor
        block_len = self.scheduler.config.costs.block_len
        least = block_len  # one step over one block
        per_block, most = self.prices.least_load, self.prices.most_blocks
        lowest = self._loads.lowest_priority()
        room = Room(
            lowest, throughput, load, least, self._slo, per_block, block_len, most_blocks=most
        )
        if self._batched is None or self.prices.least_alone is None:
            return room
        flight = self._in_flight(now, factor)
        fits = self._batched.tolerated(flight)
        return self._priced_room(replace(room, fits=fits), flight.count, mean_tokens, now, factor)

    def _idle_room(self, now: float) -> Room:
        """The `Room` with nothing in flight: the next request is admitted (a probe), and, with
        the batched model, those queued behind it are priced as newcomers to a batch of the
        ones ahead (a burst at an idle server is refused at the front beyond what it takes,
        not each in full by the controller: docs/serving/reliability.md)."""
        block_len = self.scheduler.config.costs.block_len
        most = self.prices.most_blocks
        room = Room(slo=self._slo, block_len=block_len, fits=UNLIMITED, most_blocks=most)
        if self._batched is None or self.prices.least_alone is None:
            return room
        return self._priced_room(room, 0, self._mean_tokens, now, self.on_time.factor(now))

    def _priced_room(self, room, count: int, mean_tokens: float, now: float, factor: float):
        """`room` with the batched model's price of a newcomer behind `count` in flight of
        `mean_tokens` each, at the lowest threshold now and the on-time `factor`: the least
        time alone per block seen, and its scales (the measured slowdown in them once: until
        2026-12-07 it was counted twice, and at 3x capacity, steps 1.5x slower than the
        profile, the room refused what admission in full would have taken)."""
        alone, steps = self.prices.least_alone
        scales = self._batched.scales(count, mean_tokens, self._loads.lowest(now), steps)
        return replace(room, alone_per_block=alone, scales=tuple(x * factor for x in scales))

    def refusal(self, request: Request, now: float, submitted: float | None = None):
        """Why `request` is not admitted now (a `Refusal`; None: admit it). Its SLO counts
        from `submitted` (default: its arrival time). Refused: no idle cluster could meet
        its SLO (`Refusal.param` names the field); or, with requests in flight, the load of
        it and of every request served before it exceeds the capacity until its deadline,
        or, even alone at the lowest threshold and the measured speed, it would not finish by
        its deadline (it waited too long to get here). With nothing in flight it is admitted
        unless it would not finish by its deadline even at the profile's speed (a probe:
        `speed.py`)."""
        if not self.enabled or not self.scheduler.instances:
            return None
        self.scheduler.speed.advance(now)
        lowest = self._loads.lowest(now)  # the ladder's, or the quality budget's floor
        steps = self._predicted_steps(request, lowest)
        needed = self._fastest_seconds(request, lowest, steps)  # at the profile's speed
        impossible = self._impossible(request, needed, submitted)
        if impossible is not None:
            return impossible
        deadline = request.deadline if request.deadline is not None else now + self._slo
        left = max(deadline - now, 0.0)
        alone = needed * self.scheduler.speed.slowdown
        own = self._load([request], [steps])
        batched = (needed, steps) if self._batched is not None else None
        self.prices.learn(request.num_blocks, own, batched)  # a probe too (`RecentPrices`)
        if not self.scheduler.requests:  # a probe: priced at the profile, not the estimates
            self._predicted = alone
            return _too_late(needed, left)
        if self._batched is not None:
            return self._batched_refusal(request, now, left, lowest, steps)
        load, tokens, count = self._loads.lowest_load(request.priority, now)
        load += own
        queued = load / self.capacity(now, (tokens + request.num_tokens) / (count + 1))
        self._predicted = max(queued, alone)
        factor = self.on_time.factor(now)
        if queued * factor > left:
            return Refusal(
                f"over capacity: the load in flight and its own take {queued:.2f} s "
                f"(x{factor:.2f} to be on time {self.on_time.target:.0%} of the time), and "
                f"{left:.2f} s are left"
            )
        return _too_late(alone * factor, left)

    def _batched_refusal(self, request, now, left, lowest, steps):
        """`refusal` by the batched time model (`batched_time.py`): its own steps in the batch
        it will share with every request in flight, at the measured speed."""
        factor = self.on_time.factor(now)
        flight = self._in_flight(now, factor)  # the requests it shares the batches with
        view = _view(request, lowest, steps)
        self._predicted = self._batched.seconds(view, lowest, flight.count, flight.tokens)
        if self._predicted * factor > left:
            return Refusal(
                f"over capacity: in a batch with the {flight.count} requests in flight it "
                f"takes {self._predicted:.2f} s (x{factor:.2f} to be on time "
                f"{self.on_time.target:.0%} of the time), and {left:.2f} s are left"
            )
        late = self._batched.late(flight, 1, request.num_tokens)
        if late:
            return Refusal(
                f"over capacity: {late} of the {flight.count} requests in flight would no "
                f"longer finish in time in a batch one larger"
            )
        return None

    def _in_flight(self, now: float, factor: float):
        """The requests in flight at the lowest threshold now (`LoadTable.lowest_rows`), as a
        newcomer shares the batches with them (`BatchedTime.in_flight`)."""
        return self._batched.in_flight(self._loads.lowest_rows(now), now, factor)

    def admitted(self, request: Request, now: float) -> None:
        """The request last asked about was admitted: its predicted time is on record for the
        on-time calibration (`finished`)."""
        if self.enabled:
            self.on_time.admitted(request.request_id, self._predicted, now)
            self._priced[request.request_id] = request

    def finished(self, request_id: str, now: float) -> None:
        """A request admitted here finished at `now`: it teaches the on-time calibration if it
        ran every step at the lowest threshold, where admission priced it (one that had room
        and ran higher took longer by choice, not by a wrong estimate)."""
        request = self._priced.pop(request_id, None)
        if request is not None and self._ran_as_priced(request):
            self.on_time.finished_at(request_id, now)
        else:
            self.on_time.forget(request_id)

    def lost(self, request_id: str, at: float) -> None:
        """A request admitted here was found lost (`lost_work.py`): it teaches the on-time
        calibration as if it finished `at` (what it would have needed from there), if it ran
        as priced so far; its finish, served last by choice, teaches nothing (taught at their
        finish, lost requests took 24x their prediction at 3x capacity on the virtual clock,
        and the factor read 27)."""
        request = self._priced.get(request_id)
        if request is not None and self._ran_as_priced(request):
            self.on_time.finished_at(request_id, at)
        else:
            self.on_time.forget(request_id)

    def dropped(self, request_id: str) -> None:
        """A request admitted here ended without finishing (cancelled, failed)."""
        self._priced.pop(request_id, None)
        self.on_time.forget(request_id)

    def void(self, request_ids: Iterable[str]) -> list[str]:
        """Those of these requests in flight (returned) teach no on-time factor, admission's
        or Alg. 1's (`Scheduler.deadline`), whenever they finish: a fault or a stall of the
        controller delayed them (`on_time.py`, `cluster/stalls.py`; after SIGSTOP they took 4x
        their prediction, and admission refused a load there was room for). The cluster's
        recording lists them (`Recording.voided`), and a replay voids them too."""
        request_ids = [rid for rid in request_ids if rid in self.scheduler.requests]
        for calibration in (self.on_time, self.scheduler.deadline):
            if calibration is not None:
                calibration.void(request_ids)
        return request_ids

    def _ran_as_priced(self, request: Request) -> bool:
        lowest = self._loads.ladder[-1]
        return all(threshold <= lowest for threshold in request.threshold_steps)

    def _impossible(self, request: Request, needed: float, submitted: float | None):
        """A `Refusal` naming the SLO when `needed` (seconds, alone on the fastest instance at
        the profile's speed) exceeds it: no idle cluster could meet it."""
        if request.deadline is None:  # the server's SLO: too many tokens asked for it
            slo, param = self._slo, "max_tokens"
        else:
            start = request.arrival_time if submitted is None else submitted
            slo, param = request.deadline - start, "slo_ms"
        if needed <= slo:
            return None
        return Refusal(
            f"{param}: the request needs at least {needed:.3f} s alone on an idle instance at "
            f"the lowest threshold, and its SLO is {slo:.3f} s: no cluster could meet it",
            param,
        )

    @property
    def _slo(self) -> float:
        return self.scheduler.config.slo

    def _fastest_seconds(self, request: Request, threshold: float, steps: float) -> float:
        """Seconds `request` needs alone on the fastest instance, at the profile's speed."""
        view = _view(request, threshold, steps)
        costs = self.scheduler.config.costs
        return min(
            predicted_time_left(
                view, threshold, InstanceLoad(tp, request.num_tokens, 1), self._profile, costs
            )
            for tp in {inst.tp for inst in self.scheduler.instances.values()}
        )

    @property
    def _profile(self):
        return self.scheduler.profile

    def _predicted_steps(self, request: Request, threshold: float) -> float:
        """As load control predicts it: DWS's prior or the predictor, within the request's
        step limits."""
        if request.prior_steps is not None:  # DWS's estimate, as load control uses it
            steps = request.prior_steps[threshold]
        else:
            row = self._loads.predict_arrival(request)
            steps = row[self._loads.ladder.index(threshold)]
        return float(within_limits(np.array([[steps]]), [request])[0, 0])

    def _load(self, requests: list[Request], steps: list[float]) -> float:
        loads = load_matrix(
            np.maximum(np.array(steps, dtype=np.float64)[:, None], 1.0),
            [r.num_tokens for r in requests],
            [r.num_blocks_to_recompute for r in requests],
            self.scheduler.config.costs,
        )
        return float(loads.sum())

    def capacity(self, now: float, mean_tokens: float | None = None) -> float:
        """The cluster's throughput (token-steps per second) for requests of `mean_tokens`
        (default: those in flight as of the latest `room`, which other threads may read):
        load control's model at the measured speed, instance by instance, or what the
        instance's steps measured where that is less (`speed.py`)."""
        return self.scheduler.speed.served.capacity(self._modelled(mean_tokens), now)

    def modelled_capacity(self, mean_tokens: float | None = None) -> float:
        """Load control's model of `capacity` alone (`/metrics` shows both)."""
        return sum(self._modelled(mean_tokens).values())

    def _modelled(self, mean_tokens: float | None) -> dict[str, float]:
        """(Given `mean_tokens`, load control's table is not read: `/metrics` asks too.)"""
        tokens = self._mean_tokens if mean_tokens is None else mean_tokens
        instances = list(self.scheduler.instances.items())
        return {iid: self._loads.throughput([i], tokens) for iid, i in instances}


def _view(request: Request, threshold: float, steps: float) -> LoadView:
    """What the time models read of `request`: `steps` left at `threshold`."""
    return LoadView(
        request.request_id, 0.0, request.num_tokens, {threshold: steps},
        request.num_blocks_to_recompute,
    )  # fmt: skip


def _too_late(needed: float, left: float) -> Refusal | None:
    """A refusal when `needed` seconds exceed the `left` before the deadline (it waited too
    long to get here)."""
    if needed <= left:
        return None
    return Refusal(f"it needs at least {needed:.2f} s and {left:.2f} s are left")
