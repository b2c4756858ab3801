"""One simulation run from a spec: trace, latency model, behaviour, predictor, policy, cluster.

`simulate(spec)` builds every part, drives the control plane through the simulator and returns
the records and summary; `write_run` writes the run folder (config, per-request records,
per-interval metrics, summary, report, plots). `dilaserve simulate` is a thin wrapper.

The SLO, unless given in seconds, is `slo_multiple` times the mean latency of the trace's
requests each running alone on a TP-1 instance at the spec's threshold, 0.9 unless set
(papers.md 1.3): one recompute step per block at the whole sequence, cache steps of one block
for the rest. A block-causal
model (a profile whose meta says `block_causal`, e.g. `llada2-mini-h200`) runs with its exact
cache (`kv_cache="block"`): its requests' blocks sit at absolute positions (`block_offset`), the
parametric behaviour takes the model's tokens per step, and the isolated latency is a prefill,
a commit step per later block and block steps, on the smallest TP degree that holds the model.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dilaserve.control.decisions import DecisionLog, InstanceSpec
from dilaserve.control.features import FEATURE_NAMES, PROGRESS_FEATURES
from dilaserve.control.planner import PlannerConfig
from dilaserve.control.policy import Order, get_policy
from dilaserve.control.profile import LatencyProfile
from dilaserve.control.reconfigure import Reconfigurer
from dilaserve.control.scheduler import Scheduler, SchedulerConfig
from dilaserve.control.step_costs import StepCosts
from dilaserve.protocol import KVCacheMode
from dilaserve.request import Request
from dilaserve.sim import metrics, plots, synthetic, traces
from dilaserve.sim.behaviour import (
    LLADA_GSM8K,
    LLADA_GSM8K_ACCELERATING,
    ParametricBehaviour,
    QualityModel,
    ReplayBehaviour,
    tokens_per_step_for,
)
from dilaserve.sim.simulator import SimConfig, Simulator

DEFAULT_THRESHOLD = 0.9
THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass(frozen=True)
class SimulationSpec:
    policy: str = "dilaserve"
    profile: str = "llada-8b-h100"  # a preset name or a profile JSON path
    trace: str = "paper"  # paper | poisson:RPS:SECONDS | bursty/code:RPS:SECONDS[:CV] | CSV
    peak_rps: float = 20.0  # the paper trace's peak
    minutes_per_hour: float = 5.0  # the paper trace: each hour of the day becomes this long
    duration: float | None = None  # keep only the first N seconds of the trace
    rate_scale: float = 1.0  # arrivals this many times as fast (a real trace, scaled)
    gpus: int = 16
    gpus_per_node: int = 4
    initial_tp: int = 1  # the cluster starts as gpus / initial_tp instances of this degree
    slo: float | None = None  # seconds; None: slo_multiple x isolated TP-1 latency
    slo_multiple: float = 5.0
    kv_cache: str = "dual"  # none | dual | block (a block-causal model's exact cache)
    block_len: int = 32
    # the default threshold: requests start at it, fixed-threshold policies keep it, the SLO's
    # isolated latency is taken at it (a dynamic policy's range is `candidates`)
    threshold: float = DEFAULT_THRESHOLD
    max_batch_tokens: int = 65536
    max_requests_per_instance: int = 64
    max_batch_requests: int | None = None  # requests one step batch may hold (None: no limit)
    refresh_every_tokens: int = 8
    slo_headroom: float = 1.0  # the paper's Alg. 1; see SchedulerConfig
    refresh_interval: float = 0.05  # see SchedulerConfig
    planner_period: float = 300.0
    startup_delay: float = 30.0
    latency_noise: float = 0.0
    interval: float = 300.0  # seconds per row of the per-interval metrics
    predictor_prompts: int = 100  # sample requests the simulated predictor trains on
    behaviour: str = "parametric"  # or "replay:TRAJECTORIES.npz" (recorded engine steps)
    predictor_path: str | None = None  # replay: a trained predictor folder (default: bundled)
    quality: str | None = None  # an eval summary.json (default: LLaDA-8B's GSM8K curve)
    candidates: tuple[float, ...] | None = None  # a dynamic policy's thresholds (None: 0.5-0.9)
    seed: int = 0

    def __post_init__(self):
        if self.gpus <= 0 or self.gpus % self.initial_tp:
            raise ValueError(f"{self.gpus=} must be a positive multiple of {self.initial_tp=}")
        if self.rate_scale <= 0:
            raise ValueError(f"{self.rate_scale=} must be positive")
        if self.slo is not None and self.slo <= 0:
            raise ValueError(f"{self.slo=} must be positive")
        if self.slo_multiple <= 0:
            raise ValueError(f"{self.slo_multiple=} must be positive")


def load_profile(spec: str) -> LatencyProfile:
    from dilaserve.sim.latency import load_profile as load

    return load(spec)


def make_trace(spec: SimulationSpec) -> traces.Trace:
    rng = np.random.default_rng(spec.seed)
    if spec.trace == "paper":
        trace = synthetic.paper_trace(
            seed=spec.seed,
            peak_rps=spec.peak_rps,
            minutes_per_hour=spec.minutes_per_hour,
            block_len=spec.block_len,
        )
    elif spec.trace.startswith(("poisson:", "bursty:", "code:")):
        trace = synthetic_trace(spec.trace, spec.block_len, rng)
    else:
        trace = traces.load_trace(spec.trace)
    if spec.duration is not None:
        trace = trace.window(0.0, spec.duration)
    if spec.rate_scale != 1.0:
        trace = dataclasses.replace(trace, arrival=trace.arrival / spec.rate_scale)
    if len(trace) == 0:
        raise ValueError(f"trace {spec.trace!r} has no requests in the first {spec.duration} s")
    return trace


def synthetic_trace(name: str, block_len: int, rng: np.random.Generator) -> traces.Trace:
    """`poisson:RPS:SECONDS` (ShareGPT lengths), `bursty:RPS:SECONDS[:CV]` (the same lengths,
    gamma arrivals) or `code:RPS:SECONDS[:CV]` (code-like lengths, gamma arrivals)."""
    if name.startswith("poisson:"):
        rate, seconds = synthetic.parse_poisson(name)
        arrivals = synthetic.poisson_arrivals(rate, seconds, rng)
    else:
        rate, seconds, cv = synthetic.parse_bursty(name)
        arrivals = synthetic.gamma_arrivals(rate, cv, seconds, rng)
    if name.startswith("code:"):
        prompt, output = synthetic.code_lengths(max(len(arrivals), 1), rng)
    else:
        prompt, output = traces.filter_lengths(
            *traces.load_first_turn_lengths(), block_len=block_len
        )
    return synthetic.synthesize_trace(arrivals, prompt, output, rng, source=name)


def isolated_latency(
    profile: LatencyProfile,
    prompt: int,
    output: int,
    block: int,
    tokens_per_step: float,
    costs: StepCosts | None = None,
) -> float:
    """One request alone on the profile's smallest TP degree (TP-1 unless the model needs more):
    a boundary step per block and inner steps for the rest, the first step a sequence step
    (a prefill where the cache is exact). An approximate cache or none is priced as the paper's
    dual cache (recompute and cache steps), which is what the SLO multiple refers to."""
    costs = costs if costs is not None and costs.exact else StepCosts(KVCacheMode.DUAL, block)
    tp = profile.tp_degrees[0]
    blocks = -(-output // block)
    steps = max(output / tokens_per_step, blocks)
    tokens = prompt + blocks * block
    boundary = profile.step_latency(tp, costs.boundary_tokens(tokens), costs.boundary_kind)
    inner = profile.step_latency(tp, costs.inner_tokens(tokens), costs.inner_kind)
    first = profile.step_latency(tp, tokens, costs.sequence_kind) - boundary  # 0 with recompute
    return first + blocks * boundary + (steps - blocks) * inner


def slo_for(
    spec: SimulationSpec, profile: LatencyProfile, requests: list[Request], rate: float
) -> float:
    """The spec's SLO in seconds, or its multiple of the requests' mean isolated latency at
    the spec's threshold (`rate` tokens committed per step)."""
    if spec.slo is not None:
        return spec.slo
    costs = StepCosts(KVCacheMode(spec.kv_cache), spec.block_len)
    isolated = [
        isolated_latency(profile, r.prompt_len, r.gen_len, spec.block_len, rate, costs)
        for r in requests
    ]
    return spec.slo_multiple * float(np.mean(isolated))


