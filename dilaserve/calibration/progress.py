"""Progress of a calibration, and its time left.

The work is planned as units (one profile point, one threshold's trajectories), each with a cost
in token-steps: the tokens the model runs, summed over the steps the unit takes. The time left is
the remaining cost of each phase times the seconds per token-step measured in that phase so far,
or, for a phase not yet begun, in the phase before it. A count of units would not do: a profile
point of 128 requests runs 128 times the tokens of a point of one, and one threshold's
trajectories run hundreds of steps, so the first units' pace says little about the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dilaserve.protocol import KVCacheMode, StepKind

WHOLE_SEQUENCE = (StepKind.FULL, StepKind.RECOMPUTE)


@dataclass(slots=True)
class Unit:
    phase: str
    cost: float  # token-steps
    seconds: float | None = None  # how long it took, once done


def step_tokens(kind: StepKind, seq_len: int, gen_len: int, block_len: int) -> int:
    """Tokens one request runs in a step of `kind`: its whole sequence, its prompt (a prefill),
    or one block (a cache, block or commit step)."""
    if kind in WHOLE_SEQUENCE:
        return seq_len
    if kind is StepKind.PREFILL:
        return seq_len - gen_len
    return block_len


def trajectory_cost(
    mode: KVCacheMode, prompt_len: float, gen_len: int, block_len: int, steps: float
) -> float:
    """Token-steps of one request that takes `steps` steps: without a cache every step runs the
    whole sequence; with an approximate one, each block's first step does and the others run one
    block; with the exact block cache, a prefill of the prompt and then one block a step."""
    seq_len = prompt_len + gen_len
    if mode is KVCacheMode.NONE:
        return steps * seq_len
    if mode is KVCacheMode.BLOCK:
        return prompt_len + steps * block_len
    num_blocks = gen_len // block_len
    return num_blocks * seq_len + max(steps - num_blocks, 0) * block_len


class Progress:
    """Planned units done one after another, logged with the time left."""

    def __init__(self, units: list[Unit], log=print, clock=time.monotonic):
        self.units, self.done, self.log, self.clock = units, 0, log, clock
        self.start = self.last = clock()

    @property
    def total(self) -> int:
        return len(self.units)

    def advance(self, what: str) -> None:
        """The next planned unit is done; `what` says what it measured."""
        now = self.clock()
        self.units[self.done].seconds = now - self.last
        self.done, self.last = self.done + 1, now
        self.log(
            f"[{self.done}/{self.total}] {what} "
            f"({_clock(now - self.start)} elapsed, about {_clock(self.seconds_left())} left)"
        )

    def untimed(self) -> None:
        """The time since the last unit was no unit's work (an instance or model loading): it
        counts as elapsed, not toward the next unit's pace."""
        self.last = self.clock()

    def revise(self, phase: str, costs: list[float]) -> None:
        """The units of `phase` not done yet are now expected to cost `costs`, in order."""
        left = [unit for unit in self.units[self.done :] if unit.phase == phase]
        for unit, cost in zip(left, costs):
            unit.cost = cost

    def seconds_left(self) -> float:
        rates, rate, left = {}, None, 0.0
        for unit in self.units[: self.done]:
            seconds, cost = rates.get(unit.phase, (0.0, 0.0))
            rates[unit.phase] = (seconds + unit.seconds, cost + unit.cost)
        for unit in self.units:
            if unit.phase in rates and rates[unit.phase][1] > 0:
                rate = rates[unit.phase][0] / rates[unit.phase][1]
            if unit.seconds is None and rate is not None:
                left += unit.cost * rate
        return left


def expected_steps(measured: dict[float, float], thresholds, most: float) -> list[float]:
    """Steps per request expected at `thresholds` from those `measured` at others: the line
    through the last two measured (a higher threshold commits fewer tokens a step, so takes
    more steps), or the last one alone, never above `most` (one token a step)."""
    known = sorted(measured.items())
    (x0, y0), (x1, y1) = known[-2:] if len(known) > 1 else known * 2
    slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
    return [min(max(y1 + slope * (t - x1), y1), most) for t in thresholds]


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
