"""One simulation run from a spec: trace, latency model, behaviour, predictor, policy, cluster.

`simulate(spec)` builds every part, drives the control plane through the simulator and returns
the records and summary; `write_run` writes the run folder (config, per-request records,
per-interval metrics, summary, report, plots). `dilaserve simulate` is a thin wrapper.

The spec (`sim/spec.py`) and the workload it describes (`sim/workload.py`: trace, requests,
SLO, behaviour and step predictor) are built elsewhere; this module runs them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dilaserve.control.decision_log import DecisionLog
from dilaserve.control.decisions import InstanceSpec
from dilaserve.control.lost_work import Lost
from dilaserve.control.planner import PlannerConfig
from dilaserve.control.policy import get_policy
from dilaserve.control.profile import LatencyProfile
from dilaserve.control.quality_budget import policy_budget
from dilaserve.control.reconfigure import Reconfigurer
from dilaserve.control.scheduler import Scheduler, SchedulerConfig
from dilaserve.quality import LLADA_GSM8K, LLADA_GSM8K_ACCELERATING, QualityModel
from dilaserve.sim import metrics, plots
from dilaserve.sim.behaviour import tokens_per_step_for
from dilaserve.sim.simulator import SimConfig, Simulator
from dilaserve.sim.spec import SimulationSpec
from dilaserve.sim.workload import make_trace, slo_for, workload


def load_profile(spec: str) -> LatencyProfile:
    from dilaserve.sim.profiles import load_profile as load

    return load(spec)


@dataclass
class SimulationRun:
    spec: SimulationSpec
    slo: float
    rows: list[dict]
    summary: dict
    intervals: list[dict]
    result: object
    timing: dict  # wall-clock figures, kept out of the summary so that it is reproducible
    planner_rounds: list[dict] = dataclasses.field(default_factory=list)  # Reconfigurer.history


def with_start(spec: SimulationSpec, profile: LatencyProfile) -> SimulationSpec:
    """The spec with the degree its cluster starts at: the one given, else its policy's
    (`Policy.start_tp`) where the profile prices it and it divides the nodes, else 1."""
    if spec.initial_tp is not None or spec.initial_layout is not None:
        return spec
    tp = get_policy(spec.policy).start_tp
    fits = tp in profile.tp_degrees and spec.gpus_per_node % tp == 0 and spec.gpus % tp == 0
    return dataclasses.replace(spec, initial_tp=tp if fits else 1)


def check_profile(spec: SimulationSpec, profile: LatencyProfile) -> None:
    """The profile prices the cluster's first instances, and the cache mode is the model's: a
    block-causal model's cache is exact or none, and the exact cache needs such a model."""
    missing = sorted(set(spec.layout()) - set(profile.tp_degrees))
    if missing:
        raise ValueError(
            f"the starting instances' TP degrees {missing} are not among {spec.profile}'s "
            f"TP degrees {profile.tp_degrees}"
        )
    block_causal, costs = bool(profile.meta.get("block_causal")), spec.costs
    if block_causal and costs.cached and not costs.exact:
        raise ValueError(
            f"{spec.kv_cache=}: {profile.meta.get('model')} is block-causal; its cache is "
            "exact (kv_cache='block') or none"
        )
    if costs.exact and not block_causal:
        raise ValueError(f"{spec.kv_cache=} needs a block-causal model's profile (llada2-*)")


def policy_for(spec: SimulationSpec):
    """The spec's policy, with its candidates and, for a fixed-threshold one, its threshold."""
    policy = get_policy(spec.policy)
    if spec.candidates is not None:
        policy = dataclasses.replace(policy, candidates=tuple(spec.candidates))
    if spec.lost_work is not None:
        policy = dataclasses.replace(policy, lost_work=Lost(spec.lost_work))
    if spec.quality_budget is not None:
        policy = dataclasses.replace(policy, quality_budget=policy_budget(spec.quality_budget))
    if not policy.is_dynamic:
        policy = dataclasses.replace(policy, fixed_threshold=spec.threshold)
    return policy


