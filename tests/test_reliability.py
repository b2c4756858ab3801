"""Regression tests of issue 22 at the HTTP front: no single request, fault or shutdown takes
the service down or lets anyone in. Each test names the bug it guards against; the cluster's
own are in tests/test_reliability_cluster.py."""

import contextlib
import gc
import json
import signal
import socket
import threading
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from live_cluster import QUESTIONS, config

from dilaserve.cluster import intake
from dilaserve.cluster.runtime import ClusterConfig, Overloaded
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.server.app import ServerSettings, create_app
from dilaserve.server.guards import allowed_hosts_for
from dilaserve.server.main import DrainingServer, build_app, serve
from dilaserve.server.metrics import ServerMetrics

from conftest import HANG_GUARD_S, AnyIntake, refused_handle, wait_until

# -- a live server of one instance, for the HTTP-level bugs ---------------------------------


class LiveServer:
    """The app of `build_app` on a real cluster, run by uvicorn in a thread."""

    def __init__(self, **settings):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        settings = ServerSettings(MODEL, self.url, **settings)
        app, self.cluster = build_app(config(tick=0.2), settings)
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(HANG_GUARD_S)


MODEL = "tiny-llada"
CALIBRATION = {"source": "preset", "name": "tiny-llada-cpu"}


@pytest.fixture(scope="module")
def live():
    server = LiveServer(calibration=CALIBRATION, max_body_bytes=200_000)
    yield server
    server.stop()


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": QUESTIONS[0], "max_tokens": 32, **kw}


# -- bug 2: one large prompt froze everything -----------------------------------------------


def test_a_body_over_the_limit_is_a_413_in_openai_shape(live):
    big = completion(prompt="x " * 150_000)
    with httpx.Client(base_url=live.url) as client:
        r = client.post("/v1/completions", json=big)
        assert r.status_code == 413 and "200000 bytes" in r.json()["error"]["message"]
        chunks = (json.dumps(big)[i : i + 65536].encode() for i in range(0, 400_000, 65536))
        r = client.post("/v1/completions", content=chunks)  # no Content-Length: counted
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        assert client.post("/v1/completions", json=completion()).status_code == 200


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(live):
    limit = live.cluster.intake.max_prompt_chars
    calls = []
    encode = live.cluster.tokenizer.encode
    live.cluster.tokenizer.encode = lambda text: calls.append(len(text)) or encode(text)
    try:
        body = completion(prompt="7" * (limit + 1))
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=HANG_GUARD_S)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "7" * (limit + 1)}]}
        r_chat = httpx.post(f"{live.url}/v1/chat/completions", json=chat, timeout=HANG_GUARD_S)
    finally:
        live.cluster.tokenizer.encode = encode
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r_chat.status_code == 400 and r_chat.json()["error"]["param"] == "messages"
    assert calls == []


@pytest.mark.parametrize("long", [True, False])
def test_a_long_prompt_is_tokenized_off_the_event_loop(live, monkeypatch, long):
    """A prompt over `INLINE_PROMPT_CHARS` is tokenized in a thread of the pool, where it
    holds up no other request; a shorter one on the event loop, cheaper than the hop (unless
    a DWS encoder runs on it too: `Intake.is_cheap`)."""
    if long:  # (the question is the long prompt here: a real one would not fit the context)
        monkeypatch.setattr(intake, "INLINE_PROMPT_CHARS", len(QUESTIONS[0]) - 1)
    threads = {}
    encode = live.cluster.tokenizer.encode
    live.cluster.tokenizer.encode = lambda text: (
        threads.setdefault("encode", _me()) and encode(text)
    )
    health = live.cluster.health
    live.cluster.health = lambda: threads.setdefault("loop", _me()) and health()
    try:
        r = httpx.post(f"{live.url}/v1/completions", json=completion(), timeout=HANG_GUARD_S)
        assert r.status_code == 200
        assert httpx.get(f"{live.url}/health", timeout=HANG_GUARD_S).status_code == 200
    finally:
        live.cluster.tokenizer.encode, live.cluster.health = encode, health
    assert (threads["encode"] != threads["loop"]) is long


def _me() -> int:
    return threading.get_ident()


# -- bug 4: a lone surrogate got a plain-text 500 and closed the connection -------------------


