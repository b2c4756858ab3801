"""On-time calibration (an extension): how much longer admitted requests take than admission
predicted, learned from the requests that finished.

Admission (`admission.py`) admits a request when the work ahead of it and its own, at the lowest
threshold, fit its SLO at the cluster's measured throughput: a point estimate. A point estimate
that is right on average is late about half the time, and under overload it is not even right
on average: a request waits for the step in flight, shares batches larger than the profile's
best, and the measured slowdown lags the machine. On the bundled model at 3x capacity, 75% of
the requests admitted that way finished late.

Each admitted request's predicted time to finish is recorded; when it finishes, the ratio of
the time it took to that prediction joins a window of recent ratios. `factor(now)` is the
window's `target` quantile (never below 1): admission multiplies its predicted times by it, so
that a request is admitted only if it would finish in time `target` of the time, going by how
requests fared lately. Admission teaches it only with requests that ran every step at the
lowest threshold, where it priced them (`admission.py`): a request that had room ran at higher
thresholds and took longer by choice. `target` is the one number a user sets: an on-time
probability (a service-level target), not a margin fitted to a trace.

Alg. 1 (threshold selection) keeps a second instance, fed each request's first threshold
choice (`Scheduler.deadline`, `Policy.on_time_target`); admission keeps its own. A request in
flight at a fault or at a stall of the controller (`cluster/stalls.py`) is `void` in both: what
it took is the fault's, and it teaches neither, even if it is priced again later.

An estimate is not a fact (DESIGN.md 7): with no request finishing (nothing admitted, e.g.
because the factor itself refuses everything) the factor decays toward 1 with a half-life, so
admission returns to the plain prediction and the next requests measure again. And with
`age_each` (admission's) each ratio's excess over 1 decays with its own age, at the same
half-life, and the factor is the quantile of the decayed ratios: admission learns only from the
requests that ran at the lowest threshold, and at overload few do, so its window refreshes in a
trickle while everything else is served; unaged, the ratios of a surge long past held the
quantile (admission's factor at 3.5-3.9 for the last 50 s of a 3x overload after a surge at its
start; aged, 1.3-1.7). Alg. 1's calibration learns from every request, so its window is as
fresh as the service; aged too, its factor fell below what the requests took on the training
traces (both: docs/serving/reliability.md, "Admission's factor, held by a surge long past").
Pure bookkeeping: the caller passes the time.
"""

from __future__ import annotations

from collections import deque

import numpy as np

ON_TIME_TARGET = 0.95  # the share of admitted requests meant to finish within their SLO
WINDOW = 64  # finished requests whose ratios are kept (the latest): a few seconds at load
MIN_EVIDENCE = 16  # ratios needed before the quantile is used (a few say little)
HALF_LIFE = 10.0  # seconds without a finished request for the factor to halve toward 1
MAX_PENDING = 100_000  # predictions kept for requests in flight (a backstop)


