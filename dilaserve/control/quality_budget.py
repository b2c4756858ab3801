"""The quality budget (an extension, beyond the paper's algorithms): the paper's "< 1% accuracy
drop" kept online as a service-level target of its own.

Alg. 1 lowers a squeezed request's threshold and Alg. 2/4 caps the thresholds of the requests
in flight when their work would not fit; neither looks at what that costs in quality, so under
load the mean threshold falls as far as the ladder lets it (with load control binding, the
quality estimate fell 1.1-1.3% below the fixed-0.9 baselines' on two training traces,
docs/control/thresholds.md, "A quality budget").

Each finished request's quality estimate (the quality curve, `dilaserve.quality`, at its
token-weighted mean threshold, as the simulator's metric reads it) joins the mean over every
request finished so far, except a request whose own bounds keep it below the top threshold: its
client chose that loss, not the controller (`ThresholdSelection.finished`). The budget is a
relative loss against the curve at the ladder's top threshold (0.01: the paper's 1%). While
that mean loses more than the budget, the *floor*, the lowest threshold Alg. 1 and Alg. 2/4 may
give a request, is the top threshold: the budget is spent, and the requests that finish at the
top pay it back; once the mean is within the budget the whole ladder is open again. A lost
request (`lost_work.py`) runs at the top whatever the floor: its deadline is gone, so a lower
threshold buys nothing but a quality loss. No constant is fitted to a trace: the budget is the
paper's, the half-life Alg. 1's calibration's.

An estimate is not a fact (DESIGN.md 7): while no request finishes, the loss read decays toward
none with a half-life, so a floor raised on old evidence falls by itself. Pure bookkeeping: the
caller passes the time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dilaserve.control.on_time import HALF_LIFE

QUALITY_BUDGET = 0.01  # the paper's "< 1% accuracy drop", relative to the top threshold's


def policy_budget(option: float) -> float | None:
    """A `--quality-budget` option as `Policy.quality_budget`: 1 (all of the quality may go)
    is no bound, None."""
    return option if option < 1 else None


class QualityBudget:
    def __init__(
        self,
        curve: Callable[[float], float],  # accuracy at a mean threshold (`QualityModel`)
        ladder: Sequence[float],  # the policy's thresholds
        budget: float = QUALITY_BUDGET,
        half_life: float = HALF_LIFE,
    ):
        if not 0.0 <= budget < 1.0:
            raise ValueError(f"quality budget {budget=} must be a relative loss in [0, 1)")
        if half_life <= 0:
            raise ValueError(f"{half_life=} must be positive")
        self.curve = curve
        self.budget = budget
        self.half_life = half_life
        self.top, self.lowest = max(ladder), min(ladder)
        self.reference = curve(self.top)  # the quality at the top threshold
        if self.reference <= 0:
            raise ValueError(f"the quality curve gives {self.reference} at {self.top}")
        self._sum = 0.0  # of finished requests' quality
        self._last = 0.0  # when the last request finished
        self.finished = 0  # requests measured
        self.raised = 0  # times the floor went up

    def finished_at(self, mean_threshold: float, now: float) -> None:
        """A request finished at `now`, its tokens committed at `mean_threshold` on average."""
        was_raised = self.floor(now) > self.lowest
        self._sum += self.curve(mean_threshold)
        self.finished += 1
        self._last = now
        self.raised += not was_raised and self.floor(now) > self.lowest

    def loss(self, now: float) -> float:
        """The finished requests' mean relative quality loss, decayed toward 0 by how long none
        has finished (0: no evidence)."""
        if not self.finished:
            return 0.0
        loss = 1.0 - self._sum / self.finished / self.reference
        idle = max(now - self._last, 0.0)
        return loss * 0.5 ** (idle / self.half_life)

    def floor(self, now: float) -> float:
        """The lowest threshold a request may be given now: the ladder's lowest while the loss
        is within the budget, else the top."""
        return self.top if self.loss(now) > self.budget else self.lowest

    def above_floor(self, thresholds: tuple[float, ...], now: float) -> tuple[float, ...]:
        """The `thresholds` (in their order) at or above the floor now; the floor itself if
        none is."""
        floor = self.floor(now)
        return tuple(g for g in thresholds if g >= floor) or (floor,)
