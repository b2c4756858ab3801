"""Prometheus metrics of a serving cluster (`GET /metrics`).

Counters and histograms are fed by the controller thread through the cluster's `Observer`;
gauges (queue length, requests in flight, instances per TP degree, SLO attainment of those
finished and of every request answered, refusals counted as missed; the measured step slowdown
and how stale it is; degraded health) and the cluster's own counters (migrations,
reconfigurations, instance failures, the planner's rounds by outcome) are read when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dilaserve.cluster.requests import RequestResult
from dilaserve.cluster.runtime import Cluster
from dilaserve.control.reconfigure import STARTUPS, Reconfigurer
from dilaserve.protocol import StepKind, StepOutput
from dilaserve.server.dashboard import LiveFeed

THRESHOLD_BUCKETS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)
STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


# a step batch is labelled by the costliest kind it holds: whole sequences first, then commits
KIND_ORDER = (
    StepKind.FULL,
    StepKind.RECOMPUTE,
    StepKind.PREFILL,
    StepKind.COMMIT,
    StepKind.CACHE,
    StepKind.BLOCK,
)


def step_label(output: StepOutput) -> StepKind:
    """The kind a step batch is counted under (its rows may mix kinds)."""
    kinds = {r.kind for r in output.results}
    return next((k for k in KIND_ORDER if k in kinds), StepKind.CACHE)


class ServerMetrics:
    """The cluster's `Observer` for Prometheus."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dilaserve_requests",
            "Requests by outcome (met_slo, missed_slo, failed, cancelled, rejected)",
            ["outcome"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "dilaserve_generated_tokens",
            "Tokens generated (answers only, as `usage.completion_tokens`)",
            registry=self.registry,
        )
        self.latency = Histogram(
            "dilaserve_request_latency_seconds",
            "Submission to last committed token",
            registry=self.registry,
        )
        self.steps = Histogram(
            "dilaserve_step_seconds",
            "Engine time of one step, by instance and step kind",
            ["instance", "kind"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.step_tokens = Counter(
            "dilaserve_step_batch_tokens",
            "Tokens the steps' forward passes processed, by instance (per step: the batch size)",
            ["instance"],
            registry=self.registry,
        )
        self.kv_drops = Counter(
            "dilaserve_kv_cache_drops",
            "Caches dropped, and stores skipped, to keep within --kv-memory, by instance",
            ["instance"],
            registry=self.registry,
        )
        self.thresholds = Histogram(
            "dilaserve_step_threshold",
            "Confidence threshold of each request step",
            buckets=THRESHOLD_BUCKETS,
            registry=self.registry,
        )
        self.met = self.finished = self.refused = 0
        self._window = _Window()  # since the last `interval_line`
        self.dashboard = LiveFeed()  # what GET /dashboard draws

    def watch(self, cluster: Cluster) -> None:
        """Read the cluster's gauges and counters at every scrape."""
        self.registry.register(_ClusterCollector(cluster, self))
        self.dashboard.watch(cluster)

    # -- Observer (called on the controller thread) ------------------------------------------

    def step_done(self, instance_id: str, tp: int, output: StepOutput, seconds: float) -> None:
        kind = step_label(output)
        self.steps.labels(instance_id, kind.value).observe(seconds)
        self.step_tokens.labels(instance_id).inc(output.num_tokens)
        self.kv_drops.labels(instance_id).inc(len(output.kv_dropped))
        self.dashboard.step_done(instance_id, kind.value, output, seconds)

    def request_done(self, result: RequestResult, thresholds: list[float]) -> None:
        self.finished += 1
        self.met += result.met_slo
        self._window.add(result, thresholds)
        self.requests.labels("met_slo" if result.met_slo else "missed_slo").inc()
        self.latency.observe(result.latency)
        self.tokens.inc(len(result.token_ids))
        for threshold in thresholds:
            self.thresholds.observe(threshold)
        self.dashboard.request_done(result, thresholds)

    def request_failed(self, request_id: str, reason: str) -> None:
        self.requests.labels("cancelled" if reason == "CancelledError" else "failed").inc()
        self.dashboard.request_failed(request_id, reason)

    def rejected(self) -> None:
        self.refused += 1
        self._window.refused += 1
        self.requests.labels("rejected").inc()
        self.dashboard.request_rejected()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def interval_line(self, seconds: float, in_flight: int, waiting: int) -> str | None:
        """The server log's periodic line: what finished in the last `seconds`, how many
        requests were refused (429 for capacity, whose access-log lines are left out:
        `main.RefusalsCounted`; 503 while draining), and the requests in flight and waiting
        now; None if nothing finished and nothing was refused."""
        w, self._window = self._window, _Window()
        if not w.finished and not w.refused:
            return None
        done = f"{w.finished} requests done"
        if w.finished:
            done += (
                f" ({w.met / w.finished:.1%} within their SLO), "
                f"{w.tokens / seconds:.1f} generated tokens/s, mean step threshold "
                f"{w.threshold_sum / max(w.steps, 1):.3f}"
            )
        refused = f", {w.refused} refused (429/503)" if w.refused else ""
        return f"last {seconds:.0f} s: {done}{refused}; {in_flight} in flight, {waiting} waiting"


class _ClusterCollector:
    def __init__(self, cluster: Cluster, metrics: ServerMetrics):
        self.cluster = cluster
        self.metrics = metrics

    def collect(self):
        c, m = self.cluster, self.metrics
        yield from _outcome_metrics(c, m)
        yield from _admission_metrics(c)
        yield from _deadline_metrics(c.deadline, c.deadline_factor)
        yield from _quality_metrics(c)
        yield from _instance_metrics(c, m)


def _outcome_metrics(c: Cluster, m: ServerMetrics):
    """The requests waiting and in flight, and the share finished on time."""
    yield _gauge("dilaserve_queue_length", "Requests waiting for an instance", c.queue_length())
    yield _gauge("dilaserve_requests_in_flight", "Requests admitted, not done", c.in_flight)
    attainment = m.met / m.finished if m.finished else 1.0
    yield _gauge("dilaserve_slo_attainment", "Share of finished requests on time", attainment)
    asked = m.finished + m.refused
    of_arrivals = m.met / asked if asked else 1.0
    text = "Share of requests finished on time, refused ones (429, 503) counted as missed"
    yield _gauge("dilaserve_slo_attainment_of_arrivals", text, of_arrivals)


def _admission_metrics(c: Cluster):
    """What admission counts on: the measured speed, its on-time factor, its capacity."""
    slowdown = (
        "Steps' measured time over the latency profile's (running; priced at >= 1; decays "
        "toward 1 while no step reports)"
    )
    yield _gauge("dilaserve_step_slowdown", slowdown, c.step_slowdown)
    stale = "Seconds the step slowdown has been decaying for want of steps (0: current)"
    yield _gauge("dilaserve_step_slowdown_stale_seconds", stale, c.step_slowdown_stale_seconds)
    factor = (
        "Admission's on-time factor: how many times its predicted time a request is allowed "
        "(the on-time target's quantile of finished requests' taken over predicted time; "
        "decays toward 1 while none finishes)"
    )
    yield _gauge("dilaserve_admission_on_time_factor", factor, c.on_time_factor)
    yield from _capacity_metrics(c.admission_capacity)
    text = (
        "Seconds admission predicted the latest request it priced needs (before its "
        "on-time factor): its steps in the batch it shares (--admission-time batched), or "
        "the load ahead of it over the capacity (queue)"
    )
    yield _gauge("dilaserve_admission_predicted_seconds", text, c.admission_predicted)
    text = (
        "Seconds from receipt to admission per request ahead (the median of the latest 64): "
        "the front takes this much of a newcomer's SLO for each request queued ahead of it"
    )
    yield _gauge("dilaserve_admission_pace_seconds", text, c.admission_pace)
    yield CounterMetricFamily(
        "dilaserve_admission_on_time_measured",
        "Admitted requests whose time admission's on-time calibration measured",
        value=c.on_time.finished,
    )
    yield CounterMetricFamily(
        "dilaserve_admission_on_time_late",
        "Of those, requests that took longer than predicted times the factor then in force",
        value=c.on_time.late,
    )


def _instance_metrics(c: Cluster, m: ServerMetrics):
    """The instances by state and TP degree, and the controller's event counts."""
    stalled = "Instances whose running step is overdue: they take no new work until it ends"
    yield _gauge("dilaserve_instances_stalled", stalled, c.instances_stalled)
    degraded = "1 while /health says degraded (lost capacity, or admission refusing all)"
    yield _gauge("dilaserve_degraded", degraded, float(c.health() == "degraded"))
    if (restored := c.controller.restored_after) is not None:
        text = "Seconds from the latest instance lost to its replacement up"
        yield _gauge("dilaserve_capacity_restored_seconds", text, restored)
    instances = GaugeMetricFamily(
        "dilaserve_instances", "Model instances by tensor-parallel degree", labels=["tp"]
    )
    for tp, count in sorted(c.instances_by_tp().items()):
        instances.add_metric([str(tp)], count)
    yield instances
    tp_of = GaugeMetricFamily(
        "dilaserve_instance_tp",
        "Tensor-parallel degree of each serving instance",
        labels=["instance"],
    )
    for iid, tp in sorted(m.dashboard.timeline.instance_tp.items()):
        tp_of.add_metric([iid], tp)
    yield tp_of
    speed = GaugeMetricFamily(
        "dilaserve_instance_step_slowdown",
        "Each instance's steps' measured time over the latency profile's (running; decays "
        "toward 1 while it reports none): what placement prices it at (--instance-speed)",
        labels=["instance"],
    )
    for iid in sorted(c.scheduler.instances):  # (a copy: the controller's thread adds)
        speed.add_metric([iid], c.scheduler.speed.instance_ratio(iid))
    yield speed
    for name, key, text in (
        ("dilaserve_migrations", "migrations", "Requests moved between instances"),
        ("dilaserve_reconfigurations", "reconfigurations", "Cluster reconfigurations begun"),
        ("dilaserve_instance_failures", "failures", "Instances that died"),
    ):
        yield CounterMetricFamily(name, text, value=c.controller.stats[key])
    text = "Events that held the controller up for over a tick (their steps not measured)"
    yield CounterMetricFamily("dilaserve_controller_stalls", text, c.controller.stalls.count)
    yield from _planner_metrics(c.planner)


def _planner_metrics(planner: Reconfigurer | None):
    """The planner's rounds by outcome and the start-up it prices (`control/reconfigure.py`),
    when the policy has one."""
    if planner is None:
        return
    text = (
        "Planning rounds by outcome: kept (no proposal worth a move), guarded (a move the "
        "guard skipped: too few GPUs serving, not paid back, or a TP-1 fallback carrying "
        "less), applied (a move begun)"
    )
    family = CounterMetricFamily("dilaserve_planner_rounds", text, labels=["outcome"])
    for outcome, count in planner.outcomes.items():
        family.add_metric([outcome], count)
    yield family
    text = (
        "Seconds the planner prices a new instance's start-up at: the longest of the "
        f"latest {STARTUPS} starts measured, or the configured value before any"
    )
    yield _gauge("dilaserve_planner_startup_seconds", text, planner.startup_delay)


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


def _capacity_metrics(capacity: tuple[float, float] | None):
    """Admission's capacity (`control/admission.py`), when it prices by load."""
    if capacity is None:
        return
    served, modelled = capacity
    text = (
        "Token-steps per second admission counts on (before its on-time factor): the model "
        "below, or what each instance's steps measured where that is less (decays back to "
        "the model while an instance runs no step)"
    )
    yield _gauge("dilaserve_admission_capacity", text, served)
    text = "Load control's model of that throughput: the latency profile at the step slowdown"
    yield _gauge("dilaserve_admission_modelled_capacity", text, modelled)


def _deadline_metrics(calibration, factor: float | None):
    """Alg. 1's on-time calibration (`control/on_time.py`), when the policy has one."""
    if calibration is None:
        return
    text = (
        "Alg. 1's deadline factor: how many times its estimated remaining time a request's "
        "threshold is chosen for (the on-time target's quantile of finished requests' taken "
        "over estimated time; decays toward 1 while none finishes)"
    )
    yield _gauge("dilaserve_deadline_factor", text, factor)
    yield CounterMetricFamily(
        "dilaserve_deadline_measured",
        "Requests whose first threshold choice Alg. 1's calibration measured",
        value=calibration.finished,
    )
    yield CounterMetricFamily(
        "dilaserve_deadline_late",
        "Of those, requests that took longer than estimated times the factor then in force",
        value=calibration.late,
    )


def _quality_metrics(c: Cluster):
    """The quality budget's state (`control/quality_budget.py`), when the policy has one."""
    budget = c.quality_budget
    if budget is None:
        return
    now = c.now()
    text = (
        "Relative quality loss of the finished requests against the top threshold's (the "
        "quality curve at their mean thresholds; decays toward 0 while none finishes)"
    )
    yield _gauge("dilaserve_quality_loss", text, budget.loss(now))
    yield _gauge("dilaserve_quality_budget", "The relative quality loss allowed", budget.budget)
    text = "The lowest threshold a request may be given now (the top while over the budget)"
    yield _gauge("dilaserve_quality_floor", text, budget.floor(now))
    yield CounterMetricFamily(
        "dilaserve_quality_floor_raised", "Times the quality floor went up", value=budget.raised
    )


class _Window:
    """What finished since the last log line."""

    def __init__(self):
        self.finished = self.met = self.tokens = self.steps = self.refused = 0
        self.threshold_sum = 0.0

    def add(self, result: RequestResult, thresholds: list[float]) -> None:
        self.finished += 1
        self.met += result.met_slo
        self.tokens += len(result.token_ids)
        self.steps += len(thresholds)
        self.threshold_sum += sum(thresholds)
