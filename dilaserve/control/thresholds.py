"""SLO-aware threshold selection (Algorithms 1 and 5) and adaptive load control (2 and 4).

papers.md 1.4, 1.5 and 1.9. A request's work is its predicted remaining steps times the tokens
each step processes; with an approximate KV cache, cache steps process one block and only the
remaining recompute steps (one per unfinished block) process the whole sequence; with an
exact (block-diffusion) cache a block's first step commits two blocks (`step_costs.py`). Load
control gives requests, in arrival order (higher priority first), the widest threshold range whose
worst-case total load still fits the cluster's capacity over one SLO window; threshold selection
then picks, within that range, the highest threshold whose predicted remaining time fits the
request's remaining SLO budget. Pure functions over small views: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from dilaserve.control.profile import LatencyProfile
from dilaserve.control.step_costs import StepCosts
from dilaserve.protocol import StepKind

Costs = StepCosts | int | None  # the cache's step costs, or (approximate cache) its block length


@dataclass(frozen=True, slots=True)
class LoadView:
    """What load control and threshold selection read of a request."""

    request_id: str
    arrival_time: float
    num_tokens: int  # prompt + output window
    steps_left: Mapping[float, float]  # predicted remaining steps per candidate threshold
    recompute_steps_left: int = 0  # remaining blocks (with a KV cache)
    priority: int = 0


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """An instance's batch as the request would find it (the request itself included)."""

    tp: int
    num_tokens: int  # tokens of a full-sequence step over every request on the instance
    num_requests: int


def request_load(req: LoadView, threshold: float, costs: Costs) -> float:
    """Token-steps left (Algorithm 2; Algorithm 4 with a cache: `costs`, or its block length)."""
    return float(
        load_matrix(
            np.array([[req.steps_left[threshold]]]),
            [req.num_tokens],
            [req.recompute_steps_left],
            costs,
        )[0, 0]
    )


def instance_capacity(
    profile: LatencyProfile,
    tp: int,
    slo: float,
    costs: Costs,
    tokens_per_request: float = 0.0,
    max_requests: int = 0,
) -> float:
    """Token-steps one instance can process within one SLO window.

    Without a cache: its best measured token throughput times the SLO. With a cache
    (Algorithm 4): the throughput of the steady block pattern, (block_len - 1) inner steps over
    `max_requests` requests plus one boundary step: a recompute of an average request
    (`tokens_per_request`) with an approximate cache, a commit of every request with an exact one.
    """
    costs = StepCosts.of(costs)
    if not costs.cached:
        return profile.curve(tp, StepKind.FULL).best_throughput()[1] * slo
    block = costs.block_len
    inner_tokens = block * max_requests
    boundary_tokens = costs.boundary_batch_tokens(tokens_per_request, max_requests)
    inner_s = profile.step_latency(tp, inner_tokens, costs.inner_kind)
    boundary_s = profile.step_latency(tp, boundary_tokens, costs.boundary_kind)
    tokens = inner_tokens * (block - 1) + boundary_tokens
    return tokens / (inner_s * (block - 1) + boundary_s) * slo


def load_matrix(
    steps: np.ndarray, num_tokens: ArrayLike, recompute_left: ArrayLike, costs: Costs
) -> np.ndarray:
    """`request_load` for many requests and thresholds at once: steps [n, T] -> loads [n, T].
    Boundary steps (at most `recompute_left`) process the whole sequence (`num_tokens`), or
    two blocks with an exact cache; the others one block."""
    costs = StepCosts.of(costs)
    tokens = np.asarray(num_tokens, dtype=np.float64)[:, None]
    if not costs.cached:
        return steps * tokens
    boundary = costs.boundary_batch_tokens(tokens)
    recompute = np.minimum(np.asarray(recompute_left, dtype=np.float64)[:, None], steps)
    return (steps - recompute) * costs.block_len + recompute * boundary


def allowed_ranks(loads: np.ndarray, capacity: float) -> np.ndarray:
    """Algorithm 2/4 on a load matrix: rows in service order, columns thresholds descending.

    Returns, per row, the column of its highest allowed threshold (all lower ones are allowed
    too; the last column always is). Equivalent to the paper's loop: a row keeps column c when
    the load granted so far, its load at c and every later row's load at the last column fit
    `capacity`. Rows that all fit at the first column are granted it in one vectorised pass;
    once the remaining budget is below every later row's smallest step up, the rest get the
    last column without looping.
    """
    n, width = loads.shape
    ranks = np.full(n, width - 1)
    if n == 0 or width == 1:
        return ranks
    lowest = loads[:, -1]
    extra = loads - lowest[:, None]  # cost of each column over the last one
    budget = capacity - lowest.sum()
    fits_top = np.cumsum(extra[:, 0]) <= budget
    prefix = n if fits_top.all() else int(np.argmin(fits_top))
    ranks[:prefix] = 0
    if prefix == n:  # (the common case: every row at the first column)
        return ranks
    budget -= extra[:prefix, 0].sum()
    upgrades = extra[:, :-1]
    smallest_after = np.minimum.accumulate(
        np.where(upgrades > 0, upgrades, np.inf).min(axis=1)[::-1]
    )[::-1].tolist()
    free_after = np.logical_or.accumulate((upgrades <= 0).any(axis=1)[::-1])[::-1].tolist()
    budget = float(budget)  # (Python floats and lists in the loop: numpy scalars cost more)
    for i in range(prefix, n):
        if budget < smallest_after[i] and not free_after[i]:
            break  # no later row can afford any step up
        for col, cost in enumerate(extra[i].tolist()):
            if cost <= budget:
                ranks[i] = col
                budget -= cost
                break
    return ranks


