"""The workload monitor: arrivals grouped into classes by input and output size (papers.md 1.8).

Each arrival falls into a class keyed by (input-size bucket, output-size bucket, SLO). Over a
sliding window the monitor reports each class's arrival rate, times a safety buffer above the
observed rate, with the class's mean prompt and output lengths: the `WorkloadClass`es the Stage-1
planner sizes the cluster for. Pure bookkeeping: the caller passes the time.

The paper gives the buffer no value ("slightly above observed"). With `trend` (the planner's
default, `PlannerConfig.rate_trend`) it also carries the load's rise: a plan made now serves
until the next round, so a rate observed over the last window is low all through a climb, and a
cluster moved to a few wide instances in the morning met the day's peak before the planner saw
it (docs/simulator/paper-figures.md). The rise is the second half-window's arrivals over the
first's, projected to the middle of the next window; a steady or falling load keeps the flat
buffer.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

DEFAULT_INPUT_EDGES = (128, 256, 512, 1024, 2048)  # tokens; a bucket is [edge_i, edge_i+1)
DEFAULT_OUTPUT_EDGES = (64, 128, 256, 512)
MIN_SLO = 0.001  # seconds: SLO classes are kept to the millisecond; a request admitted at or past
# its deadline, or with a sub-millisecond SLO, falls in the tightest class (never zero or less)


@dataclass(frozen=True, slots=True)
class WorkloadClass:
    prompt_len: float  # P_k, mean prompt tokens
    output_len: float  # O_k, mean output window tokens
    rate: float  # RPS_k, requests per second (safety buffer included)
    slo: float  # seconds

    def __post_init__(self):
        if self.output_len <= 0 or self.prompt_len < 0:
            raise ValueError(f"{self}: lengths must be positive")
        if self.rate < 0 or self.slo <= 0:
            raise ValueError(f"{self}: rate must be >= 0 and slo > 0")

    @property
    def num_tokens(self) -> float:
        return self.prompt_len + self.output_len


@dataclass(frozen=True, slots=True)
class _Arrival:
    time: float
    key: tuple[int, int, float]
    prompt_len: int
    output_len: int


class WorkloadMonitor:
    def __init__(
        self,
        window: float = 300.0,
        safety: float = 1.1,
        input_edges: tuple[int, ...] = DEFAULT_INPUT_EDGES,
        output_edges: tuple[int, ...] = DEFAULT_OUTPUT_EDGES,
        trend: bool = False,
    ):
        if window <= 0:
            raise ValueError(f"{window=} must be positive")
        if safety < 1:
            raise ValueError(f"{safety=} must be at least 1 (a buffer above the observed rate)")
        self.window, self.safety, self.trend = window, safety, trend
        self.input_edges, self.output_edges = tuple(input_edges), tuple(output_edges)
        self._arrivals: deque[_Arrival] = deque()
        self._first: float | None = None

    def record(self, now: float, prompt_len: int, output_len: int, slo: float) -> None:
        key = (
            bisect.bisect_right(self.input_edges, prompt_len),
            bisect.bisect_right(self.output_edges, output_len),
            max(round(slo, 3), MIN_SLO),
        )
        self._arrivals.append(_Arrival(now, key, prompt_len, output_len))
        if self._first is None:
            self._first = now

    def classes(self, now: float) -> list[WorkloadClass]:
        """The classes seen in the last window, rates over the window (or the time observed so
        far, when shorter), ordered by bucket."""
        while self._arrivals and self._arrivals[0].time < now - self.window:
            self._arrivals.popleft()
        if not self._arrivals:
            return []
        first = now if self._first is None else self._first  # set with the first arrival
        span = max(min(self.window, now - first), 1.0)
        groups: dict[tuple[int, int, float], list[_Arrival]] = {}
        for a in self._arrivals:
            groups.setdefault(a.key, []).append(a)
        buffer = self.safety * (self.growth(now, span) if self.trend else 1.0)
        return [
            WorkloadClass(
                prompt_len=sum(a.prompt_len for a in group) / len(group),
                output_len=sum(a.output_len for a in group) / len(group),
                rate=buffer * len(group) / span,
                slo=key[2],
            )
            for key, group in sorted(groups.items())
        ]

    def growth(self, now: float, span: float) -> float:
        """How much the load rises from the window's middle to the middle of the next window
        (never below 1): the second half's arrivals over the first half's, squared."""
        middle = now - span / 2
        early = bisect.bisect_left(self._arrivals, middle, key=lambda a: a.time)
        recent = len(self._arrivals) - early
        return max(1.0, recent / early) ** 2 if early else 1.0
