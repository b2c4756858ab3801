"""The dashboard: the timeline's series (bounded whatever the load), the page (self-contained,
data embedded safely), the live feed over a cluster, /dashboard behind the API key, a simulated
run's dashboard-data.js, and the Grafana dashboard's queries against what /metrics exports."""

import base64
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi.testclient import TestClient

from dilaserve.control.quality_budget import QualityBudget
from dilaserve.dashboard.page import live_page, read_data, static_page
from dilaserve.dashboard.timeline import THRESHOLD_EDGES, Timeline
from dilaserve.protocol import StepKind, StepOutput
from dilaserve.quality import LLADA_GSM8K
from dilaserve.server.app import ServerSettings, create_app
from dilaserve.server.dashboard import TOKEN_SECONDS, dashboard_token, is_authorised
from dilaserve.server.metrics import THRESHOLD_BUCKETS, ServerMetrics

GRAFANA = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dilaserve.json"
MODEL = "tiny-llada"
META = {"source": "test", "model": MODEL, "policy": "fcfs", "calibration": None, "slo_s": 1.0}


# -- the timeline ---------------------------------------------------------------------------


def test_attainment_per_interval_overall_and_per_priority():
    t = Timeline(interval=2.0, keep=10)
    for now, met, priority in ((0.5, True, 0), (1.5, False, 1), (2.5, True, 1), (7.0, True, 0)):
        t.request_done(now, 0.1, met, priority, [0.9], 4)
    s = t.to_json(7.5, META)["series"]
    assert s["t"] == [0.0, 2.0, 4.0, 6.0]
    assert s["finished"] == [2, 1, 0, 1]
    assert s["attainment"] == [0.5, 1.0, None, 1.0]
    assert s["attainment_by_priority"] == {"0": [1.0, None, None, 1.0], "1": [0.0, 1.0, None, None]}
    assert s["tokens_per_s"] == [4.0, 2.0, 0.0, 2.0]


def test_latency_percentiles_are_within_the_bins_resolution():
    t = Timeline(interval=10.0)
    latencies = np.random.default_rng(0).lognormal(0.0, 1.0, 2000)
    for latency in latencies:
        t.request_done(1.0, float(latency), True, 0, [], 1)
    s = t.to_json(2.0, META)["series"]
    for q in (50, 90, 99):
        exact = float(np.percentile(latencies, q))
        assert s[f"latency_p{q}"][0] == pytest.approx(exact, rel=0.05), q


def test_thresholds_fall_in_the_prometheus_histograms_buckets():
    assert THRESHOLD_EDGES == THRESHOLD_BUCKETS  # the page and Grafana show the same buckets
    t = Timeline()
    t.request_done(0.0, 0.1, True, 0, [0.5, 0.55, 0.9, 0.9, 0.97, 1.0], 1)
    assert t.to_json(0.0, META)["series"]["thresholds"] == [[1, 1, 0, 0, 0, 2, 0, 2]]


def test_steps_per_instance_and_kind_and_the_instances_serving():
    t = Timeline(interval=1.0)
    t.set_instances(0.0, {"i0": 1, "i1": 2})
    t.step_done(0.2, "i0", "recompute", 300, 0.030)
    t.step_done(0.4, "i0", "cache", 100, 0.010)
    t.step_done(0.6, "i0", "cache", 200, 0.020)
    t.step_done(1.2, "i1", "cache", 64, 0.005)
    data = t.to_json(1.5, META)
    i0 = data["instances"]["i0"]
    assert i0["tp"] == 1 and i0["steps"] == [3, 0] and i0["batch_tokens"] == [200.0, None]
    assert i0["step_ms"] == {"cache": [15.0, None], "recompute": [30.0, None]}
    assert data["current"]["instances"][1] == {
        "id": "i1",
        "tp": 2,
        "batch_tokens": 64.0,
        "step_ms": {"cache": 5.0},
    }
    assert data["series"]["instances_by_tp"] == {"1": [1, 1], "2": [1, 1]}


def test_gauges_keep_the_largest_per_interval_and_gaps_are_filled():
    t = Timeline(interval=1.0, keep=5)
    t.sample(0.1, queue=3, in_flight=10)
    t.sample(0.9, queue=1, in_flight=4)
    t.sample(3.5, queue=0, in_flight=2)
    data = t.to_json(3.6, META)
    assert data["series"]["t"] == [0.0, 1.0, 2.0, 3.0]
    assert data["series"]["queue"] == [3, 0, 0, 0] and data["series"]["in_flight"] == [10, 0, 0, 2]
    assert data["current"]["queue"] == 0 and data["current"]["in_flight"] == 2


