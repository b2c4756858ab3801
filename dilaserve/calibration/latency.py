"""Measure a latency profile through the cluster's own workers, at any TP degree.

An instance of TP degree d is started on a cluster backend (`cluster/backends.py`: the worker
processes and `torch.distributed` gang that serving uses), and fed step batches of growing size
of each step kind the model's cache has (`KINDS`): with an approximate cache, recompute steps
(whole sequences, K/V stored) and cache steps (one block per request against the stored K/V);
with an exact one (block diffusion), prefill, block and commit steps. Each point is the median
engine time of `repeats` runs after a warm-up, as the worker measures it; the untimed steps
before it bring fresh requests to the state its kind needs (`BEFORE`).

Implausible points are measured again, up to `retries` times, and reported if they stay so:
a spread between repeats above `max_spread` of the median (a busy moment), or a step slower
than a larger one of the same kind by more than `max_inversion`. The profile keeps the last
measurement; the warnings go into the calibration, the log and the summary.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from dilaserve.config import DEFAULT_BLOCK_LEN
from dilaserve.control.step_costs import StepCosts
from dilaserve.protocol import KVCacheMode, SequenceSpec, StepBatch, StepItem, StepKind

KINDS = {mode: StepCosts(mode).kinds for mode in KVCacheMode}  # what each cache's profile prices
# the untimed step that brings a fresh request to the state a kind needs: a commit step follows
# a prefill that finished the first block (its fresh output has that block committed but for
# the last position, which the prefill's one-token fallback commits at threshold 1)
BEFORE = {
    StepKind.CACHE: StepKind.RECOMPUTE,
    StepKind.BLOCK: StepKind.PREFILL,
    StepKind.COMMIT: StepKind.PREFILL,
}
FILLER_ID = 3  # the token of already committed output positions


@dataclass(frozen=True, slots=True)
class ProfileGrid:
    seq_len: int = 128  # prompt + output window of the profiled requests
    gen_len: int = 64
    requests: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    repeats: int = 3
    max_spread: float = 0.2
    max_inversion: float = 2.0
    retries: int = 2
    block_len: int = DEFAULT_BLOCK_LEN

    def __post_init__(self):
        if not 0 < self.gen_len < self.seq_len:
            raise ValueError(f"{self.gen_len=} must be positive and below {self.seq_len=}")
        if self.repeats <= 0 or not self.requests or min(self.requests) <= 0:
            raise ValueError("repeats and every entry of requests must be positive")


@dataclass(frozen=True, slots=True)
class Point:
    num_requests: int
    batch_tokens: int
    ms: float
    spread: float  # (max - min) / median of the repeats


class InstanceTimer:
    """Runs steps on one started instance of a backend and returns the engine's seconds."""

    def __init__(self, backend, instance_id: str, timeout: float = 600.0):
        self.backend, self.instance_id, self.timeout = backend, instance_id, timeout

    def run(self, batch: StepBatch) -> tuple[float, int]:
        self.backend.step(self.instance_id, batch)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            for event in self.backend.poll(1.0):
                if event.instance_id != self.instance_id:
                    continue
                if event.kind == "done":
                    return event.seconds, event.output.num_tokens
                raise RuntimeError(f"profiling step {event.kind}: {event.error}")
        raise TimeoutError(f"a profiling step ran past {self.timeout:.0f} s")

    def release(self, request_ids: list[str]) -> None:
        self.backend.release(self.instance_id, request_ids)


def _fresh_output(grid: ProfileGrid, mask_id: int, kind: StepKind) -> tuple[int, ...]:
    """A profiled request's output window when it is sent: masked, or for a commit step the
    first block committed but for its last position."""
    committed = grid.block_len - 1 if kind is StepKind.COMMIT else 0
    return (FILLER_ID,) * committed + (mask_id,) * (grid.gen_len - committed)


def _batch(grid: ProfileGrid, mask_id: int, n: int, kind: StepKind, fresh: tuple | None):
    """`n` requests' step of `kind`; `fresh`: their output window, sent with them."""
    prompt = tuple(FILLER_ID + i % 50 for i in range(grid.seq_len - grid.gen_len))
    spec = SequenceSpec(prompt, fresh) if fresh is not None else None
    return StepBatch(tuple(StepItem(f"p{i}", 1.0, kind, spec) for i in range(n)))