def requests_from(
    trace: traces.Trace,
    block: int,
    aligned: bool = False,
    threshold: float = DEFAULT_THRESHOLD,
) -> list[Request]:
    """The trace's requests, outputs rounded up to whole blocks; a per-request SLO in the trace
    becomes its deadline (the others get the scheduler's). `aligned`: a block-causal model's
    blocks start at absolute multiples of `block` (`Request.block_offset`)."""
    out = []
    for i in range(len(trace)):
        output = -(-max(int(trace.output_tokens[i]), 1) // block) * block
        arrival = float(trace.arrival[i])
        own = float(trace.slo[i]) if trace.slo is not None else None
        prompt = int(trace.prompt_tokens[i])
        out.append(
            Request(
                f"r{i}",
                (3,) * prompt,
                output,
                block,
                1,
                threshold,
                arrival,
                deadline=None if own is None else arrival + own,
                block_offset=prompt % block if aligned else 0,
            )
        )
    return out


def with_unit_costs(requests: list[Request], rate) -> None:
    """DWS's unit cost (papers.md 2.6: prompt blocks + output blocks + steps) with each
    request's TRUE lengths in place of the predicted surface: an oracle DWS, for `dws-sjf`."""
    for r in requests:
        steps = max(r.gen_len / rate(r.threshold), r.num_blocks)
        r.cost = r.prompt_len // r.block_len + r.num_blocks + steps


@dataclass
class SimulationRun:
    spec: SimulationSpec
    slo: float
    rows: list[dict]
    summary: dict
    intervals: list[dict]
    result: object
    timing: dict  # wall-clock figures, kept out of the summary so that it is reproducible


def workload(spec: SimulationSpec, trace: traces.Trace, policy, model: str | None = None):
    """(behaviour, requests, step predictor): parametric behaviour (at `model`'s tokens per
    step) with the trace's lengths and a predictor trained on it, or recorded trajectories
    replayed (each arrival takes a recorded prompt's lengths) with the predictor trained on
    those trajectories."""
    if not spec.behaviour.startswith("replay:"):
        rate = tokens_per_step_for(model)
        behaviour = ParametricBehaviour(seed=spec.seed + 2, tokens_per_step=rate)
        aligned = spec.kv_cache == KVCacheMode.BLOCK.value
        requests = requests_from(trace, spec.block_len, aligned, spec.threshold)
        if policy.order is Order.COST:
            with_unit_costs(requests, rate)
        return behaviour, requests, make_predictor(spec, policy, trace, rate)
    from dilaserve.config import BUNDLED_PREDICTOR
    from dilaserve.control.predictor import OraclePredictor, create_predictor
    from dilaserve.trajectory import load_trajectories

    behaviour = ReplayBehaviour(load_trajectories(spec.behaviour.removeprefix("replay:")))
    rng = np.random.default_rng(spec.seed + 5)
    requests = []
    for i, arrival in enumerate(trace.arrival.tolist()):
        t = behaviour.assign(f"r{i}", int(rng.choice(behaviour.prompts)))
        requests.append(
            Request(f"r{i}", (3,) * t.prompt_len, t.gen_len, t.block_len, 1, 0.9, arrival)
        )
    if policy.predictor == "oracle":
        return behaviour, requests, OraclePredictor(THRESHOLDS, behaviour.remaining_steps)
    folder = spec.predictor_path or BUNDLED_PREDICTOR
    return behaviour, requests, create_predictor(policy.predictor, folder)


def check_profile(spec: SimulationSpec, profile: LatencyProfile) -> None:
    """The profile prices the cluster's first instances, and the cache mode is the model's: a
    block-causal model's cache is exact or none, and the exact cache needs such a model."""
    if spec.initial_tp not in profile.tp_degrees:
        raise ValueError(
            f"{spec.initial_tp=} is not among {spec.profile}'s TP degrees {profile.tp_degrees}"
        )
    block_causal = bool(profile.meta.get("block_causal"))
    if block_causal and spec.kv_cache not in ("block", "none"):
        raise ValueError(
            f"{spec.kv_cache=}: {profile.meta.get('model')} is block-causal; its cache is "
            "exact (kv_cache='block') or none"
        )
    if spec.kv_cache == "block" and not block_causal:
        raise ValueError(f"{spec.kv_cache=} needs a block-causal model's profile (llada2-*)")


def policy_for(spec: SimulationSpec):
    """The spec's policy, with its candidates and, for a fixed-threshold one, its threshold."""
    policy = get_policy(spec.policy)
    if spec.candidates is not None:
        policy = dataclasses.replace(policy, candidates=tuple(spec.candidates))
    if not policy.is_dynamic:
        policy = dataclasses.replace(policy, fixed_threshold=spec.threshold)
    return policy


def simulate(spec: SimulationSpec, progress=None, log: DecisionLog | None = None) -> SimulationRun:
    """Run the spec; `log`: a decision log to record into (one with its lines kept, to read)."""
    profile = load_profile(spec.profile)
    check_profile(spec, profile)
    trace = make_trace(spec)
    policy = policy_for(spec)
    behaviour, requests, predictor = workload(spec, trace, policy, profile.meta.get("model"))
    slo = slo_for(spec, profile, requests, behaviour.tokens_per_step(spec.threshold))
    config = SchedulerConfig(
        kv_cache=spec.kv_cache,
        block_len=spec.block_len,
        slo=slo,
        refresh_every_tokens=spec.refresh_every_tokens,
        max_requests_per_instance=spec.max_requests_per_instance,
        max_batch_requests=spec.max_batch_requests,
        slo_headroom=spec.slo_headroom,
        refresh_interval=spec.refresh_interval,
    )
    reconfigurer = None
    if policy.reconfigure:
        from dilaserve.sim.capacity import nodes_for

        planner = PlannerConfig(
            nodes_for(spec.gpus, spec.gpus_per_node),
            {c: behaviour.tokens_per_step(c) for c in policy.candidates},
            tp_degrees=tuple(d for d in (1, 2, 4, 8) if d in profile.tp_degrees),
            cache_block=config.cache_block,
            exact_cache=config.costs.exact,
            period=spec.planner_period,
            startup_delay=spec.startup_delay,
        )
        reconfigurer = Reconfigurer(profile, planner)
    scheduler = Scheduler(policy, profile, predictor, config, reconfigurer)
    simulator = Simulator(
        scheduler,
        profile,
        behaviour,
        initial_instances(spec),
        SimConfig(
            startup_delay=spec.startup_delay,
            latency_noise=spec.latency_noise,
            max_batch_tokens=spec.max_batch_tokens,
            seed=spec.seed,
        ),
        log=log,
    )
    start = time.perf_counter()
    result = simulator.run(requests, progress=progress)
    wall = time.perf_counter() - start
    quality = QualityModel.from_eval(spec.quality) if spec.quality else LLADA_GSM8K
    rows = metrics.request_records(result.requests, result.unfinished, quality)
    summary = {
        **metrics.summarize(rows),
        **quality_notes(quality, rows, spec, profile.meta.get("model")),
        "slo_s": round(slo, 4),
        "events": result.events,
        "simulated_seconds": round(result.end_time, 2),
        "reconfigurations": len(result.reconfigurations),
        "decision_digest": result.decision_digest,
    }
    timing = {
        "wall_seconds": round(wall, 2),
        "events_per_second": round(result.events / wall, 1) if wall else None,
    }
    return SimulationRun(
        spec, slo, rows, summary, metrics.by_interval(rows, spec.interval), result, timing
    )


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


def make_predictor(spec: SimulationSpec, policy, trace: traces.Trace, rate=None):
    """The policy's step predictor for parametric behaviour (at `rate` tokens per step):
    trained on simulated runs of sample requests of the trace at THRESHOLDS and the policy's
    candidates (full or progress features), or the one-shot rates."""
    from dilaserve.sim.predictor import simulated_trajectories, train_sim_predictor

    name = policy.predictor
    thresholds = tuple(sorted(set(THRESHOLDS) | set(policy.candidates)))
    rng = np.random.default_rng(spec.seed + 3)
    picks = rng.integers(0, len(trace), min(spec.predictor_prompts, len(trace)))
    shapes = [
        (
            int(trace.prompt_tokens[i]),
            -(-int(trace.output_tokens[i]) // spec.block_len) * spec.block_len,
        )
        for i in picks
    ]
    if name in ("full", "progress"):
        features = FEATURE_NAMES if name == "full" else PROGRESS_FEATURES
        behaviour = ParametricBehaviour(seed=spec.seed + 4, tokens_per_step=rate)
        mode = KVCacheMode(spec.kv_cache)
        return train_sim_predictor(behaviour, shapes, thresholds, features=features, mode=mode)
    if name == "oracle":
        raise ValueError(
            "the oracle step predictor knows true remaining steps only for replayed "
            "trajectories: use --behaviour replay:TRAJECTORIES.npz"
        )
    if name == "one-shot":
        from dilaserve.control.predictor import OneShotPredictor
        from dilaserve.training.train_predictor import one_shot_rates

        behaviour = ParametricBehaviour(seed=spec.seed + 4, tokens_per_step=rate)
        mode = KVCacheMode(spec.kv_cache)
        trajs = simulated_trajectories(behaviour, shapes, thresholds, mode=mode)
        return OneShotPredictor(thresholds, one_shot_rates(trajs))
    raise ValueError(f"no simulated step predictor {name!r}")


def initial_instances(spec: SimulationSpec) -> list[InstanceSpec]:
    out = []
    for k in range(spec.gpus // spec.initial_tp):
        first = k * spec.initial_tp
        node, gpu = divmod(first, spec.gpus_per_node)
        gpus = tuple(range(gpu, gpu + spec.initial_tp))
        out.append(InstanceSpec(f"i{k}", node, spec.initial_tp, gpus, spec.max_batch_tokens))
    return out


def write_run(
    run: SimulationRun, root: str | Path, name: str = "simulate", folder: Path | None = None
) -> Path:
    """The run folder (a new one under `root`, or `folder`, made when the run began)."""
    from dilaserve.runs import create_run_dir, markdown_table, write_json, write_records
    from dilaserve.sim.dashboard import write_dashboard

    folder = folder or create_run_dir(root, name)
    write_json(folder / "config.json", {**asdict(run.spec), "slo_s": run.slo})
    write_records(folder / "records.csv", run.rows)
    write_records(folder / "intervals.csv", run.intervals)
    times = [row["start"] for row in run.intervals]
    instances = metrics.instances_at(run.result.instance_log, times)
    write_json(
        folder / "summary.json",
        {**run.summary, "reconfiguration_log": run.result.reconfigurations},
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
    page = write_dashboard(run, folder)  # the live server's page, with this run's data
    lines += [f"\nThe run as the live dashboard shows it: [{page.name}]({page.name})"]
    (folder / "report.md").write_text("\n".join(lines) + "\n")
    return folder