def test_priorities_past_the_limit_are_drawn_together():
    t = Timeline()
    for priority in range(12):
        t.request_done(0.0, 0.1, True, priority, [], 1)
    names = list(t.to_json(0.0, META)["series"]["attainment_by_priority"])
    assert names == [str(p) for p in range(8)] + ["other"]


def test_memory_and_data_stay_bounded_whatever_the_number_of_requests():
    def run(num_requests: int) -> str:
        t = Timeline(interval=1.0, keep=30)
        rng = np.random.default_rng(1)
        for k in range(num_requests):
            now = 100 * k / num_requests
            t.request_done(now, float(rng.lognormal()), bool(k % 3), k % 4, [0.9, 0.7], 32)
            t.step_done(now, f"i{k % 4}", "cache", 128, 0.01)
            t.sample(now, k % 50, 1000)
        return json.dumps(t.to_json(100.0, META))

    small, large = run(2_000), run(100_000)
    assert len(json.loads(large)["series"]["t"]) == 30
    assert len(large) < 1.2 * len(small)  # the data does not grow with the requests


def test_a_bad_interval_or_history_names_the_field():
    with pytest.raises(ValueError, match="interval"):
        Timeline(interval=0)
    with pytest.raises(ValueError, match="keep"):
        Timeline(keep=0)


# -- the page -------------------------------------------------------------------------------


def test_the_page_is_self_contained():
    page = live_page("/dashboard/data")
    assert 'window.DASHBOARD = {"url": "/dashboard/data", "refresh_ms": 2000}' in page
    assert not re.search(r"""(src|href)\s*=""", page)  # nothing fetched: every part inlined
    assert "function lineChart" in page and "<style>" in page


def test_embedded_data_cannot_close_the_script():
    data = {**Timeline().to_json(0.0, META), "model": "</script><script>alert(1)</script>"}
    page = static_page(data)
    assert "</script><script>alert(1)" not in page
    literal = re.search(r"window\.DASHBOARD = (.*);\n", page).group(1)
    assert json.loads(literal)["data"]["model"] == data["model"]


# -- the live feed and /dashboard -----------------------------------------------------------


class _Cluster:
    """Just enough of a Cluster for the feed, the metrics and the app (not managed)."""

    step_slowdown = 1.0
    step_slowdown_stale_seconds = 0.0
    instances_stalled = 0
    on_time_factor = 1.0
    on_time = SimpleNamespace(finished=0, late=0)
    deadline_factor = 1.25
    deadline = SimpleNamespace(finished=4, late=1)
    quality_budget = QualityBudget(LLADA_GSM8K, (0.9, 0.8, 0.7))
    admission_capacity = (900.0, 1000.0)  # (served, modelled) token-steps per second
    admission_predicted = 0.5  # seconds, the latest request priced
    admission_pace = 0.002  # seconds per request ahead
    planner = SimpleNamespace(  # a `Reconfigurer`
        outcomes={"kept": 3, "guarded": 1, "applied": 0}, startup_delay=30.0
    )

    def __init__(self):
        self.config = SimpleNamespace(
            control=SimpleNamespace(policy="dilaserve", scheduler=SimpleNamespace(slo=2.0)),
            instances=(1, 2),
            worker=SimpleNamespace(engine=SimpleNamespace(device="cpu")),
        )
        self.accepting, self.in_flight = True, 0
        stats = {"migrations": 0, "reconfigurations": 0, "failures": 0}
        stalls = SimpleNamespace(count=0)
        self.controller = SimpleNamespace(
            stats=stats, stalls=stalls, rollout=SimpleNamespace(log=[]), restored_after=None
        )
        inst = {"i0": SimpleNamespace(tp=1), "i1": SimpleNamespace(tp=2)}
        speed = SimpleNamespace(instance_ratio={"i0": 1.0, "i1": 2.5}.get)
        self.scheduler = SimpleNamespace(instances=inst, requests={}, speed=speed)

    def now(self):
        return 0.0

    def queue_length(self):
        return 3

    def instances_by_tp(self):
        return {1: 1, 2: 1}

    def health(self):
        return "ok"


def _step(*rids: str) -> StepOutput:
    empty = np.zeros(0)
    results = tuple(
        SimpleNamespace(request_id=r, kind=StepKind.CACHE, positions=empty) for r in rids
    )
    return StepOutput(results, 64)