@pytest.mark.parametrize(
    "body, param",
    [
        (completion(prompt="a\ud800b"), "prompt"),
        (completion(stop=["\ud800"]), "stop"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}, "content"),
        ({"model": MODEL, "messages": [{"role": "\ud800", "content": "hi"}]}, "role"),
    ],
)
def test_a_lone_surrogate_is_a_400_and_the_connection_serves_on(live, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    raw = json.dumps(body)  # (json spells the surrogate "\ud800")
    with httpx.Client(base_url=live.url, limits=httpx.Limits(max_connections=1)) as client:
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and param in r.json()["error"]["param"]
        assert client.post("/v1/completions", json=completion()).status_code == 200


# -- issue 20: 404 for an unknown model; the calibration in /v1/models ------------------------


def test_an_unknown_model_is_a_404_as_openai_answers(live):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi")
    assert err.value.body["code"] == "model_not_found"


def test_models_show_the_calibration(live):
    (card,) = httpx.get(f"{live.url}/v1/models", timeout=HANG_GUARD_S).json()["data"]
    assert card["id"] == MODEL and card["dilaserve"]["calibration"] == CALIBRATION


def test_a_port_in_use_stops_serve_before_anything_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        missing = ClusterConfig(worker=WorkerConfig(model="/nonexistent/model"))
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            serve(missing, port=port)


# -- bug 5 at the front: a request refused for capacity ----------------------------------


class _AdmittingCluster:
    """Just enough of a Cluster for the API: each request is refused at admission."""

    step_slowdown = 1.0

    def __init__(self):
        self.config = ClusterConfig()
        self.accepting, self.in_flight = True, 0
        stats = {"migrations": 0, "reconfigurations": 0, "failures": 0}
        self.controller = SimpleNamespace(stats=stats, stalls=SimpleNamespace(count=0))
        self.intake = AnyIntake()

    def submit(self, prompt, **kw):
        return refused_handle(Overloaded("over capacity"), **kw)

    @contextlib.contextmanager
    def entering(self, entry=None):
        yield self.submit

    def instances_by_tp(self):
        return {1: 1}

    def queue_length(self):
        return 0

    def health(self):
        return "ok"

    def is_full(self, priority, slo=None, max_tokens=None, entry=None):
        return False


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_refused_at_admission_is_a_429_with_retry_after(stream, caplog):
    app = create_app(_AdmittingCluster(), ServerSettings(MODEL), ServerMetrics(), manage=False)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json=completion(stream=stream))
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    gc.collect()  # an unread refusal is logged when its future is collected
    assert "never retrieved" not in caplog.text  # (a log line per refusal under overload)


# -- bug 6: shutdown closed the socket at once and left streams without an end ---------------


class DrainingLive(LiveServer):
    """`serve`'s DrainingServer in a thread; `terminate()` is what SIGTERM does."""

    def __init__(self, drain_timeout: float):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        settings = ServerSettings(MODEL, self.url, drain_timeout)
        app, self.cluster = build_app(config(tick=0.2), settings)
        uv = uvicorn.Config(app, port=self.port, log_level="warning", timeout_graceful_shutdown=5)
        self.server = DrainingServer(uv, self.cluster, settings)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started)

    def terminate(self):
        self.server.handle_exit(signal.SIGTERM, None)


LONG = {"prompt": QUESTIONS[1], "max_tokens": 448, "threshold": 1.0}  # runs for seconds


def test_shutdown_answers_503_while_draining_and_ends_what_is_left_in_openai_shape():
    server = DrainingLive(drain_timeout=1.0)
    lines, plain = [], {}

    def stream():
        body = completion(**LONG, stream=True)
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, timeout=HANG_GUARD_S
        ) as r:
            lines.extend(r.iter_lines())

    def wait_plain():
        plain["r"] = httpx.post(
            f"{server.url}/v1/completions", json=completion(**LONG), timeout=HANG_GUARD_S
        )

    readers = [threading.Thread(target=stream), threading.Thread(target=wait_plain)]
    for reader in readers:
        reader.start()
    wait_until(lambda: server.cluster.in_flight == 2)
    # connected before the signal: new connections are turned away for the drain's last call
    late = [httpx.Client(base_url=server.url, timeout=HANG_GUARD_S) for _ in range(2)]
    for client in late:
        assert client.get("/health").status_code == 200  # (the connection kept alive)
    server.terminate()
    refused = late[0].post("/v1/completions", json=completion())
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert late[1].get("/health").status_code == 503
    for reader in readers:
        reader.join(HANG_GUARD_S)
    server.thread.join(HANG_GUARD_S)
    assert not server.thread.is_alive()
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] is None  # an error event, OpenAI's shape
    assert plain["r"].status_code == 503 and "shut down" in plain["r"].json()["error"]["message"]


# -- security: the HTTP surface ---------------------------------------------------------------


def stub_client(**settings) -> TestClient:
    settings = ServerSettings(MODEL, **settings)
    return TestClient(create_app(_AdmittingCluster(), settings, ServerMetrics(), manage=False))


def test_docs_are_closed_unless_asked_and_then_need_the_key():
    with stub_client() as client:
        assert client.get("/docs").status_code == 404
        assert client.get("/openapi.json").status_code == 404
    with stub_client(docs=True, api_key="sekret") as client:
        assert client.get("/openapi.json").status_code == 401
        good = {"Authorization": "Bearer sekret"}
        assert client.get("/openapi.json", headers=good).status_code == 200
        assert client.get("/health").status_code == 200  # probes need no key


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused(key):
    with pytest.raises(ValueError, match="empty"):
        ServerSettings(MODEL, api_key=key)


def test_a_loopback_server_answers_only_loopback_host_names():
    with stub_client(allowed_hosts=allowed_hosts_for("127.0.0.1", None)) as client:
        r = client.get("/health", headers={"host": "evil.example:8000"})  # DNS rebinding
        assert r.status_code == 400 and "Host" in r.json()["error"]["message"]
        assert client.get("/health", headers={"host": "localhost:8000"}).status_code == 200
        assert client.get("/health", headers={"host": "[::1]:8000"}).status_code == 200
    assert allowed_hosts_for("0.0.0.0", None) == ("*",)
    assert allowed_hosts_for("127.0.0.1", ["api.example"]) == ("api.example",)