def _reconfigurer(spec: SimulationSpec, policy, profile, behaviour, config):
    """The planner a reconfiguring policy runs (None for the others)."""
    if not policy.reconfigure:
        return None
    from dilaserve.sim.capacity import nodes_for

    planner = PlannerConfig(
        nodes_for(spec.gpus, spec.gpus_per_node),
        {c: behaviour.tokens_per_step(c) for c in policy.candidates},
        tp_degrees=tuple(d for d in (1, 2, 4, 8) if d in profile.tp_degrees),
        costs=config.costs,
        period=spec.planner_period,
        startup_delay=spec.startup_delay,
        serial_launches=spec.serial_launches,
        rate_trend=spec.rate_trend,
        batch_limits=spec.plan_batch_limits,
    )
    return Reconfigurer(profile, planner, history_rounds=None)


def simulate(spec: SimulationSpec, progress=None, log: DecisionLog | None = None) -> SimulationRun:
    """Run the spec; `log`: a decision log to record into (one with its lines kept, to read)."""
    profile = load_profile(spec.profile)
    spec = with_start(spec, profile)
    check_profile(spec, profile)
    trace = make_trace(spec)
    policy = policy_for(spec)
    behaviour, requests, predictor = workload(spec, trace, policy, profile.meta.get("model"))
    slo = slo_for(spec, profile, requests, behaviour.tokens_per_step(spec.threshold))
    quality = QualityModel.from_eval(spec.quality) if spec.quality else LLADA_GSM8K
    config = scheduler_config(spec, slo, quality)
    reconfigurer = _reconfigurer(spec, policy, profile, behaviour, config)
    scheduler = Scheduler(policy, profile, predictor, config, reconfigurer)
    simulator = Simulator(
        scheduler,
        profile,
        behaviour,
        initial_instances(spec),
        sim_config(spec),
        log=log,
    )
    start = time.perf_counter()
    result = simulator.run(requests, progress=progress)
    wall = time.perf_counter() - start
    rows = metrics.request_records(result.requests, result.unfinished, quality)
    summary = {
        **metrics.summarize(rows),
        **quality_notes(quality, rows, spec, profile.meta.get("model")),
        "slo_s": round(slo, 4),
        "events": result.events,
        "simulated_seconds": round(result.end_time, 2),
        "reconfigurations": len(result.reconfigurations),
        **deadline_notes(scheduler, result.end_time),
        "migrations": result.migrations,
        "decision_digest": result.decision_digest,
    }
    timing = {
        "wall_seconds": round(wall, 2),
        "events_per_second": round(result.events / wall, 1) if wall else None,
    }
    rounds = list(reconfigurer.history) if reconfigurer is not None else []
    intervals = metrics.by_interval(rows, spec.interval)
    return SimulationRun(spec, slo, rows, summary, intervals, result, timing, rounds)


def deadline_notes(scheduler: Scheduler, end: float) -> dict:
    """Alg. 1's on-time calibration at the end (`control/on_time.py`), for a policy with one:
    its factor, and how many of the requests it measured finished later than the factor then
    in force allowed; the quality budget's loss read, floor and how often it was raised."""
    calibration, budget = scheduler.deadline, scheduler.quality
    notes = {}
    if calibration is not None:
        notes["deadline_factor"] = round(calibration.factor(end), 4)
        notes["deadline_measured"] = calibration.finished
        notes["deadline_late"] = calibration.late
    if budget is not None:  # the quality budget's state at the end (`control/quality_budget.py`)
        notes["quality_budget"] = budget.budget
        notes["quality_loss_read"] = round(budget.loss(end), 5)
        notes["quality_floor"] = budget.floor(end)
        notes["quality_floor_raised"] = budget.raised
    return notes


def quality_notes(
    quality: QualityModel, rows: list[dict], spec: SimulationSpec, model: str | None = None
) -> dict:
    """What in the quality estimate is measured and what extrapolated: the model, its measured
    range, the share of requests outside it, and (for the paper's curve) the estimate under the
    bundled model's accelerating drop below 0.7 instead of the linear one."""
    thresholds = [r["mean_threshold"] for r in rows]
    notes = {
        "quality_model": quality.name,
        "quality_measured_range": list(quality.measured),
        "quality_extrapolated_share": round(quality.extrapolated_share(thresholds), 4),
    }
    if quality is LLADA_GSM8K:
        accelerating = [LLADA_GSM8K_ACCELERATING(t) for t in thresholds]
        notes["quality_accelerating_drop"] = round(float(np.mean(accelerating)), 4)
    if not spec.behaviour.startswith("replay:"):
        notes["speed_model"] = tokens_per_step_for(model).source
    return notes


