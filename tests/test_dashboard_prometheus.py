"""The Grafana dashboard's queries in a real Prometheus: Prometheus (Debian's `prometheus`)
scrapes a server of the bundled model every second while chat requests run, and every query of
`deploy/grafana/dilaserve.json` evaluates, and those of the panels return series. Skipped where
Prometheus is not installed (`.ci/run` installs it)."""

import json
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn

from dilaserve.cluster.runtime import ClusterConfig
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.server.app import ServerSettings
from dilaserve.server.main import build_app
from dilaserve.tasks import arith

from conftest import HANG_GUARD_S

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="Prometheus is not installed: `apt-get install prometheus` (.ci/run installs it)",
)

GRAFANA = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dilaserve.json"
MODEL = "tiny-llada"
NUM_REQUESTS = 30  # bounded in count
WINDOW = "30s"  # what Grafana's $__rate_interval and $__interval stand for here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    config = ClusterConfig(WorkerConfig(threads=1), instances=(1, 1), tick=0.2)
    app, _ = build_app(config, ServerSettings(MODEL, f"http://127.0.0.1:{port}"))
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    server.should_exit = True
    thread.join(60)


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prometheus")
    config = folder / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: dilaserve\n"
        f'    static_configs:\n      - targets: ["{server}"]\n'
    )
    port = free_port()
    command = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}"]
    command.append(f"--web.listen-address=127.0.0.1:{port}")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(HANG_GUARD_S)


def _load(server: str) -> list[int]:
    questions = [p.question for p in arith.generate(NUM_REQUESTS, seed=13, split="test")]

    def ask(k: int) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": questions[k]}]}
        url = f"http://{server}/v1/chat/completions"
        return httpx.post(url, json=body, timeout=HANG_GUARD_S).status_code

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(ask, range(NUM_REQUESTS)))


def query(prometheus: str, expr: str) -> dict:
    expr = expr.replace("$__rate_interval", WINDOW).replace("$__interval", WINDOW)
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=HANG_GUARD_S)
    return answer.raise_for_status().json()


def _value(prometheus: str, expr: str) -> float:
    """`expr`'s one value now; 0 while it has none or Prometheus does not answer yet."""
    try:
        result = query(prometheus, expr)["data"]["result"]
    except (httpx.TransportError, httpx.HTTPStatusError):  # not listening, or not ready
        return 0.0
    return float(result[0]["value"][1]) if result else 0.0


def _wait_for(prometheus: str, expr: str, at_least: float) -> None:
    """Until `expr` reaches `at_least`: a hang guard, not a speed bound (on a busy machine
    scrapes come late)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while _value(prometheus, expr) < at_least:
        assert time.monotonic() < deadline, f"{expr} stayed under {at_least}"
        time.sleep(1)


def test_every_grafana_query_evaluates_on_the_scraped_metrics(server, prometheus):
    _wait_for(prometheus, "count_over_time(up[5m])", 2)
    assert _load(server) == [200] * NUM_REQUESTS
    finished = time.time()
    _wait_for(prometheus, "count_over_time(up[5m])", 10)
    _wait_for(prometheus, "max(timestamp(up))", finished)  # a scrape after the last request
    dashboard = json.loads(GRAFANA.read_text())
    panels = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    [steps_by_instance] = [
        p["targets"][0]["expr"]
        for p in dashboard["panels"]
        if p["title"] == "Steps per second by instance"
    ]
    annotations = [a["expr"] for a in dashboard["annotations"]["list"]]
    for expr in panels + annotations:
        answer = query(prometheus, expr)
        assert answer["status"] == "success", (expr, answer.get("error"))
        if expr in panels:
            assert answer["data"]["result"], f"no series for {expr}"
    by_instance = query(prometheus, steps_by_instance)["data"]["result"]
    assert {r["metric"]["exported_instance"] for r in by_instance} == {"i0", "i1"}