def _result(rid: str, met: bool):
    return SimpleNamespace(request_id=rid, latency=0.5, met_slo=met, token_ids=(1, 2, 3))


def test_the_live_feed_reads_priorities_events_and_gauges_from_the_cluster():
    cluster, metrics = _Cluster(), ServerMetrics()
    metrics.watch(cluster)
    request = SimpleNamespace(priority=5)
    cluster.scheduler.requests = {"a": SimpleNamespace(request=request)}
    metrics.step_done("i0", 1, _step("a"), 0.02)
    cluster.scheduler.requests = {}  # the scheduler forgets a finished request
    cluster.controller.stats.update(migrations=2, reconfigurations=1, failures=1)
    cluster.controller.rollout.log.append({"time": 1.1, "target": {1: 2, 2: 0}})
    metrics.dashboard.request_done(_result("a", True), [0.9])
    metrics.dashboard.request_failed("b", "CancelledError")  # not a failure
    metrics.dashboard.request_failed("c", "RuntimeError")
    metrics.rejected()  # refused at admission
    data = metrics.dashboard.data(META)
    assert data["series"]["attainment_by_priority"] == {"5": [1.0]}
    assert data["totals"]["failed"] == 1 and data["totals"]["migrations"] == 2
    assert data["totals"]["rejected"] == 1 and data["series"]["rejected"] == [1]
    # the headline counts the refusal as a miss: 1 on time of 2 answered
    assert data["totals"]["attainment"] == 1.0
    assert data["totals"]["attainment_of_arrivals"] == 0.5
    assert data["series"]["attainment_of_arrivals"] == [0.5]
    assert data["current"]["slowdown"] == 1.0 and data["series"]["slowdown"] == [1.0]
    assert data["current"]["deadline_factor"] == 1.25  # Alg. 1's calibration, now
    # the quality budget's loss read (none finished yet) and the budget, now
    assert (data["current"]["quality_loss"], data["current"]["quality_budget"]) == (0.0, 0.01)
    assert [e["kind"] for e in data["events"]] == ["reconfiguration", "instance failure"]
    assert data["events"][0]["text"] == "to 2 x TP-1, 0 x TP-2"
    assert data["current"]["queue"] == 3
    assert [i["tp"] for i in data["current"]["instances"]] == [1, 2]


def _app(api_key=None):
    cluster, metrics = _Cluster(), ServerMetrics()
    settings = ServerSettings(MODEL, api_key=api_key, calibration={"source": "test"})
    return create_app(cluster, settings, metrics, manage=False), metrics


def test_the_dashboard_and_its_data_are_served():
    app, _ = _app()
    with TestClient(app) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        data = client.get("/dashboard/data").json()
        assert data["model"] == MODEL and data["policy"] == "dilaserve"
        assert data["calibration"] == {"source": "test"} and data["slo_s"] == 2.0


def _basic(user: str, password: str) -> dict:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def test_with_an_api_key_the_dashboard_needs_it_as_a_token_or_a_basic_password():
    app, _ = _app(api_key="sekret")
    with TestClient(app) as client:
        for path in ("/dashboard", "/dashboard/data"):
            assert client.get(path).status_code == 401
            assert client.get(path, headers=_basic("me", "wrong")).status_code == 401
            assert client.get(path, headers={"Authorization": "Basic !!"}).status_code == 401
            assert client.get(path, headers=_basic("anyone", "sekret")).status_code == 200
            assert client.get(path, headers={"Authorization": "Bearer sekret"}).status_code == 200
        # only the page asks a browser for the key (a script's request must not raise a prompt)
        assert client.get("/dashboard").headers["www-authenticate"].startswith("Basic")
        assert "www-authenticate" not in client.get("/dashboard/data").headers
        # a Basic password opens the dashboard only, not the API
        assert client.get("/v1/models", headers=_basic("me", "sekret")).status_code == 401
        assert "www-authenticate" not in client.get("/v1/models").headers


def test_the_page_carries_a_token_that_opens_its_data_and_nothing_else():
    app, _ = _app(api_key="sekret")
    with TestClient(app) as client:
        page = client.get("/dashboard", headers=_basic("me", "sekret")).text
        token = json.loads(re.search(r"window\.DASHBOARD = (.*);\n", page).group(1))["token"]
        assert "sekret" not in token
        bearer = {"Authorization": f"Bearer {token}"}
        assert client.get("/dashboard/data", headers=bearer).status_code == 200
        assert client.get("/v1/models", headers=bearer).status_code == 401
    assert '"token"' not in live_page("/dashboard/data")  # no key: no token


