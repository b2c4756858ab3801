"""The live dashboard in a real browser: headless Chromium opens /dashboard on a server of the
bundled model, behind an API key, while a bounded load of requests runs, and the page's charts
render and update. Skipped where Chromium is not installed (Debian: `apt-get install chromium`;
`.ci/run` installs it)."""

import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser

import httpx
import pytest
import uvicorn

from dilaserve.cluster.runtime import ClusterConfig
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.server.app import ServerSettings
from dilaserve.server.main import build_app
from dilaserve.tasks import arith

from conftest import HANG_GUARD_S

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed: `apt-get install chromium` (.ci/run installs it)",
)

MODEL = "tiny-llada"
KEY = "dashboard-test-key"
NUM_REQUESTS = 40  # the load: bounded in count
CONCURRENCY = 6
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
CHARTS = ("chart-attainment", "chart-latency", "chart-thresholds", "chart-load", "chart-tokens")


def chromium(url: str, user_data_dir, *args: str, virtual_ms: int = 8000) -> str:
    """Chromium's stdout for `url`, the page's timers run for `virtual_ms` of virtual time."""
    command = [
        CHROMIUM,
        *FLAGS,
        f"--user-data-dir={user_data_dir}",
        f"--virtual-time-budget={virtual_ms}",
        *args,
        url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class _Elements(HTMLParser):
    """The attributes of every element with an id, and the text of `code` elements."""

    def __init__(self):
        super().__init__()
        self.by_id: dict[str, dict] = {}
        self.svgs: list[dict] = []
        self.text: dict[str, str] = {}
        self._open: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.by_id[attrs["id"]] = attrs
        if tag == "svg":
            self.svgs.append(attrs)
        if tag == "body":
            self.by_id["body"] = attrs
        self._open = attrs.get("id")

    def handle_endtag(self, tag):
        self._open = None

    def handle_data(self, data):
        if self._open:
            self.text[self._open] = self.text.get(self._open, "") + data


def parse(dom: str) -> _Elements:
    elements = _Elements()
    elements.feed(dom)
    return elements


@pytest.fixture(scope="module")
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # over capacity (a busy machine), requests are served last, not refused: the test is of
    # the page, and must not depend on what admission makes of the machine's speed
    worker = WorkerConfig(threads=1)
    config = ClusterConfig(worker, instances=(1, 1), tick=0.2, overload="deprioritize")
    settings = ServerSettings(MODEL, f"http://127.0.0.1:{port}", api_key=KEY)
    app, _ = build_app(config, settings)
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


def _load(address: str) -> list[int]:
    """NUM_REQUESTS chat requests, CONCURRENCY at a time, priorities 0 and 1."""
    questions = [p.question for p in arith.generate(NUM_REQUESTS, seed=11, split="test")]
    headers = {"Authorization": f"Bearer {KEY}"}

    def ask(k: int) -> int:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": questions[k]}],
            "priority": k % 2,
        }
        url = f"http://{address}/v1/chat/completions"
        return httpx.post(url, json=body, headers=headers, timeout=HANG_GUARD_S).status_code

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(ask, range(NUM_REQUESTS)))


def test_the_page_renders_and_updates_under_load_in_chromium(server, tmp_path):
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(_load, server)
        time.sleep(2)  # some requests under way
        # the key as the Basic password, as a person types it into the browser's prompt
        dom = chromium(f"http://user:{KEY}@{server}/dashboard", tmp_path / "profile", "--dump-dom")
        assert load.result() == [200] * NUM_REQUESTS
    page = parse(dom)
    body = page.by_id["body"]
    assert page.by_id["status"].get("hidden") is not None, page.text.get("status")
    assert int(body["data-refreshes"]) >= 3  # it polled, and drew each answer
    assert float(body["data-now"]) > float(body["data-first-now"])  # newer data each time
    assert page.text["about-model"] == MODEL and page.text["source"] == "live"
    for chart in CHARTS:
        assert int(page.by_id[chart]["data-points"]) > 0, chart
    instance_charts = [s for s in page.svgs if "data-instance" in s]
    assert {s["data-instance"] for s in instance_charts} == {"i0", "i1"}
    assert sum(int(s["data-points"]) for s in instance_charts) > 0


def test_without_the_key_the_browser_gets_neither_page_nor_data(server, tmp_path):
    page = chromium(f"http://{server}/dashboard", tmp_path / "page", "--dump-dom")
    assert "lineChart" not in page and "window.DASHBOARD" not in page
    data = chromium(f"http://{server}/dashboard/data", tmp_path / "data", "--dump-dom")
    assert "a valid API key is required" in data and '"series"' not in data
