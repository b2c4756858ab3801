"""Capacity questions answered with the planner (`dilaserve plan`).

Given a latency profile, a trace and a cluster, the workload monitor turns the trace's busiest
window into classes, Stage 1 picks the configuration, and two searches over Stage-1 feasibility
answer the rest: how far the workload could grow on these GPUs (the capacity), and the smallest
GPU count that still keeps it stable at the SLO. Feasibility only grows with GPUs and shrinks
with load, so both are bisections.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from dilaserve.control.monitor import WorkloadClass, WorkloadMonitor
from dilaserve.control.planner import CapacityPlan, PlannerConfig, is_feasible, plan_capacity
from dilaserve.control.profile import LatencyProfile
from dilaserve.sim.traces import Trace

MAX_GPUS = 4096
SCALE_STEPS = 12  # bisection steps for the capacity multiple (about 0.1% of the answer)
Progress = Callable[[str], None]  # told each feasibility check of the searches
log = logging.getLogger("dilaserve.plan")


def nodes_for(gpus: int, gpus_per_node: int) -> tuple[int, ...]:
    """Full nodes, then one partial node with what is left."""
    if gpus <= 0 or gpus_per_node <= 0:
        raise ValueError(f"{gpus=} and {gpus_per_node=} must be positive")
    full, rest = divmod(gpus, gpus_per_node)
    return (gpus_per_node,) * full + ((rest,) if rest else ())


def workload_classes(
    trace: Trace, slo: float, block_len: int, window: float, safety: float
) -> list[WorkloadClass]:
    """Classes of the trace's busiest `window` seconds; outputs rounded up to whole blocks."""
    peak = trace.busiest_window(window)
    monitor = WorkloadMonitor(window=window, safety=safety)
    for i in range(len(peak)):
        output = -(-max(int(peak.output_tokens[i]), 1) // block_len) * block_len
        request_slo = float(peak.slo[i]) if peak.slo is not None else slo
        monitor.record(float(peak.arrival[i]), int(peak.prompt_tokens[i]), output, request_slo)
    return monitor.classes(window)


def scaled(classes: list[WorkloadClass], factor: float) -> list[WorkloadClass]:
    return [replace(c, rate=c.rate * factor) for c in classes]


def capacity_multiple(
    classes: list[WorkloadClass],
    profile: LatencyProfile,
    cfg: PlannerConfig,
    progress: Progress = log.debug,
) -> float:
    """The largest factor on every class's rate that a plan on these GPUs still serves."""

    def feasible(f: float) -> bool:
        ok = is_feasible(scaled(classes, f), profile, cfg)
        progress(f"capacity: {f:.4g} x the workload is {'' if ok else 'in'}feasible")
        return ok

    low, high = 1e-3, 1.0
    if not feasible(low):
        return 0.0
    while feasible(high):
        low, high = high, 2 * high
        if high > 1e6:
            return low
    for _ in range(SCALE_STEPS):
        mid = (low + high) / 2
        low, high = (mid, high) if feasible(mid) else (low, mid)
    return low


def smallest_gpu_count(
    classes: list[WorkloadClass],
    profile: LatencyProfile,
    cfg: PlannerConfig,
    per_node: int,
    progress: Progress = log.debug,
) -> int | None:
    """Fewest GPUs (nodes of `per_node`) whose best plan meets the SLOs; None if none does."""

    def feasible(n: int) -> bool:
        nodes = nodes_for(n, per_node)
        ok = is_feasible(classes, profile, replace(cfg, gpus_per_node=nodes))
        progress(f"smallest GPU count: {n} GPUs {'keep' if ok else 'do not keep'} the SLO")
        return ok

    high = 1
    while not feasible(high):
        high *= 2
        if high > MAX_GPUS:
            return None
    low = high // 2  # infeasible (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if feasible(mid) else (mid, high)
    return high


@dataclass(frozen=True)
class CapacityAnswer:
    classes: list[WorkloadClass]
    plan: CapacityPlan
    multiple: float  # capacity as a multiple of the (buffered) workload
    smallest_gpus: int | None


def answer(
    classes: list[WorkloadClass],
    profile: LatencyProfile,
    cfg: PlannerConfig,
    per_node: int,
    progress: Progress = log.debug,
) -> CapacityAnswer:
    plan = plan_capacity(classes, profile, cfg)
    progress(f"configuration: {'feasible' if plan.feasible else 'infeasible'} on these GPUs")
    return CapacityAnswer(
        classes,
        plan,
        capacity_multiple(classes, profile, cfg, progress),
        smallest_gpu_count(classes, profile, cfg, per_node, progress),
    )


def tokens_per_step_from_predictor(folder) -> dict[float, float]:
    """T_c from a trained step predictor's one-shot rates (steps per output token)."""
    import json
    from pathlib import Path

    meta_path = Path(folder) / "gbm-full.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"no step predictor in {folder} (missing {meta_path.name})")
    rates = json.loads(meta_path.read_text())["one_shot_steps_per_token"]
    return {float(c): 1.0 / float(r) for c, r in rates.items()}


def report(ans: CapacityAnswer, cfg: PlannerConfig, slo: float, source: str) -> str:
    from dilaserve.runs import markdown_table

    plan = ans.plan
    rate = sum(c.rate for c in ans.classes)
    nodes = cfg.gpus_per_node
    lines = [
        "# capacity plan",
        "",
        f"workload: {len(ans.classes)} classes, {rate:.3g} requests/s including the safety "
        f"buffer ({source}); SLO {slo:g} s",
        f"cluster: {sum(nodes)} GPUs on {len(nodes)} nodes {list(nodes)}",
        "",
    ]
    if plan.feasible:
        counts = ", ".join(f"{n} x TP-{tp}" for tp, n in plan.counts().items())
        lines += [
            f"configuration: {counts}",
            f"batch tokens per TP degree: full/recompute {plan.batch_tokens}"
            + (f", cache {plan.cache_batch_tokens}" if plan.cache_batch_tokens else ""),
            f"mean threshold per output token: {plan.mean_threshold:.3f}",
            "utilisation per TP degree: "
            + ", ".join(f"TP-{d} {u:.2f}" for d, u in sorted(plan.utilisation.items())),
        ]
    else:
        lines.append("no configuration meets the SLO at this load: fall back to TP-1 everywhere")
    lines += [
        f"capacity: {ans.multiple:.3g} x this workload = {ans.multiple * rate:.3g} requests/s",
        "smallest GPU count that keeps the workload stable at the SLO: "
        + (str(ans.smallest_gpus) if ans.smallest_gpus else f"none up to {MAX_GPUS}"),
        "",
        markdown_table(class_rows(ans), list(class_rows(ans)[0])),
    ]
    return "\n".join(lines) + "\n"


def class_rows(ans: CapacityAnswer) -> list[dict]:
    return [
        {
            "class": k,
            "prompt_tokens": round(c.prompt_len, 1),
            "output_tokens": round(c.output_len, 1),
            "rate": round(c.rate, 4),
            "slo_s": c.slo,
            "latency_s": round(ans.plan.latency[k], 3),
            "threshold_mix": {g: round(s, 3) for g, s in ans.plan.threshold_mix[k].items()},
        }
        for k, c in enumerate(ans.classes)
    ]