def measure_point(timer: InstanceTimer, grid: ProfileGrid, mask_id: int, n: int, kind) -> Point:
    """Median step time of `n` requests (a warm-up run first). A step that needs a state
    (`BEFORE`) runs after the untimed step of the same fresh requests that makes it."""
    samples, tokens = [], 0
    ids = [f"p{i}" for i in range(n)]
    fresh = _fresh_output(grid, mask_id, kind)
    before = BEFORE.get(kind)
    for _ in range(grid.repeats + 1):
        timer.release(ids)
        if before is None:
            seconds, tokens = timer.run(_batch(grid, mask_id, n, kind, fresh))
        else:
            timer.run(_batch(grid, mask_id, n, before, fresh))
            seconds, tokens = timer.run(_batch(grid, mask_id, n, kind, None))
        samples.append(seconds)
    timer.release(ids)
    kept = samples[1:]
    median = statistics.median(kept)
    return Point(n, tokens, 1e3 * median, (max(kept) - min(kept)) / median)


def implausible(points: list[Point], grid: ProfileGrid) -> dict[int, str]:
    """Points (by request count) that look wrong, with why."""
    why = {}
    for p in points:
        if p.spread > grid.max_spread:
            why[p.num_requests] = f"repeats spread {p.spread:.0%} of the median"
    for small in points:
        for large in points:
            if large.batch_tokens > small.batch_tokens and small.ms > grid.max_inversion * large.ms:
                text = (
                    f"{small.ms:.1f} ms at {small.batch_tokens} tokens, over "
                    f"{grid.max_inversion:g}x the {large.ms:.1f} ms at {large.batch_tokens}"
                )
                why.setdefault(small.num_requests, text)
                why.setdefault(large.num_requests, text)
    return why


def measure_curve(
    timer: InstanceTimer,
    grid: ProfileGrid,
    mask_id: int,
    kind: StepKind,
    sizes: list[int],
    progress: Callable[[str], None],
) -> tuple[list[Point], list[str]]:
    """Every point of one step kind, implausible ones measured again; (points, warnings)."""
    points = {}
    for n in sizes:
        points[n] = measure_point(timer, grid, mask_id, n, kind)
        p = points[n]
        progress(f"{kind.value} step, {p.batch_tokens} tokens: {p.ms:.2f} ms")
    for _ in range(grid.retries):
        bad = implausible(list(points.values()), grid)
        if not bad:
            break
        for n in bad:
            points[n] = measure_point(timer, grid, mask_id, n, kind)
    bad = implausible(list(points.values()), grid)
    warnings = [
        f"{kind.value} step of {points[n].batch_tokens} tokens: {why} "
        f"(still after {grid.retries} re-measurements)"
        for n, why in sorted(bad.items())
    ]
    return [points[n] for n in sizes], warnings


def batch_sizes(grid: ProfileGrid, max_batch_tokens: int) -> list[int]:
    """The request counts whose recompute step fits the engine's batch limit."""
    return [n for n in grid.requests if n * grid.seq_len <= max_batch_tokens]


def profile_instance(
    timer: InstanceTimer,
    tp: int,
    grid: ProfileGrid,
    mask_id: int,
    max_batch_tokens: int,
    progress: Callable[[str], None],
    kinds: tuple[StepKind, ...] = KINDS[KVCacheMode.DUAL],
) -> tuple[list[dict], list[str]]:
    """Profile entries (`control/profile.py` rows) of one TP degree, and warnings."""
    entries, warnings = [], []
    sizes = batch_sizes(grid, max_batch_tokens)
    for kind in kinds:
        points, notes = measure_curve(timer, grid, mask_id, kind, sizes, progress)
        warnings += [f"tp={tp} {note}" for note in notes]
        entries += [
            {
                "tp": tp,
                "kind": kind.value,
                "batch_tokens": p.batch_tokens,
                "num_requests": p.num_requests,
                "seq_len": grid.seq_len,
                "ms": round(p.ms, 3),
                "spread": round(p.spread, 3),
            }
            for p in points
        ]
    return entries, warnings
