"""Admission's predicted time of a request as the instances run it: batched (an extension).

Admission (`admission.py`) priced a request like a queue: the load ahead of it, drained at the
cluster's throughput. The instances do not run a queue: every request in flight shares each
step of its instance's batch, the ones admitted after it too, and a request is done after its
own steps, each at the latency of the batch it shares. On a virtual closed loop (32 clients,
two instances) requests took 3.61x the queue's prediction at the median, and admission's
on-time factor, which corrects that, was learnt at saturation and then stood after a fault
(docs/serving/reliability.md).

Here a request's time is its own predicted steps, at the lowest threshold, each priced by the
latency profile at the batch it will share (`thresholds.step_seconds`), times the measured
slowdown (`speed.py`). That batch is the requests in flight now, the newcomer included, spread
evenly over the instances serving: in a steady state (a closed loop, or an open one at a steady
admitted rate, by Little's law) the requests that finish during its life are replaced by as
many that arrive, so the batch it finds is the batch it keeps. What the steady state leaves out,
the requests admitted after it, admission bounds itself: it admits a newcomer only if none of
the requests in flight that would finish in time at the batch they share now would be late in
the batch one larger (`late`). An instance runs at most `max_batch_tokens` of sequence tokens a
step; requests beyond that many wait their turn, which stretches each one's time by the excess.
When an instance dies the same requests spread over fewer, and the prediction itself grows: no
factor learnt before the fault has to stand in for it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from dilaserve.control.thresholds import InstanceLoad, LoadView, seconds_left, step_seconds

AHEAD = (0, 1, 3, 7, 15, 31, 63, 127, 255, 511)  # requests ahead of a newcomer the `Room` has
# a scale for (an idle cluster's burst: every request of it but the first is ahead of others)
MOST_AHEAD = 512  # newcomers the `Room` tries; if that many are taken, it counts no limit
# (at 64 a burst's front let through about 350 where the requests in flight took about 250;
# at 512 a SIGSTOPped worker's transient refused requests until `BatchedTime.in_flight` left
# out the running step and the lost waiting for a replacement: docs/serving/reliability.md)
UNLIMITED = 2**62  # (`tolerated`: no limit)


@dataclass(frozen=True)
class InFlight:
    """The requests in flight as a newcomer shares the batches with them
    (`BatchedTime.in_flight`)."""

    steps: np.ndarray  # steps left at the lowest threshold
    recompute: np.ndarray  # of them, recompute (boundary) steps
    tokens: float  # their tokens in all
    left: np.ndarray  # seconds to their deadlines over the on-time factor (`_left`)
    running: np.ndarray  # 1 where one of its steps runs now (a newcomer joins those after)

    @property
    def count(self) -> int:
        return len(self.steps)


@dataclass(frozen=True)
class _Baseline:
    """What `late` compares against, however many are added: each request's time at the batch
    it shares now, and its steps after the running one (with their recompute steps and time)."""

    now: np.ndarray
    after: np.ndarray
    recompute: np.ndarray
    after_now: np.ndarray

    @classmethod
    def of(cls, model: BatchedTime, flight: InFlight) -> _Baseline:
        pair = model.step_seconds(flight.count, flight.tokens)
        after = np.maximum(flight.steps - flight.running, 0.0)
        recompute = np.minimum(flight.recompute, after)
        now = model._times(flight.steps, flight.recompute, pair)
        return cls(now, after, recompute, model._times(after, recompute, pair))


class BatchedTime:
    def __init__(self, scheduler, restoring=lambda: False):
        self.scheduler = scheduler  # control.scheduler.Scheduler (profile, instances, speed)
        self.restoring = restoring  # () -> is an instance starting to restore lost capacity?

    def step_seconds(self, requests: int, tokens: float) -> tuple[float, float]:
        """(inner, boundary) seconds a step takes a request, at the measured speed, with
        `requests` in flight of `tokens` in all spread evenly over the instances: on the
        fastest kind of instance, a turn's wait included where a step cannot run them all
        ((0, 0): no instance)."""
        instances = list(self.scheduler.instances.values())
        if not instances or requests < 1:
            return 0.0, 0.0
        each = requests / len(instances)
        per_request = max(tokens / requests, 1.0)
        costs, profile = self.scheduler.config.costs, self.scheduler.profile
        best = (float("inf"), float("inf"))
        for tp, limit in {(i.tp, i.max_batch_tokens) for i in instances}:
            fits = max(limit // per_request, 1.0)  # requests a step runs at most
            batch = min(each, fits)
            load = InstanceLoad(tp, round(batch * per_request), max(round(batch), 1))
            turns = max(each / fits, 1.0)  # the rest wait their turn
            pair = tuple(s * turns for s in step_seconds(load, profile, costs))
            best = min(best, pair, key=sum)
        slowdown = self.scheduler.speed.slowdown
        return best[0] * slowdown, best[1] * slowdown

    def seconds(self, view: LoadView, threshold: float, count: int, tokens: float) -> float:
        """Seconds `view` (a newcomer) needs at `threshold`, sharing the batch with `count`
        requests in flight of `tokens` in all."""
        pair = self.step_seconds(count + 1, tokens + view.num_tokens)
        return seconds_left(view.steps_left[threshold], view.recompute_steps_left, pair)

    def in_flight(self, rows, now: float, factor: float) -> InFlight:
        """The requests in flight (`rows`: `LoadTable.lowest_rows`) as a newcomer would share
        the batches with them, their seconds left over the on-time `factor`. While an
        instance starts to restore lost capacity (`restoring`), a lost request that waits
        holding no instance is left out: it goes only to an instance holding no request still
        on time (`lost_work.py`), the new one (after a SIGSTOPped worker was replaced, 90 of
        them priced as sharing the one instance left refused every newcomer:
        docs/serving/reliability.md). Else it is counted: in an overload the lost wait for an
        instance to hold only them, and newcomers then share it with them (left out, 5x
        capacity on the virtual clock admitted 445 and served 221 on time, against 369 and
        243)."""
        ids, steps, recompute, tokens = rows
        instances, held = self.scheduler.instances, self._held(now)
        elsewhere = self.restoring()
        keep = np.ones(len(ids), dtype=bool)
        left, running = np.empty(len(ids)), np.zeros(len(ids))
        for k, rid in enumerate(ids):
            t = self.scheduler.requests[rid]
            keep[k] = not (elsewhere and t.lost and t.instance is None)
            left[k] = _left(t, now, held)
            home = instances.get(t.instance) if t.instance is not None else None
            running[k] = home is not None and home.busy and rid in home.running
        steps = steps[keep]
        return InFlight(
            steps,
            np.minimum(recompute[keep], steps),
            float(tokens[keep].sum()),
            left[keep] / factor,
            running[keep],
        )

    def _held(self, now: float) -> set[str]:
        """The instances whose running step is overdue (a fault holds their requests)."""
        speed = self.scheduler.speed
        return {
            iid
            for iid, inst in self.scheduler.instances.items()
            if inst.stalled or inst.overdue(now, speed.instance_ratio(iid))
        }

    def late(self, flight: InFlight, added: int, added_tokens: float) -> int:
        """Of the requests in `flight`, how many that finish in time now would not with
        `added` more requests of `added_tokens` in all. A newcomer joins the steps after
        each one's running step: a request in its last step is not made later (protected, a
        request finishing its last step at the edge of its deadline closed admission until
        that step ended)."""
        return self._late(flight, _Baseline.of(self, flight), added, added_tokens)

    def tolerated(self, flight: InFlight) -> int:
        """How many more requests of the mean size the requests in `flight` take (as `late`
        counts them), found up to `MOST_AHEAD` (a bisection: more make more late); past it,
        no limit (a very large count: the `Room` leaves the rest to admission in full)."""
        mean = flight.tokens / flight.count if flight.count else 0.0
        base = _Baseline.of(self, flight)  # (the same for every count tried)
        low, high = 0, MOST_AHEAD + 1  # low are taken; high are not (or past the range)
        while high - low > 1:
            middle = (low + high) // 2
            if self._late(flight, base, middle, middle * mean):
                high = middle
            else:
                low = middle
        return low if low < MOST_AHEAD else UNLIMITED

    def _late(self, flight: InFlight, base: _Baseline, added: int, added_tokens: float) -> int:
        pair = self.step_seconds(flight.count + added, flight.tokens + added_tokens)
        added_time = self._times(base.after, base.recompute, pair) - base.after_now
        late = (base.now <= flight.left) & (base.now + added_time > flight.left)
        return int(np.count_nonzero(late))

    @staticmethod
    def _times(steps: np.ndarray, recompute: np.ndarray, pair: tuple[float, float]):
        return (steps - recompute) * pair[0] + recompute * pair[1]

    def scales(
        self, count: int, per_request: float, threshold: float, steps: float
    ) -> tuple[float, ...]:
        """How many times its time alone at the profile's speed a one-block request of
        `per_request` tokens (the mean) and `steps` steps takes as the newcomer after 0, 1, 3,
        7, ... (`AHEAD`) more such requests not priced yet, beside `count` in flight (`Room`:
        the front prices a request by the least seconds per block seen alone, times the entry
        for the requests ahead of it, at or below their count)."""
        view = LoadView("", 0.0, round(per_request), {threshold: steps}, 1)
        alone = self.seconds(view, threshold, 0, 0.0) / self.scheduler.speed.slowdown
        if alone <= 0:
            return ()
        return tuple(
            self.seconds(view, threshold, count + ahead, per_request * (count + ahead)) / alone
            for ahead in AHEAD
        )


def _left(t, now: float, held: set[str]) -> float:
    """Seconds to the deadline of the scheduler's record `t` (inf: none) that a newcomer could
    take from it; -inf (a newcomer makes it no later) where its instance's running step is
    overdue (`InstanceState.overdue`): a fault holds it, and no refusal brings that step's end
    nearer (protected, a SIGSTOPped worker's request reached its deadline still priced as on
    time, and every newcomer was refused while it crossed it)."""
    if t.instance in held:
        return -np.inf
    deadline = t.request.deadline
    return np.inf if deadline is None else deadline - now


def scale_at(scales: tuple[float, ...], ahead: int) -> float:
    """The scale (`scales`, one per count of `AHEAD`) of a newcomer behind `ahead` requests:
    linear between the counts of `AHEAD` (a batch's time grows about linearly with its size
    there), and along the last two past the last. (The largest count at or below `ahead` priced
    a burst of 400 as one of 255.) In plain Python: the HTTP front asks it of every request,
    and `np.interp` lets go of the interpreter's lock, then waits to take it back from the
    controller's thread (0.24 ms a call beside a busy thread, against 0.002 ms here)."""
    ahead = max(ahead, 0)
    if ahead >= AHEAD[-1]:
        slope = (scales[-1] - scales[-2]) / (AHEAD[-1] - AHEAD[-2])
        return scales[-1] + slope * (ahead - AHEAD[-1])
    i = bisect.bisect_right(AHEAD, ahead) - 1
    slope = (scales[i + 1] - scales[i]) / (AHEAD[i + 1] - AHEAD[i])
    return slope * (ahead - AHEAD[i]) + scales[i]  # (as np.interp: the same value)
