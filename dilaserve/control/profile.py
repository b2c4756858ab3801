"""Latency profiles: the time of one denoising step by TP degree, batch tokens and step kind.

A profile is a JSON file of measured points, written by `dilaserve profile` (this machine's
engine) or `benchmarks/gpu_profile.py` (an LLaDA-8B-shaped model on a GPU):

    {"schema": 1, "model": ..., "hardware": ..., "dtype": ..., "versions": {...},
     "block_len": 32,
     "entries": [{"tp": 1, "kind": "recompute", "batch_tokens": 256, "ms": 12.5}, ...]}

`batch_tokens` is the number of tokens the step's forward passes process: the whole sequences
for full and recompute steps, `block_len` per request for dual-cache steps. Latency between
measured points is interpolated linearly; below the smallest point it is that point's latency
(small batches are overhead-bound); above the largest it is extrapolated from the last two, and
never below the largest point's latency.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

from dilaserve.config import DEFAULT_BLOCK_LEN
from dilaserve.protocol import StepKind

SCHEMA = 1
MEMO_SIZE = 1 << 16  # batch sizes remembered per curve
# a whole-sequence kind the profile lacks is priced as another one that runs the same tokens
FALLBACK_KINDS = {
    StepKind.FULL: (StepKind.RECOMPUTE, StepKind.PREFILL),
    StepKind.RECOMPUTE: (StepKind.FULL,),
    StepKind.PREFILL: (StepKind.FULL,),
}


@dataclass(frozen=True, slots=True)
class Curve:
    """Measured (batch_tokens, seconds) points of one (tp, kind), sorted by batch tokens."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    # answers so far: placement asks every instance's curve at every candidate batch size
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if not self.tokens:
            raise ValueError("a latency curve needs at least one point")
        if list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError(f"batch_tokens must be distinct and sorted: {self.tokens}")

    def at(self, batch_tokens: float) -> float:
        seconds = self._memo.get(batch_tokens)
        if seconds is None:
            seconds = self._interpolate(batch_tokens)
            if len(self._memo) < MEMO_SIZE:
                self._memo[batch_tokens] = seconds
        return seconds

    def _interpolate(self, batch_tokens: float) -> float:
        xs, ys = self.tokens, self.seconds
        if batch_tokens <= xs[0] or len(xs) == 1:
            return ys[0] if batch_tokens <= xs[0] else ys[0] * batch_tokens / xs[0]
        i = min(bisect.bisect_left(xs, batch_tokens), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        seconds = y0 + (y1 - y0) * (batch_tokens - x0) / (x1 - x0)
        # beyond the largest point a noisy calibration's last two points may fall: a step over
        # more tokens never takes less than the largest one measured
        return max(seconds, y1) if batch_tokens > x1 else seconds

    def best_throughput(self) -> tuple[int, float]:
        """(batch tokens, tokens/s) of the measured point with the highest token throughput."""
        return max(((x, x / y) for x, y in zip(self.tokens, self.seconds)), key=lambda p: p[1])


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    curves: dict[tuple[int, StepKind], Curve]
    block_len: int = DEFAULT_BLOCK_LEN
    meta: dict = field(default_factory=dict)

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        return tuple(sorted({tp for tp, _ in self.curves}))

    def curve(self, tp: int, kind: StepKind) -> Curve:
        found = self.curves.get((tp, kind))
        if found is not None:
            return found
        kind = StepKind(kind)
        if (tp, kind) in self.curves:
            return self.curves[tp, kind]
        for fallback in FALLBACK_KINDS.get(kind, ()):
            if (tp, fallback) in self.curves:
                return self.curves[tp, fallback]
        raise KeyError(f"latency profile has no points for tp={tp}, kind={kind.value}")

    def step_latency(self, tp: int, batch_tokens: float, kind: StepKind) -> float:
        """Seconds for one step processing `batch_tokens` tokens on a TP-`tp` instance."""
        return self.curve(tp, kind).at(batch_tokens)

    def max_batch_tokens(self, tp: int, kind: StepKind) -> int:
        return self.curve(tp, kind).tokens[-1]

    @classmethod
    def from_dict(cls, raw: object) -> LatencyProfile:
        if not isinstance(raw, dict) or not isinstance(raw.get("entries", []), list):
            raise ValueError("a latency profile is an object with a list of 'entries'")
        if raw.get("schema", SCHEMA) != SCHEMA:
            raise ValueError(f"latency profile schema {raw.get('schema')} is not {SCHEMA}")
        points: dict[tuple[int, StepKind], list[tuple[int, float]]] = {}
        for i, e in enumerate(raw.get("entries", ())):
            try:
                key = (int(e["tp"]), StepKind(e["kind"]))
                point = (int(e["batch_tokens"]), float(e["ms"]) / 1e3)
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"latency profile entry {i} is malformed: {err!r}") from None
            if key[0] < 1 or point[0] < 1 or not point[1] > 0:
                raise ValueError(f"latency profile entry {i}: tp, batch_tokens and ms must be > 0")
            points.setdefault(key, []).append(point)
        if not points:
            raise ValueError("latency profile has no entries")
        curves = {}
        for k, v in points.items():
            tokens, seconds = zip(*sorted(v))
            curves[k] = Curve(tuple(tokens), tuple(seconds))
        meta = {k: v for k, v in raw.items() if k not in ("entries", "block_len")}
        return cls(curves, int(raw.get("block_len", 32)), meta)

    @classmethod
    def from_file(cls, path: str | Path) -> LatencyProfile:
        try:
            raw = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"latency profile {path} is not JSON: {e}") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict:
        entries = [
            {"tp": tp, "kind": kind.value, "batch_tokens": x, "ms": round(y * 1e3, 4)}
            for (tp, kind), c in sorted(self.curves.items())
            for x, y in zip(c.tokens, c.seconds)
        ]
        return {"schema": SCHEMA, **self.meta, "block_len": self.block_len, "entries": entries}
