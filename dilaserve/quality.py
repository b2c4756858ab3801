"""Quality as a function of the threshold: accuracy at a request's token-weighted mean
threshold, interpolated from an evaluation table (the bundled model's `dilaserve eval`, or
LLaDA-8B's GSM8K figures from the paper). The simulator's quality estimate reads it, and so
does the control plane's quality budget (`control/quality_budget.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np


class QualityModel:
    """Accuracy at a token-weighted mean threshold, linear between its points. `measured`: the
    range of thresholds its points were measured over (the rest are extrapolated); None: all."""

    def __init__(
        self,
        accuracy: Mapping[float, float],
        name: str = "",
        measured: tuple[float, float] | None = None,
    ):
        if not accuracy:
            raise ValueError("a quality model needs at least one (threshold, accuracy) point")
        self.points = sorted(accuracy.items())
        self._xs, self._ys = zip(*self.points)  # (read on every finished request)
        self.name = name
        self.measured = measured or (self.points[0][0], self.points[-1][0])

    def extrapolated_share(self, thresholds) -> float:
        """The share of `thresholds` outside the measured range."""
        t = np.asarray(thresholds, dtype=np.float64)
        low, high = self.measured
        return float(np.mean((t < low - 1e-9) | (t > high + 1e-9))) if t.size else 0.0

    def __call__(self, threshold: float) -> float:
        return float(np.interp(threshold, self._xs, self._ys))

    @classmethod
    def from_eval(cls, summary_path: str | Path) -> QualityModel:
        """From a `dilaserve eval` run folder's summary.json (accuracy per threshold)."""
        rows = json.loads(Path(summary_path).read_text())["table"]
        return cls({r["threshold"]: r["accuracy"] for r in rows}, str(summary_path))


# LLaDA-8B on GSM8K as the paper reports it (papers.md 1.1): about 78.5% at 0.9 (Fast-dLLM's
# cache+parallel figure), 1.5 points lower at 0.7; the rest extrapolated linearly [INFER].
LLADA_GSM8K = QualityModel(
    {0.5: 0.755, 0.6: 0.7625, 0.7: 0.770, 0.8: 0.7775, 0.9: 0.785},
    "LLaDA-8B GSM8K (paper)",
    measured=(0.7, 0.9),
)
# A sensitivity variant: the paper's points from 0.9 to 0.7, and below 0.7 the accelerating drop
# the bundled model measured (docs/results/eval-bundled-20261129-170905: 0.834 at 0.9, 0.782 at
# 0.7, then -5.8 points to 0.6 and -5.4 more to 0.5 where 0.7 -> 0.9 gained 5.2), its drops
# scaled by the paper's 1.5 / 5.2 points: -1.67 to 0.6 and -1.56 more to 0.5.
LLADA_GSM8K_ACCELERATING = QualityModel(
    {0.5: 0.7377, 0.6: 0.7533, 0.7: 0.770, 0.8: 0.7775, 0.9: 0.785},
    "LLaDA-8B GSM8K (paper), the bundled model's drop below 0.7",
    measured=(0.7, 0.9),
)