class OnTimeCalibration:
    def __init__(
        self,
        target: float = ON_TIME_TARGET,
        window: int = WINDOW,
        half_life: float = HALF_LIFE,
        min_evidence: int = MIN_EVIDENCE,
        age_each: bool = False,
    ):
        if not 0.0 < target < 1.0:
            raise ValueError(f"{target=} must be in (0, 1)")
        if window < 1 or half_life <= 0 or min_evidence < 1:
            raise ValueError(f"{window=}, {half_life=} and {min_evidence=} must be positive")
        self.target = target
        self.half_life = half_life
        self.min_evidence = min_evidence
        self.age_each = age_each  # each ratio decays by its own age (admission's)
        self._ratios: deque[float] = deque(maxlen=window)
        self._measured_at: deque[float] = deque(maxlen=window)  # when each ratio was measured
        self._pending: dict[str, tuple[float, float]] = {}  # id -> (admitted at, predicted s)
        self._void: set[str] = set()  # in flight, and never to teach (`void`)
        self._quantile = 1.0  # of the window, as of the last finished request
        self._low = 1.0  # its (1 - target) quantile: what the luckiest requests took
        self._last = 0.0  # when the last request finished
        self.finished = 0  # requests measured
        self.late = 0  # of them, later than predicted times the factor then in force

    def admitted(self, request_id: str, predicted_seconds: float, now: float) -> None:
        """A request was admitted (or its threshold chosen) at `now`, predicted to finish in
        `predicted_seconds`. (A void request is not recorded.)"""
        if request_id in self._void:
            return
        if predicted_seconds > 0 and len(self._pending) < MAX_PENDING:
            self._pending[request_id] = (now, predicted_seconds)

    def forget(self, request_id: str) -> None:
        """A request ended without finishing (cancelled, failed): nothing to learn."""
        self._pending.pop(request_id, None)
        self._void.discard(request_id)

    def void(self, request_ids) -> None:
        """These requests (in flight, or yet to come) teach nothing, until they end: a fault
        or a stall of the controller delayed them (`cluster/stalls.py`)."""
        for request_id in request_ids:
            self._pending.pop(request_id, None)
            self._void.add(request_id)

    def finished_at(self, request_id: str, now: float) -> None:
        """A request finished at `now`: its time against its prediction joins the window."""
        self._void.discard(request_id)
        admitted = self._pending.pop(request_id, None)
        if admitted is None:
            return
        at, predicted = admitted
        ratio = (now - at) / predicted
        self.late += ratio > self.factor(now)
        self.finished += 1
        self._ratios.append(ratio)
        self._measured_at.append(now)
        self._last = now
        if len(self._ratios) >= self.min_evidence:
            ordered = np.sort(self._decayed(now)).tolist()
            self._quantile = linear_quantile(ordered, self.target)
            self._low = linear_quantile(ordered, 1 - self.target)

    def _decayed(self, now: float) -> np.ndarray:
        """The window's ratios; with `age_each`, each one's excess over 1 decayed by its age."""
        ratios = np.fromiter(self._ratios, float, len(self._ratios))
        if not self.age_each:
            return ratios
        age = now - np.fromiter(self._measured_at, float, len(self._measured_at))
        return 1.0 + (ratios - 1.0) * 0.5 ** (age / self.half_life)

    def factor(self, now: float) -> float:
        """How many times its predicted time admission should allow a request (>= 1): the
        window's `target` quantile of taken over predicted time (with `age_each`, of the ratios
        decayed by their ages at the last finish), decayed toward 1 by how long no request has
        finished. (Decay is one monotone map of every ratio, so with `age_each` this is the
        quantile of the ratios decayed to `now`.)"""
        excess = max(self._quantile - 1.0, 0.0)
        idle = max(now - self._last, 0.0)
        return 1.0 + excess * 0.5 ** (idle / self.half_life)

    def low_factor(self, now: float) -> float:
        """The window's (1 - `target`) quantile of taken over predicted time, decayed toward 1
        as `factor` is: a request whose prediction times this misses its deadline misses it with
        probability `target`, going by how requests fared lately (`lost_work.py`)."""
        idle = max(now - self._last, 0.0)
        return 1.0 + (self._low - 1.0) * 0.5 ** (idle / self.half_life)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    @property
    def pending(self) -> int:
        return len(self._pending)


def linear_quantile(ordered: list[float], q: float) -> float:
    """The `q` quantile of values sorted ascending, as `np.quantile`'s default (linear) method
    computes it, to the bit, without its 150 us of setup a call (one call per finished
    request: about 2% of the compiled 2-hour simulation)."""
    last = len(ordered) - 1
    at = last * q  # in [0, last] for q in [0, 1]
    below = int(at)  # (at >= 0: int() is floor)
    a, b = ordered[below], ordered[min(below + 1, last)]
    t = at - below
    # numpy's lerp: from the nearer end, so that t = 1 gives b exactly
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t
