"""The OpenAI-compatible server, driven by the official `openai` client against a real cluster
of the bundled model: completions and chat, plain and streaming, errors, metrics, shutdown."""

import contextlib
import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from dilaserve.cluster.requests import RequestResult
from dilaserve.cluster.runtime import Closed, ClusterConfig, Overloaded
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.config import SamplingParams
from dilaserve.engine.llm import LLM
from dilaserve.server.app import ServerSettings, create_app
from dilaserve.server.main import build_app
from dilaserve.server.metrics import ServerMetrics
from dilaserve.tasks import arith

from conftest import AnyIntake

QUESTIONS = [p.question for p in arith.generate(6, seed=7, split="test")]
MODEL = "tiny-llada"
PINNED = {"threshold": 0.9}  # pinned, so that answers are comparable with the offline engine


class LiveServer:
    def __init__(self, drain_timeout=30.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = ClusterConfig(WorkerConfig(threads=1), instances=(1,), tick=0.2)
        settings = ServerSettings(MODEL, f"http://127.0.0.1:{self.port}", drain_timeout)
        app, self.cluster = build_app(config, settings)
        self.server = uvicorn.Server(
            uvicorn.Config(app, port=self.port, log_level="warning", timeout_graceful_shutdown=10)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def live():
    server = LiveServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline():
    return {c.prompt: c.text for c in LLM().generate(QUESTIONS, SamplingParams(0.9, 64))}


def test_models_and_health(live):
    assert [m.id for m in live.client.models.list().data] == [MODEL]
    health = httpx.get(f"{live.url}/health").json()
    assert health["status"] == "ok" and health["instances"] == {"1": 1}


def test_chat_plain_and_streaming_answer_as_the_offline_engine(live, offline):
    for question in QUESTIONS[:3]:
        messages = [{"role": "user", "content": question}]
        reply = live.client.chat.completions.create(
            model=MODEL, messages=messages, extra_body=PINNED
        )
        assert reply.choices[0].message.content == offline[question]
        assert reply.choices[0].finish_reason == "stop"
        assert 0 < reply.usage.completion_tokens < 64 and reply.usage.prompt_tokens > 10
        chunks = list(
            live.client.chat.completions.create(
                model=MODEL,
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=PINNED,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == offline[question]
        assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_completions_plain_and_streaming_agree(live):
    prompt = QUESTIONS[3]
    plain = live.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=32, extra_body=PINNED
    )
    streamed = "".join(
        c.choices[0].text
        for c in live.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=32, stream=True, extra_body=PINNED
        )
    )
    assert streamed == plain.choices[0].text
    assert plain.usage.completion_tokens <= 32  # the window: one 32-token block


def test_only_a_streamed_request_streams_its_text(live, monkeypatch):
    handles, submit = [], live.cluster.submit

    def recording(*args, **kwargs):
        handles.append(submit(*args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(live.cluster, "submit", recording)
    args = dict(model=MODEL, prompt=QUESTIONS[0], max_tokens=32, extra_body=PINNED)
    plain = live.client.completions.create(**args).choices[0].text
    chunks = list(live.client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain
    assert "".join(handles[1]) == plain  # the streamed request's deltas, as sent
    with pytest.raises(RuntimeError, match="stream=True"):  # the plain one kept none
        list(handles[0])


def test_extension_fields_reach_the_scheduler(live):
    reply = live.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTIONS[4]}],
        extra_body={"slo_ms": 5000, "priority": 2, "min_threshold": 0.6, "max_threshold": 0.7},
    )
    assert 0.6 <= reply.model_extra["dilaserve"]["mean_threshold"] <= 0.7


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"threshold": 1.5}, "threshold"),
        ({"max_tokens": 600}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "seven " * 500}]}, "messages"),
        ({"messages": []}, "messages"),
        ({"deadline": 1.0}, "deadline"),
        ({"steps": 4}, "steps"),  # LLaDA's decoding rule has no step schedule
        ({"steps": 0}, "steps"),
    ],
)
def test_bad_requests_get_400_naming_the_field(live, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    extra = {k: v for k, v in fields.items() if k in ("threshold", "deadline", "steps")}
    body.update({k: v for k, v in fields.items() if k not in extra})
    with pytest.raises(openai.BadRequestError) as err:
        live.client.chat.completions.create(**body, extra_body=extra)
    assert err.value.body["param"] == param
    assert param in err.value.body["message"] or param == "messages"


def test_stop_strings_end_the_answer_plain_and_streamed(live, offline):
    question = next(q for q in QUESTIONS if "\n####" in offline[q])
    before = offline[question].split("\n####")[0]
    messages = [{"role": "user", "content": question}]
    args = dict(model=MODEL, messages=messages, stop=["\n####"], extra_body=PINNED)
    reply = live.client.chat.completions.create(**args)
    assert reply.choices[0].message.content == before
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(live.client.chat.completions.create(**args, stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(deltas) == before and not any("#" in d for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": [7, 999_999]}, "prompt"),  # outside the vocabulary
        ({"prompt": [True]}, "prompt"),
        ({"prompt": "1 + <|mdm_mask|>"}, "prompt"),  # the mask token, spelled
        ({"priority": 10**400}, "priority"),  # once stopped the controller
        ({"slo_ms": float("nan")}, "slo_ms"),
        ({"deadline": float("inf")}, "deadline"),
    ],
)
def test_completion_fields_this_server_cannot_honour_get_400(live, body, param):
    body = json.dumps({"model": MODEL, "prompt": "1 + 1", **body})  # NaN, Infinity allowed
    r = httpx.post(
        f"{live.url}/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and param in error["message"]


def test_chat_content_parts_are_text_only(live):
    question = {"role": "user", "content": [{"type": "text", "text": QUESTIONS[0]}]}
    reply = live.client.chat.completions.create(model=MODEL, messages=[question])
    assert "####" in reply.choices[0].message.content
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    question["content"].append(image)
    with pytest.raises(openai.BadRequestError) as err:
        live.client.chat.completions.create(model=MODEL, messages=[question])
    assert err.value.body["param"] == "messages.0.content" and "image_url" in str(err.value)


def test_a_body_that_is_not_an_object_is_a_400_saying_so(live):
    r = httpx.post(f"{live.url}/v1/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_malformed_json_is_a_400_in_openai_shape(live):
    r = httpx.post(
        f"{live.url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_bad_request_among_good_ones_affects_none(live, offline):
    results, bad = {}, []

    def good(question):
        reply = live.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], extra_body=PINNED
        )
        results[question] = reply.choices[0].message.content

    def broken():
        try:
            live.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10_000
            )
        except openai.BadRequestError as e:
            bad.append(e.status_code)

    threads = [threading.Thread(target=good, args=(q,)) for q in QUESTIONS]
    threads += [threading.Thread(target=broken) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == offline and bad == [400, 400, 400]


def test_a_client_that_gives_up_on_a_plain_request_frees_the_cluster(live):
    # not an arithmetic question, so no early answer: 448 steps of one token at threshold 1.0
    body = {"model": MODEL, "prompt": "0 0 0", "max_tokens": 448, "threshold": 1.0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 10
    while live.cluster.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.cluster.in_flight == 0
    metrics = httpx.get(f"{live.url}/metrics").text
    assert 'dilaserve_requests_total{outcome="cancelled"} 1.0' in metrics


def test_metrics_expose_outcomes_thresholds_instances_and_steps(live):
    live.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}]
    )
    before = live.cluster.step_slowdown
    text = httpx.get(f"{live.url}/metrics").text
    after = live.cluster.step_slowdown  # (it decays toward 1 while no step reports)
    assert 'dilaserve_requests_total{outcome="met_slo"}' in text
    assert 'dilaserve_instances{tp="1"} 1.0' in text
    [slowdown] = [line for line in text.splitlines() if line.startswith("dilaserve_step_slowdown ")]
    exported = float(slowdown.split()[1])
    assert min(before, after) <= exported <= max(before, after) and before != 1.0  # measured
    for name in (
        "dilaserve_step_seconds_bucket",
        "dilaserve_step_threshold_bucket",
        "dilaserve_queue_length",
        "dilaserve_slo_attainment",
        "dilaserve_admission_on_time_factor",
        "dilaserve_admission_on_time_measured_total",
        "dilaserve_admission_capacity",
        "dilaserve_admission_modelled_capacity",
        "dilaserve_admission_predicted_seconds",
        "dilaserve_admission_pace_seconds",
        "dilaserve_deadline_factor",
        "dilaserve_deadline_measured_total",
        "dilaserve_migrations_total",
        "dilaserve_reconfigurations_total",
        "dilaserve_generated_tokens_total",
    ):
        assert name in text, name


class _RefusingCluster:
    """Just enough of a Cluster to see how the API reports admission refusals."""

    step_slowdown = 1.0
    step_slowdown_stale_seconds = 0.0
    instances_stalled = 0
    on_time_factor = 1.0
    admission_predicted = admission_pace = 0.0
    on_time = SimpleNamespace(finished=0, late=0)
    deadline = deadline_factor = admission_capacity = quality_budget = planner = None

    def __init__(self, error):
        self.error = error
        self.config = SimpleNamespace(
            control=SimpleNamespace(policy="fcfs"),
            instances=(1,),
            worker=SimpleNamespace(engine=SimpleNamespace(device="cpu")),
        )
        self.accepting, self.in_flight = not isinstance(error, Closed), 0
        stats = {"migrations": 0, "reconfigurations": 0, "failures": 0}
        self.controller = SimpleNamespace(
            stats=stats, stalls=SimpleNamespace(count=0), restored_after=None
        )
        self.intake = AnyIntake()
        self.scheduler = SimpleNamespace(instances={})

    def submit(self, *args, **kwargs):
        raise self.error

    @contextlib.contextmanager
    def entering(self, entry=None):
        yield self.submit

    def instances_by_tp(self):
        return {}

    def health(self):
        return "unavailable"

    def health_reason(self):
        return "not accepting requests"

    def is_full(self, priority, slo=None, max_tokens=None, entry=None):
        return False

    def queue_length(self):
        return 0


@pytest.mark.parametrize("error, status", [(Overloaded("full"), 429), (Closed("bye"), 503)])
def test_refused_work_gets_retry_after(error, status):
    app = create_app(_RefusingCluster(error), ServerSettings(MODEL), ServerMetrics(), manage=False)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == status and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["message"] == str(error) or status == 503  # (draining's own)
        assert client.get("/health").status_code == 503


def test_the_log_line_sums_up_what_finished_since_the_last():
    metrics = ServerMetrics()
    assert metrics.interval_line(10, in_flight=0, waiting=0) is None  # nothing happened
    for met, tokens in ((True, 30), (False, 10)):
        result = RequestResult("r", "", tuple(range(tokens)), 4, 0.2, 0.1, 0.8, met, "stop")
        metrics.request_done(result, [0.9, 0.9, 0.7, 0.7])
    line = metrics.interval_line(10, in_flight=3, waiting=1)
    assert line == (
        "last 10 s: 2 requests done (50.0% within their SLO), 4.0 generated tokens/s, "
        "mean step threshold 0.800; 3 in flight, 1 waiting"
    )
    assert metrics.interval_line(10, in_flight=3, waiting=1) is None  # a new window
    metrics.rejected()
    metrics.rejected()
    line = metrics.interval_line(10, in_flight=0, waiting=0)
    assert line == "last 10 s: 0 requests done, 2 refused (429/503); 0 in flight, 0 waiting"


def test_an_api_key_guards_the_v1_endpoints_only():
    cluster = _RefusingCluster(Overloaded("full"))
    settings = ServerSettings(MODEL, api_key="sekret")
    app = create_app(cluster, settings, ServerMetrics(), manage=False)
    body = {"model": MODEL, "prompt": "hi"}
    with TestClient(app) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models").status_code == 401
        good = {"Authorization": "Bearer sekret"}
        assert client.post("/v1/completions", json=body, headers=good).status_code == 429
        assert client.get("/v1/models", headers=good).status_code == 200
        assert client.get("/metrics").status_code == 200  # probes and scrapers need no key
        assert client.get("/health").status_code == 503  # (this cluster is not accepting)


def test_shutdown_finishes_a_stream_in_flight(offline):
    server = LiveServer()
    chunks = []

    def stream():
        with httpx.stream(
            "POST",
            f"{server.url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": QUESTIONS[5]}],
                "stream": True,
                "max_tokens": 448,
                "threshold": 0.99,
            },
            timeout=60,
        ) as r:
            for line in r.iter_lines():
                chunks.append(line)

    reader = threading.Thread(target=stream)
    reader.start()
    while not any("content" in c for c in chunks):
        time.sleep(0.01)
    server.stop()  # graceful: the open stream runs to its end first
    reader.join(60)
    assert chunks[-2:] == ["data: [DONE]", ""] or chunks[-1] == "data: [DONE]"
    payloads = [json.loads(c[6:]) for c in chunks if c.startswith("data: {")]
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert not server.thread.is_alive()


@pytest.mark.parametrize(
    "kinds, label",
    [
        (("cache", "recompute"), "recompute"),
        (("block", "commit"), "commit"),
        (("block", "prefill", "commit"), "prefill"),
        (("block",), "block"),
    ],
)
def test_a_step_batch_is_counted_under_its_costliest_kind(kinds, label):
    from types import SimpleNamespace

    from dilaserve.protocol import StepKind
    from dilaserve.server.metrics import step_label

    output = SimpleNamespace(results=[SimpleNamespace(kind=StepKind(k)) for k in kinds])
    assert step_label(output).value == label