def allowed_thresholds(
    requests: Sequence[LoadView],
    candidates: Sequence[float],
    capacity: float,
    costs: Costs,
) -> dict[str, tuple[float, ...]]:
    """Algorithm 2/4: each request's allowed thresholds (descending), earliest arrivals first.

    Walking requests in (priority desc, arrival) order, a request keeps the highest threshold at
    which the load already granted, its own load, and every later request's load at the lowest
    threshold still fit `capacity`; the lowest threshold is always allowed.
    """
    ladder = sorted(candidates, reverse=True)
    order = sorted(requests, key=lambda r: (-r.priority, r.arrival_time, r.request_id))
    steps = np.array([[r.steps_left[g] for g in ladder] for r in order], dtype=np.float64)
    loads = load_matrix(
        steps.reshape(len(order), len(ladder)),
        [r.num_tokens for r in order],
        [r.recompute_steps_left for r in order],
        costs,
    )
    ranks = allowed_ranks(loads, capacity)
    return {r.request_id: tuple(ladder[rank:]) for r, rank in zip(order, ranks.tolist())}


def step_seconds(
    instance: InstanceLoad, profile: LatencyProfile, costs: Costs
) -> tuple[float, float]:
    """(seconds of an inner step, seconds of a boundary step) on this instance: a cache and a
    recompute step, a block and a commit step (exact cache), or a full step twice (none)."""
    costs = StepCosts.of(costs)
    tp, n = instance.tp, instance.num_requests
    if not costs.cached:
        full = profile.step_latency(tp, instance.num_tokens, StepKind.FULL)
        return full, full
    inner = profile.step_latency(tp, costs.block_len * n, costs.inner_kind)
    boundary_tokens = costs.boundary_batch_tokens(instance.num_tokens, n)
    return inner, profile.step_latency(tp, boundary_tokens, costs.boundary_kind)


def predicted_time_left(
    req: LoadView,
    threshold: float,
    instance: InstanceLoad,
    profile: LatencyProfile,
    costs: Costs,
    seconds: tuple[float, float] | None = None,
) -> float:
    """Algorithm 1 (no cache) / Algorithm 5 (cache): seconds of remaining steps at `threshold`.

    `seconds` are the instance's `step_seconds`, when the caller already has them.
    """
    seconds = seconds or step_seconds(instance, profile, costs)
    return seconds_left(req.steps_left[threshold], req.recompute_steps_left, seconds)


def seconds_left(steps: float, recompute_left: int, seconds: tuple[float, float]) -> float:
    """Seconds of `steps` more steps, the first `recompute_left` of them (at most) boundary
    steps, at (inner, boundary) step `seconds`."""
    inner_s, boundary_s = seconds
    recompute = min(recompute_left, steps)
    return (steps - recompute) * inner_s + recompute * boundary_s


def select_threshold(
    req: LoadView,
    allowed: Sequence[float],
    slo_left: float,
    instance: InstanceLoad,
    profile: LatencyProfile,
    costs: Costs,
    seconds: tuple[float, float] | None = None,
) -> float:
    """Algorithm 1/5: the highest allowed threshold whose predicted time fits `slo_left`;
    the lowest allowed one if none does. `seconds`: the instance's `step_seconds`, when the
    caller already has them."""
    ladder = sorted(allowed, reverse=True)
    seconds = seconds or step_seconds(instance, profile, costs)
    steps = [req.steps_left[g] for g in ladder]
    return highest_fitting(ladder, steps, req.recompute_steps_left, slo_left, seconds)


def highest_fitting(
    ladder: Sequence[float],
    steps_left: Sequence[float],
    recompute_left: int,
    slo_left: float,
    seconds: tuple[float, float],
) -> float:
    """`select_threshold` on plain lists (the scheduler's hot path): `ladder` descending,
    `steps_left` the predicted steps at each, `seconds` the instance's `step_seconds`."""
    for threshold, steps in zip(ladder, steps_left):
        if seconds_left(steps, recompute_left, seconds) <= slo_left:
            return threshold
    return ladder[-1]
