"""What the dashboard draws: bounded per-interval series of a run, live or simulated.

Time is a parameter (seconds since the run began); this module reads no clock. Each interval
(`interval` seconds, the last `keep` of them) holds the requests that finished in it (count, on
time, per priority, a log-binned latency histogram, the thresholds of their steps, tokens), the
steps each instance ran (count, batch tokens, engine seconds by step kind), and the largest
queue, requests in flight, measured step slowdown (live runs) and instances per TP degree
sampled in it. Attainment is given of the requests finished and of every request answered
(refused ones count as missed: the headline). Memory and the cost of
`to_json` depend on `keep` and the number of instances, never on the number of requests; a
request costs O(its steps) once, when it finishes.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

THRESHOLD_EDGES = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)  # as /metrics' histogram ("le")
LATENCY_FLOOR = 1e-3  # seconds: the first latency bin
LATENCY_RATIO = 1.05  # each latency bin is 5% wider than the last: percentiles within 2.5%
MAX_PRIORITIES = 8  # priorities drawn apart; any further ones are drawn together as "other"
MAX_EVENTS = 200  # reconfigurations and failures kept for the time axis
PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class _Steps:
    """One instance's steps in one interval."""

    num_steps: int = 0
    batch_tokens: int = 0
    by_kind: dict[str, list[float]] = field(default_factory=dict)  # kind -> [count, seconds]


@dataclass(slots=True)
class _Interval:
    start: float
    finished: int = 0
    met: int = 0
    failed: int = 0
    rejected: int = 0
    tokens: int = 0
    migrations: int = 0
    by_priority: dict[str, list[int]] = field(default_factory=dict)  # -> [finished, met]
    latency_bins: dict[int, int] = field(default_factory=dict)
    thresholds: list[int] = field(default_factory=lambda: [0] * len(THRESHOLD_EDGES))
    steps: dict[str, _Steps] = field(default_factory=dict)
    queue: int = 0
    in_flight: int = 0
    slowdown: float | None = None  # the largest measured step slowdown sampled (live runs)
    instances_by_tp: dict[int, int] | None = None
    percentiles: tuple | None = None  # memoised once the interval is closed


