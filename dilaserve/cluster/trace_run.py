"""`dilaserve run-trace`: replay a trace's arrivals against an in-process cluster.

Each arrival of the trace (a trace CSV, or `poisson:RPS:SECONDS`) submits a held-out problem of
the bundled task, in turn, with the run's SLO. Records per request (latency, time to first
block, SLO met, steps, mean threshold, exact-match correctness) and a summary (SLO attainment,
latency percentiles, accuracy, step round-trip overhead, migrations, failures, requests refused
by admission control, which count as missed) go to a run folder. With `parity`, the run is
also replayed in the simulator from its recorded step outcomes and durations, and the summary
says whether the decision logs are identical. With `predict` (recorded trajectories of the
model), the simulator also predicts the run from its own models (`sim/run_prediction.py`: the
profile's durations, other prompts' trajectories), and the summary sets its SLO attainment and
latency beside the real ones.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from dilaserve.cluster.requests import Overloaded
from dilaserve.cluster.runtime import Cluster, ClusterConfig
from dilaserve.sim import metrics, synthetic, traces
from dilaserve.tasks import arith


@dataclass(frozen=True)
class TraceRunSpec:
    trace: str = "poisson:4:20"  # a trace CSV, or poisson:RPS:SECONDS
    rate_scale: float = 1.0  # arrivals this many times as fast
    duration: float | None = None  # keep the first N seconds
    max_requests: int | None = None
    slo: float = 1.0  # seconds from submission
    seed: int = 0
    parity: bool = False
    predict: str | None = None  # recorded trajectories: also write the simulator's prediction
    predict_slowdown: float = 1.0  # the host's step slowdown the prediction assumes (a
    # calibration run's `step_time_ratio`; `sim/run_prediction.py`)
    # or per batch size (a calibration run's `step_time_ratio_by_batch`; None: the one above)
    predict_slowdown_by_batch: dict[int, float] | None = None

    def __post_init__(self):
        if self.rate_scale <= 0 or self.slo <= 0 or self.predict_slowdown <= 0:
            raise ValueError(
                f"{self.rate_scale=}, {self.slo=} and {self.predict_slowdown=} must be positive"
            )


def trace_arrivals(spec: TraceRunSpec) -> np.ndarray:
    if spec.trace.startswith("poisson:"):
        rate, seconds = synthetic.parse_poisson(spec.trace)
        arrival = synthetic.poisson_arrivals(rate, seconds, np.random.default_rng(spec.seed))
    else:
        arrival = traces.load_trace(spec.trace).arrival
    arrival = (arrival - arrival.min()) / spec.rate_scale if len(arrival) else arrival
    if spec.duration is not None:
        arrival = arrival[arrival < spec.duration]
    if spec.max_requests is not None:
        arrival = arrival[: spec.max_requests]
    if not len(arrival):
        raise ValueError(f"trace {spec.trace!r} has no arrivals to replay")
    return arrival


def run_trace(config: ClusterConfig, spec: TraceRunSpec, progress=None) -> dict:
    """Replay the trace; returns {"rows", "summary", "log_lines"}."""
    arrival = trace_arrivals(spec)
    problems = arith.generate(len(arrival), seed=spec.seed + 11, split="test")
    cluster = Cluster(config).start()
    try:
        handles, asked, refused = [], [], 0
        for i, (t, problem) in enumerate(zip(arrival.tolist(), problems)):
            delay = t - cluster.now()
            if delay > 0:
                time.sleep(delay)
            try:
                question, rid = problem.question, f"r{i}"  # (the result only: no stream)
                handles.append(cluster.submit(question, slo=spec.slo, request_id=rid, stream=False))
                asked.append(problem)
            except Overloaded:  # admission control: counted, and a missed SLO
                refused += 1
            if progress is not None and (i + 1) % 10 == 0:
                progress(i + 1, len(arrival))
        correct = {}
        for handle, problem in zip(handles, asked):
            try:
                correct[handle.request_id] = (
                    arith.extract_answer(handle.result().text) == problem.answer
                )
            except (RuntimeError, ValueError):  # failed, or refused (a 400: `InvalidRequest`)
                correct[handle.request_id] = False
    finally:
        cluster.close()
    requests = [h.request for h in handles]
    done = [r for r in requests if r.finish_time is not None]
    rows = metrics.request_records(done, [r for r in requests if r.finish_time is None], None)
    for row in rows:
        row["correct"] = correct[row["request_id"]]
    summary = {
        **metrics.summarize(rows),
        # refused by `submit` (the room admission left between events, or the in-flight limit),
        # never recorded; the controller's own refusals are `refused`, below. Both count as
        # missed in the attainment of arrivals
        "refused_at_submit": refused,
        "slo_attainment_of_arrivals": round(sum(row["met_slo"] for row in rows) / len(arrival), 4),
        **_runtime_summary(cluster, rows),
    }
    for row in rows:
        del row["quality"]  # measured here: `correct`
    summary = {k: v for k, v in summary.items() if "quality" not in k}
    if spec.parity:
        summary["parity"] = _parity(cluster, config)
    if spec.predict:
        summary["prediction"] = _prediction(cluster, config, spec, summary)
    return {"rows": rows, "summary": summary, "log_lines": cluster.controller.log.lines or []}


def _runtime_summary(cluster: Cluster, rows: list[dict]) -> dict:
    controller = cluster.controller
    # timings of the latest steps (all of them, in any run shorter than STEP_TIMES_KEPT steps)
    trips = np.array(controller.step_times) if controller.step_times else np.zeros((1, 2))
    return {
        "accuracy": round(float(np.mean([r["correct"] for r in rows])), 4),
        "steps_run": controller.steps_run,
        "step_engine_ms_mean": round(1e3 * float(trips[:, 1].mean()), 3),
        "step_round_trip_ms_mean": round(1e3 * float(trips[:, 0].mean()), 3),
        "controller_overhead_ms_mean": round(1e3 * float((trips[:, 0] - trips[:, 1]).mean()), 3),
        "controller_overhead_ms_p99": round(
            1e3 * float(np.percentile(trips[:, 0] - trips[:, 1], 99)), 3
        ),
        # steps' round trips over the profile's price, summed over the run (1 when the
        # cluster does not measure its speed): what a prediction of this host takes
        "step_time_ratio": round(cluster.step_time_ratio, 4),
        "step_time_ratio_by_batch": {  # the same per batch size (`run_ratio_by_batch`)
            b: round(r, 4) for b, r in cluster.step_time_ratio_by_batch.items()
        },
        **controller.stats,
        "decision_digest": controller.log.digest,
    }


def _parity(cluster: Cluster, config: ClusterConfig) -> dict:
    from dilaserve.sim.replay import ParityError, replay

    recording = cluster.controller.recording
    try:
        _, lines = replay(
            recording.requests,
            recording.launches,
            config.control,
            config.initial_specs(),
            config.tick,
            config.max_batch_tokens,
            config.measured_speed,
            recording.unmeasured,
            recording.voided,
        )
    except ParityError as e:
        return {"identical": False, "error": str(e)}
    ours = cluster.controller.log.lines
    first = next((i for i, (a, b) in enumerate(zip(ours, lines)) if a != b), None)
    identical = first is None and len(ours) == len(lines)
    return {"identical": identical, "decisions": len(ours), "first_difference": first}


def _prediction(cluster: Cluster, config: ClusterConfig, spec: TraceRunSpec, real: dict) -> dict:
    """The simulator's prediction of this run from its own models (`sim/run_prediction.py`), and how
    far it is from what happened; `at_run_speed`: the same, given the slowdown the host turned
    out to run at (`step_time_ratio`), which separates the models' error from the host's drift
    between the calibration and the run."""
    recording = cluster.controller.recording  # every request admission saw, in arrival order
    arrived = sorted(recording.requests + recording.refused, key=lambda r: r.arrival_time)
    ahead = _predicted(
        arrived, config, spec, spec.predict_slowdown, spec.predict_slowdown_by_batch, real
    )
    by_batch = real["step_time_ratio_by_batch"] if spec.predict_slowdown_by_batch else None
    after = _predicted(arrived, config, spec, real["step_time_ratio"], by_batch, real)
    return {**ahead, "trajectories": spec.predict, "at_run_speed": after}


def _predicted(
    arrived, config: ClusterConfig, spec: TraceRunSpec, slowdown: float, by_batch, real: dict
):
    from dilaserve.sim.run_prediction import predict, prediction_summary

    result = predict(
        arrived,
        config.control,
        spec.predict,
        config.initial_specs(),
        config.tick,
        config.max_batch_tokens,
        spec.seed,
        config.overload,
        slowdown,
        config.measured_speed,
        by_batch,
        config.admission_time,
    )
    predicted = prediction_summary(result)
    return {
        **predicted,
        "step_slowdown": slowdown,
        "step_slowdown_by_batch": by_batch,
        "slo_attainment_error_pp": round(
            100 * (predicted["slo_attainment"] - real["slo_attainment"]), 2
        ),
        "latency_mean_ratio": round(predicted["latency_mean"] / real["latency_mean"], 3),
    }


def write_trace_run(run: dict, config: ClusterConfig, spec: TraceRunSpec, root) -> str:
    from dilaserve.runs import create_run_dir, environment, write_json, write_records

    folder = create_run_dir(root, "run-trace")
    write_json(
        folder / "config.json",
        {"cluster": asdict(config), "trace": asdict(spec), "environment": environment()},
    )
    write_records(folder / "records.csv", run["rows"])
    write_json(folder / "summary.json", run["summary"])
    (folder / "decisions.log").write_text("\n".join(run["log_lines"]) + "\n")
    lines = ["# run-trace", ""] + [f"- {k}: {v}" for k, v in run["summary"].items()]
    (folder / "report.md").write_text("\n".join(lines) + "\n")
    return str(folder)