def scheduler_config(spec: SimulationSpec, slo: float, quality: QualityModel) -> SchedulerConfig:
    """The control plane's settings the spec names, with the run's SLO and quality curve."""
    return SchedulerConfig(
        kv_cache=spec.costs.mode,
        block_len=spec.costs.block_len,
        slo=slo,
        refresh_every_tokens=spec.refresh_every_tokens,
        max_requests_per_instance=spec.max_requests_per_instance,
        max_batch_requests=spec.max_batch_requests,
        slo_headroom=spec.slo_headroom,
        refresh_interval=spec.refresh_interval,
        instance_speed=spec.instance_speed,
        quality=quality,
    )


def sim_config(spec: SimulationSpec) -> SimConfig:
    """The simulated cluster's settings the spec names."""
    count, factor, onset, period = spec.parsed_stragglers()
    ring = tuple(i.instance_id for i in initial_instances(spec))  # the first `count` straggle
    return SimConfig(
        startup_delay=spec.startup_delay,
        latency_noise=spec.latency_noise,
        instance_slowdown={iid: factor for iid in ring[:count]},
        slowdown_from=onset,
        slowdown_moves=(period, ring),
        # pricing each instance at its own speed needs the steps' times reported
        measured_speed=spec.measured_speed
        or get_policy(spec.policy).prices_instances(spec.instance_speed),
        max_batch_tokens=spec.max_batch_tokens,
        seed=spec.seed,
    )


def initial_instances(spec: SimulationSpec) -> list[InstanceSpec]:
    out, first = [], 0
    for k, tp in enumerate(spec.layout()):
        node, gpu = divmod(first, spec.gpus_per_node)
        out.append(
            InstanceSpec(f"i{k}", node, tp, tuple(range(gpu, gpu + tp)), spec.max_batch_tokens)
        )
        first += tp
    return out


def write_run(
    run: SimulationRun, root: str | Path, name: str = "simulate", folder: Path | None = None
) -> Path:
    """The run folder (a new one under `root`, or `folder`, made when the run began)."""
    from dilaserve.runs import create_run_dir, markdown_table, write_json, write_records
    from dilaserve.sim.dashboard import write_dashboard

    folder = folder or create_run_dir(root, name)
    write_json(folder / "config.json", asdict(run.spec))  # the SLO it resolved: summary.json
    write_records(folder / "records.csv", run.rows)
    write_records(folder / "intervals.csv", run.intervals)
    times = [row["start"] for row in run.intervals]
    instances = metrics.instances_at(run.result.instance_log, times)
    write_json(
        folder / "summary.json",
        {
            **run.summary,
            "reconfiguration_log": run.result.reconfigurations,
            "planner_rounds": run.planner_rounds,
        },
    )
    write_json(folder / "timing.json", run.timing)
    columns = ["start", "requests", "slo_attainment", "latency_mean", "mean_threshold"]
    queue = metrics.mean_queue(run.result.queue_log, times, run.spec.interval)
    table = [
        {**{c: row.get(c) for c in columns}, "queue": q, "instances": inst}
        for row, q, inst in zip(run.intervals, queue, instances)
    ]
    lines = [f"# simulation: {run.spec.policy}", ""]
    lines += [f"- {k}: {v}" for k, v in {**run.summary, **run.timing}.items()]
    lines += ["", markdown_table(table, columns + ["queue", "instances"]) if table else ""]
    lines += [f"\n![run]({p.name})" for p in plots.plot_run(run, folder)]
    data = write_dashboard(run, folder)  # the data of the live server's page
    lines += [f"\nThe run as the live dashboard shows it: `dilaserve dashboard {folder}`"]
    lines += [f"(its data: [{data.name}]({data.name}))"]
    (folder / "report.md").write_text("\n".join(lines) + "\n")
    return folder