class Timeline:
    """A run's last `keep` intervals of `interval` seconds, fed in time order."""

    def __init__(self, interval: float = 2.0, keep: int = 300):
        if interval <= 0:
            raise ValueError(f"{interval=} must be positive (seconds)")
        if keep < 1:
            raise ValueError(f"{keep=} must be at least 1 (intervals)")
        self.interval = interval
        self.intervals: deque[_Interval] = deque(maxlen=keep)
        self.events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self.instance_tp: dict[str, int] = {}  # instances serving now
        self.priorities: list[str] = []
        self.totals = dict.fromkeys(
            ("finished", "met", "failed", "rejected", "tokens", "migrations"), 0
        )
        self.last = {"queue": 0, "in_flight": 0, "slowdown": None, "deadline_factor": None,
                     "quality_loss": None, "quality_budget": None}  # fmt: skip
        self._by_tp: dict[int, int] = {}

    # -- what happened ----------------------------------------------------------------------

    def request_done(
        self, now: float, latency: float | None, met: bool, priority: int, thresholds, tokens: int
    ) -> None:
        """A request finished (`latency` None: it was still running when the run ended)."""
        w = self._at(now)
        w.finished += 1
        w.met += met
        w.tokens += tokens
        counts = w.by_priority.setdefault(self._priority_name(priority), [0, 0])
        counts[0] += 1
        counts[1] += met
        if latency is not None:
            b = _latency_bin(latency)
            w.latency_bins[b] = w.latency_bins.get(b, 0) + 1
        for threshold in thresholds:
            w.thresholds[_threshold_bin(threshold)] += 1
        self.totals["finished"] += 1
        self.totals["met"] += met
        self.totals["tokens"] += tokens

    def request_failed(self, now: float) -> None:
        self._at(now).failed += 1
        self.totals["failed"] += 1

    def request_rejected(self, now: float) -> None:
        """A request refused at admission (over capacity, or shutting down)."""
        self._at(now).rejected += 1
        self.totals["rejected"] += 1

    def step_done(
        self, now: float, instance_id: str, kind: str, batch_tokens: int, seconds: float
    ) -> None:
        s = self._at(now).steps.setdefault(instance_id, _Steps())
        s.num_steps += 1
        s.batch_tokens += batch_tokens
        count_seconds = s.by_kind.setdefault(kind, [0, 0.0])
        count_seconds[0] += 1
        count_seconds[1] += seconds

    def sample(
        self,
        now: float,
        queue: int,
        in_flight: int,
        slowdown: float | None = None,
        deadline_factor: float | None = None,
        quality: tuple[float, float] | None = None,
    ) -> None:
        """The queue length, requests in flight, (a live server's) measured step slowdown now,
        the one admission prices at (each interval keeps its largest), Alg. 1's calibrated
        factor (`control/on_time.py`; None: the policy has none), and the quality budget's
        (loss read, budget) (`control/quality_budget.py`; None: none is kept)."""
        w = self._at(now)
        w.queue = max(w.queue, queue)
        w.in_flight = max(w.in_flight, in_flight)
        if slowdown is not None:
            w.slowdown = slowdown if w.slowdown is None else max(w.slowdown, slowdown)
        self.last = {
            "queue": queue,
            "in_flight": in_flight,
            "slowdown": slowdown,
            "deadline_factor": deadline_factor,
            "quality_loss": None if quality is None else round(quality[0], 5),
            "quality_budget": None if quality is None else quality[1],
        }

    def set_instances(self, now: float, instance_tp: dict[str, int]) -> None:
        """The instances serving from `now` on, with their TP degrees."""
        self.instance_tp = dict(instance_tp)
        by_tp: dict[int, int] = {}
        for tp in instance_tp.values():
            by_tp[tp] = by_tp.get(tp, 0) + 1
        self.set_tp_mix(now, by_tp)

    def set_tp_mix(self, now: float, by_tp: dict[int, int]) -> None:
        """Instances per TP degree from `now` on (where single instances are not known)."""
        self._by_tp = dict(by_tp)
        self._at(now).instances_by_tp = dict(by_tp)

    def migrated(self, now: float, count: int = 1) -> None:
        self._at(now).migrations += count
        self.totals["migrations"] += count

    def event(self, now: float, kind: str, text: str) -> None:
        """A reconfiguration, an instance failure, ...: a mark on the time axis."""
        self.events.append({"t": round(now, 3), "kind": kind, "text": text})

    # -- intervals --------------------------------------------------------------------------

    def _at(self, now: float) -> _Interval:
        """The interval holding `now`; empty ones fill any gap (at most `keep` of them)."""
        start = math.floor(now / self.interval) * self.interval
        if self.intervals and start <= self.intervals[-1].start:
            return self.intervals[-1]  # (a late report lands in the newest interval)
        if self.intervals:
            gap = round((start - self.intervals[-1].start) / self.interval) - 1
            first = start - min(gap, self.intervals.maxlen) * self.interval
            for k in range(min(gap, self.intervals.maxlen)):
                self.intervals.append(self._new(first + k * self.interval))
        self.intervals.append(self._new(start))
        return self.intervals[-1]

    def _new(self, start: float) -> _Interval:
        return _Interval(round(start, 6), instances_by_tp=dict(self._by_tp))

    def _priority_name(self, priority: int) -> str:
        name = str(priority)
        if name in self.priorities:
            return name
        if len(self.priorities) < MAX_PRIORITIES:
            self.priorities.append(name)
            return name
        return "other"

    # -- the page's data --------------------------------------------------------------------

    def to_json(self, now: float, meta: dict) -> dict:
        """The data shape the page draws; `meta`: title, source, model, policy, calibration,
        slo_s (None where requests carry their own), ..."""
        self._at(now)  # the axis reaches now even when nothing happens
        windows = list(self.intervals)
        for w in windows[:-1]:
            if w.percentiles is None:
                w.percentiles = _percentiles(w.latency_bins)
        finished, asked = self.totals["finished"], self.totals["finished"] + self.totals["rejected"]
        return {
            "schema": 1,
            **meta,
            "now": round(now, 3),
            "interval": self.interval,
            "threshold_edges": list(THRESHOLD_EDGES),
            "totals": {
                **self.totals,
                "attainment": round(self.totals["met"] / finished, 4) if finished else None,
                # the headline: refused requests count as missed
                "attainment_of_arrivals": _share(self.totals["met"], asked),
            },
            "current": {**self.last, "instances": self._current_instances(windows)},
            "series": self._series(windows),
            "instances": {iid: self._instance_series(iid, windows) for iid in _ids(windows)},
            "events": list(self.events),
        }

    def _series(self, windows: list[_Interval]) -> dict:
        last = windows[-1]
        pct = [w.percentiles or _percentiles(w.latency_bins) for w in windows[:-1]]
        pct.append(_percentiles(last.latency_bins))
        tps = sorted({tp for w in windows for tp in (w.instances_by_tp or {})})
        names = list(self.priorities)
        if any("other" in w.by_priority for w in windows):
            names.append("other")
        return {
            "t": [w.start for w in windows],
            "finished": [w.finished for w in windows],
            "failed": [w.failed for w in windows],
            "rejected": [w.rejected for w in windows],
            "attainment": [_share(w.met, w.finished) for w in windows],
            "attainment_of_arrivals": [_share(w.met, w.finished + w.rejected) for w in windows],
            "attainment_by_priority": {p: [_priority_share(w, p) for w in windows] for p in names},
            **{f"latency_p{q}": [p[k] for p in pct] for k, q in enumerate(PERCENTILES)},
            "thresholds": [list(w.thresholds) for w in windows],
            "tokens_per_s": [round(w.tokens / self.interval, 2) for w in windows],
            "queue": [w.queue for w in windows],
            "in_flight": [w.in_flight for w in windows],
            "slowdown": [None if w.slowdown is None else round(w.slowdown, 3) for w in windows],
            "migrations": [w.migrations for w in windows],
            "instances_by_tp": {
                str(tp): [(w.instances_by_tp or {}).get(tp, 0) for w in windows] for tp in tps
            },
        }

    def _instance_series(self, iid: str, windows: list[_Interval]) -> dict:
        kinds = sorted({k for w in windows if iid in w.steps for k in w.steps[iid].by_kind})
        steps = [w.steps.get(iid) for w in windows]
        return {
            "tp": self.instance_tp.get(iid),
            "serving": iid in self.instance_tp,
            "steps": [s.num_steps if s else 0 for s in steps],
            "batch_tokens": [round(s.batch_tokens / s.num_steps, 1) if s else None for s in steps],
            "step_ms": {k: [_mean_ms(s, k) for s in steps] for k in kinds},
        }

    def _current_instances(self, windows: list[_Interval]) -> list[dict]:
        """Each serving instance's TP degree and its latest interval with steps."""
        out = []
        for iid, tp in sorted(self.instance_tp.items()):
            latest = next((w.steps[iid] for w in reversed(windows) if iid in w.steps), None)
            kinds = sorted(latest.by_kind) if latest else []
            out.append(
                {
                    "id": iid,
                    "tp": tp,
                    "batch_tokens": round(latest.batch_tokens / latest.num_steps, 1)
                    if latest
                    else None,
                    "step_ms": {k: _mean_ms(latest, k) for k in kinds},
                }
            )
        return out


