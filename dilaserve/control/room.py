"""Admission's answer between events (`admission.py`): what the HTTP front refuses at once,
before tokenizing or queueing for the controller."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dilaserve.control.batched_time import scale_at

RECENT = 64  # requests priced whose cost per block `RecentPrices` keeps (the latest)
MIN_RECENT = 16  # of them, before the least of them is used


@dataclass(frozen=True)
class Room:
    """Admission's answer between events, for requests that come after everything in flight:
    `refuses(priority, slo)` without asking the controller (the HTTP front asks it of each
    request before reading its prompt). A request at or below the lowest priority in flight is
    refused when the capacity over its SLO (`slo` seconds; default: the server's), less the
    load in flight at the lowest threshold, is below the least any request adds (one step over
    one block); others are asked in full. With the batched time model (`scales` set) it is
    refused instead when its least time per block alone, times its blocks and the scale for
    the requests ahead of it, exceeds its SLO, or when the requests in flight take fewer
    newcomers (`fits`) than it and those ahead. Either way its SLO is less the time it waits
    for those ahead to be admitted (`pace` each), and it is refused when that wait is longer
    than `most_wait`: a request let through waits that long for admission's answer, and if
    admission refuses it then, its 429 came that late (docs/serving/reliability.md, "The
    refusals that waited for admission"). With nothing in flight it refuses nothing but,
    with the batched model, a request behind others not priced yet (a burst at an idle
    server), priced as if those were in flight. A request that asks for more output blocks
    than any of the latest priced is asked in full: its price is the room's least per block,
    which tells a request no idle cluster serves (admission's 400) from one the load refuses
    (a 429) only within the lengths it was learnt from."""

    lowest_priority: float = float("inf")  # in flight (+inf: nothing is)
    throughput: float = float("inf")  # token-steps per second, at the measured speed, over
    # the on-time factor (`on_time.py`): what admission counts on
    load: float = 0.0  # token-steps in flight, at the lowest threshold
    least: float = 0.0  # the least load a request adds
    slo: float = float("inf")  # the server's default SLO, seconds
    least_per_block: float = 0.0  # of the latest requests priced, the least load per block
    block_len: int = 1  # output tokens per block
    # the batched time model (`batched_time.py`; none: the queue's): of the latest requests
    # priced, the least seconds per block alone at the profile's speed; and the times that a
    # newcomer takes in the batch, after `batched_time.AHEAD` requests not priced yet (the
    # measured slowdown and the on-time factor included)
    alone_per_block: float = 0.0
    scales: tuple[float, ...] = ()
    fits: int = 0  # (batched) newcomers the requests in flight take (`tolerated`)
    most_blocks: float = float("inf")  # the most output blocks of the latest requests priced
    # seconds each request ahead delays a newcomer's pricing (the controller's `Pace`): its
    # SLO counts from its arrival, and it waits for those ahead to be admitted first
    pace: float = 0.0
    most_wait: float = float("inf")  # seconds a newcomer may wait for those ahead (`pace` each)

    @property
    def spare(self) -> float:
        """Token-steps left over the server's SLO (what a request of that SLO finds)."""
        return self.spare_within(self.slo)

    def spare_within(self, seconds: float) -> float:
        return self.throughput * seconds - self.load

    def refuses(
        self,
        priority: int,
        slo: float | None = None,
        max_tokens: int | None = None,
        ahead: int = 0,
    ):
        """`max_tokens`: the answer's length at most (None: one block, the least). `ahead`:
        requests queued for admission, not priced yet (each counted at the least a one-block
        request adds, and `pace` seconds of its SLO): they come before this one."""
        if priority > self.lowest_priority:
            return False  # served before everything in flight: asked in full
        if self.lowest_priority == float("inf") and not (ahead and self.scales):
            return False  # nothing in flight or ahead (a probe), or no model of a burst
        blocks = 1 if max_tokens is None else max(-(-max_tokens // self.block_len), 1)
        if blocks > self.most_blocks:
            return False  # longer than any priced lately: perhaps one no idle cluster serves
        if ahead * self.pace > self.most_wait:
            return True  # it would wait too long for an answer, which may be a refusal
        slo = (self.slo if slo is None else slo) - ahead * self.pace
        if self.scales:
            late = ahead + 1 > self.fits
            return late or self.alone_per_block * blocks * scale_at(self.scales, ahead) > slo
        least = max(self.least, self.least_per_block * blocks)
        unpriced = ahead * max(self.least, self.least_per_block)
        return self.spare_within(slo) < least + unpriced


class RecentPrices:
    """What the latest `RECENT` requests priced cost per output block, of which the `Room`
    prices a newcomer by the least (once `MIN_RECENT` are kept): their load (token-steps)
    and, with the batched time model, their seconds alone at the profile's speed and steps;
    and the most output blocks of them. Every request priced teaches it, a probe too: served
    one at a time, requests left the room without a model of a burst, and it let an idle
    server's whole burst through to be refused in full (docs/serving/reliability.md)."""

    def __init__(self):
        self._load: deque[float] = deque(maxlen=RECENT)
        self._alone: deque[tuple[float, float]] = deque(maxlen=RECENT)
        self._blocks: deque[int] = deque(maxlen=RECENT)

    def learn(self, blocks: int, load: float, alone: tuple[float, float] | None = None) -> None:
        """A request of `blocks` output blocks priced at `load`, and (batched) `alone`:
        (seconds alone at the profile's speed, steps)."""
        self._load.append(load / blocks)
        self._blocks.append(blocks)
        if alone is not None:
            self._alone.append((alone[0] / blocks, alone[1] / blocks))

    @property
    def least_load(self) -> float:
        """The least load per block (0: too few priced)."""
        return min(self._load) if len(self._load) >= MIN_RECENT else 0.0

    @property
    def least_alone(self) -> tuple[float, float] | None:
        """(seconds alone, steps) per block of the request least in seconds (None: too few
        priced by the batched model)."""
        return min(self._alone) if len(self._alone) >= MIN_RECENT else None

    @property
    def most_blocks(self) -> float:
        """The most output blocks (none priced: no bound)."""
        return max(self._blocks, default=float("inf"))