def test_the_dashboard_token_expires():
    token = dashboard_token("sekret", 1000.0)
    bearer = f"Bearer {token}".encode()
    assert is_authorised("/dashboard/data", bearer, "sekret", now=1000.0 + TOKEN_SECONDS - 1)
    assert not is_authorised("/dashboard/data", bearer, "sekret", now=1000.0 + TOKEN_SECONDS)
    assert not is_authorised("/dashboard/data", bearer, "other", now=1000.0)
    expires, _, mac = token.partition(".")
    later = f"Bearer {int(expires) + TOKEN_SECONDS:.0f}.{mac}".encode()  # a forged expiry
    assert not is_authorised("/dashboard/data", later, "sekret", now=1000.0)
    assert not is_authorised("/v1/models", bearer, "sekret", now=1000.0)
    assert not is_authorised("/dashboard/data", b"Bearer \xb2.x", "sekret", now=1000.0)


# -- a simulated run's data --------------------------------------------------------------


def test_a_simulation_run_folder_holds_only_the_data_of_the_page(tmp_path):
    from dilaserve.sim.run import SimulationSpec, simulate, write_run

    spec = SimulationSpec(trace="poisson:2:20", gpus=2, predictor_prompts=20, seed=3)
    run = simulate(spec)
    folder = write_run(run, tmp_path)
    assert not (folder / "dashboard.html").exists()  # the page is the package's, shared
    script = (folder / "dashboard-data.js").read_text()
    assert script.startswith("window.DASHBOARD = {") and "function lineChart" not in script
    assert f"dilaserve dashboard {folder}" in (folder / "report.md").read_text()
    data = read_data(folder)
    assert data["source"] == "simulation" and data["policy"] == spec.policy
    assert data["totals"]["finished"] == run.summary["requests"]
    assert data["totals"]["attainment"] == pytest.approx(run.summary["slo_attainment"], abs=1e-4)
    assert sum(data["series"]["finished"]) == run.summary["requests"]
    assert max(data["series"]["in_flight"]) > 0 and data["series"]["instances_by_tp"]
    assert data["current"]["quality_loss"] == run.summary["quality_loss_read"]
    assert data["current"]["quality_budget"] == run.summary["quality_budget"] == 0.01


# -- Grafana --------------------------------------------------------------------------------


def _exported_names() -> set[str]:
    """Every series name /metrics exports once each kind of thing has happened."""
    cluster, metrics = _Cluster(), ServerMetrics()
    metrics.watch(cluster)
    metrics.step_done("i0", 1, _step("a"), 0.02)
    result = SimpleNamespace(request_id="a", latency=0.5, met_slo=True, token_ids=(1,))
    metrics.request_done(result, [0.9])
    metrics.request_failed("b", "RuntimeError")
    metrics.rejected()
    metrics.dashboard.data(META)  # samples the instances
    lines = metrics.render().decode().splitlines()
    return {re.match(r"[a-zA-Z_:]+", line).group(0) for line in lines if not line.startswith("#")}


def _queries(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [q for value in node.values() for q in _queries(value)]
    if isinstance(node, list):
        return [q for value in node for q in _queries(value)]
    return []


def test_metrics_count_the_planners_rounds_by_outcome():
    cluster, metrics = _Cluster(), ServerMetrics()
    metrics.watch(cluster)
    text = metrics.render().decode()
    assert 'dilaserve_planner_rounds_total{outcome="kept"} 3.0' in text
    assert 'dilaserve_planner_rounds_total{outcome="guarded"} 1.0' in text
    assert "dilaserve_planner_startup_seconds 30.0" in text
    cluster.planner = None  # a policy that does not reconfigure
    assert "dilaserve_planner_rounds" not in metrics.render().decode()


def test_every_metric_the_grafana_dashboard_queries_is_exported():
    dashboard = json.loads(GRAFANA.read_text())
    queries = _queries(dashboard)
    assert len(queries) >= 15
    used = {name for q in queries for name in re.findall(r"\bdilaserve_[a-z_]+", q)}
    exported = _exported_names()
    missing = sorted(used - exported)
    assert not missing, f"queried but not exported: {missing}"
    labels = {label for q in queries for label in re.findall(r"by \(([a-z_, ]+)\)", q)}
    assert "instance, kind" not in labels  # Prometheus renames the metrics' instance label