def _ids(windows: list[_Interval]) -> list[str]:
    return sorted({iid for w in windows for iid in w.steps})


def _share(met: int, finished: int) -> float | None:
    return round(met / finished, 4) if finished else None


def _priority_share(w: _Interval, priority: str) -> float | None:
    finished, met = w.by_priority.get(priority, (0, 0))
    return _share(met, finished)


def _mean_ms(steps: _Steps | None, kind: str) -> float | None:
    if steps is None or kind not in steps.by_kind:
        return None
    count, seconds = steps.by_kind[kind]
    return round(1000 * seconds / count, 3)


def _threshold_bin(threshold: float) -> int:
    """The histogram bucket of a threshold: the first edge at or above it ("le")."""
    return min(bisect_left(THRESHOLD_EDGES, threshold), len(THRESHOLD_EDGES) - 1)


def _latency_bin(seconds: float) -> int:
    if seconds <= LATENCY_FLOOR:
        return 0
    return int(math.log(seconds / LATENCY_FLOOR) / math.log(LATENCY_RATIO)) + 1


def _bin_value(b: int) -> float:
    """A bin's middle in seconds (bin 0: at most the floor)."""
    return LATENCY_FLOOR if b == 0 else LATENCY_FLOOR * LATENCY_RATIO ** (b - 0.5)


def _percentiles(bins: dict[int, int]) -> tuple:
    """p50, p90, p99 of a binned histogram (None for each when it is empty)."""
    total = sum(bins.values())
    if not total:
        return (None,) * len(PERCENTILES)
    out, seen, ordered = [], 0, sorted(bins.items())
    k = 0
    for q in PERCENTILES:
        rank = math.ceil(q / 100 * total)
        while seen + ordered[k][1] < rank:
            seen += ordered[k][1]
            k += 1
        out.append(round(_bin_value(ordered[k][0]), 4))
    return tuple(out)
