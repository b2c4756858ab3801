"""The HTTP front on a busy, faulty network: request heads and read timeouts (`limits.py`),
refusals before the body is read, a chat's message cap, strict fields, and the drain's 503s
(`guards.py`, `main.py`), against a real cluster of the bundled model served by uvicorn."""

import asyncio
import json
import logging
import re
import signal
import socket
import threading
import time
from functools import partial
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from dilaserve.cluster.runtime import ClusterConfig
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.server.app import ServerSettings
from dilaserve.server.guards import RECEIVED, EarlyRefusals, Guards
from dilaserve.server.limits import STARTS_PER_TURN, HttpLimits, _Starts, limited_protocol
from dilaserve.server.main import DrainingServer, build_app, server_config
from dilaserve.tasks import arith

from conftest import HANG_GUARD_S, wait_until

MODEL = "tiny-llada"
QUESTIONS = [p.question for p in arith.generate(4, seed=7, split="test")]
LIMITS = HttpLimits(max_header_bytes=8192, max_headers=20, header_timeout=1.0, body_timeout=1.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """`build_app`'s app on a real cluster, run with `server_config` (the limits `serve`
    runs with) by `server_class` in a thread."""

    def __init__(self, server_class=uvicorn.Server, **settings):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = ClusterConfig(WorkerConfig(threads=1), instances=(1,), tick=0.2)
        settings = ServerSettings(MODEL, self.url, http=LIMITS, max_messages=8, **settings)
        app, self.cluster = build_app(config, settings, manage=server_class is uvicorn.Server)
        if server_class is not uvicorn.Server:
            self.cluster.start()
        uv = server_config(app, settings, port=self.port, log_level="info")
        args = () if server_class is uvicorn.Server else (self.cluster, settings)
        self.server = server_class(uv, *args)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(HANG_GUARD_S)
        self.cluster.close()


@pytest.fixture(scope="module")
def live():
    server = Live()
    yield server
    server.stop()


def raw_exchange(port: int, *parts: bytes) -> bytes:
    """What the server sends back on one connection given `parts`, until it closes it (a
    reset counts as closed)."""
    chunks = []
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S) as s:
        try:
            for part in parts:
                s.sendall(part)
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, BrokenPipeError):
            pass
    return b"".join(chunks)


def post(live, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(
        f"{live.url}{path}", json={"model": MODEL, **body}, timeout=HANG_GUARD_S, **kw
    )


# -- request heads ----------------------------------------------------------------------------


def test_a_head_over_the_limit_is_a_431_and_health_still_answers(live):
    head = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: "
    answer = raw_exchange(live.port, head, *[b"a" * 4096] * 16)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431")  # answered, or closed
    assert httpx.get(f"{live.url}/health", timeout=HANG_GUARD_S).status_code == 200


def test_too_many_header_fields_are_a_431(live):
    fields = b"".join(b"X-%d: 1\r\n" % i for i in range(LIMITS.max_headers + 1))
    answer = raw_exchange(live.port, b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + fields)
    assert answer.startswith(b"HTTP/1.1 431")


def test_a_head_within_the_limit_is_served(live):
    r = httpx.get(f"{live.url}/health", headers={"X-Pad": "a" * 4000}, timeout=HANG_GUARD_S)
    assert r.status_code == 200


def test_a_body_sent_with_its_head_counts_only_after_the_head(live):
    body = json.dumps({"model": MODEL, "prompt": "7" * 60_000}).encode()  # past the context
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
    head += b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    answer = raw_exchange(live.port, head + body)  # one write, many times the head limit
    assert answer.startswith(b"HTTP/1.1 400") and b'"param":"prompt"' in answer


def test_a_slow_head_is_answered_408_and_its_connection_closed(live):
    answer = raw_exchange(live.port, b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
    assert answer.startswith(b"HTTP/1.1 408")  # (raw_exchange returned: the server closed it)


def test_an_under_sent_body_is_answered_408_and_its_connection_closed(live):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n"
    answer = raw_exchange(live.port, head, b'{"model": ')
    assert answer.startswith(b"HTTP/1.1 408")
    assert httpx.get(f"{live.url}/health", timeout=HANG_GUARD_S).status_code == 200


def test_connections_over_the_limit_get_a_503_with_retry_after():
    port = free_port()
    config = server_config(_api, ServerSettings(MODEL, max_connections=2), port=port)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started)
    try:
        with (
            socket.create_connection(("127.0.0.1", port)),
            socket.create_connection(("127.0.0.1", port)),
        ):  # two idle connections: the limit
            answer = raw_exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer
        assert b"connection: close" in answer and b'"service_unavailable"' in answer
        answer = raw_exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 204")  # under the limit again
    finally:
        server.should_exit = True
        thread.join(HANG_GUARD_S)


# -- refusing before the body -----------------------------------------------------------------


def test_the_front_asks_the_room_with_the_priority_slo_and_length_the_body_names(live, monkeypatch):
    lengths = []

    def is_full(priority, slo=None, max_tokens=None, entry=None, probe=False):
        """Full for the server's SLO and a priority up to 0."""
        lengths.append(max_tokens)
        return priority <= 0 and slo is None

    monkeypatch.setattr(live.cluster, "is_full", is_full)
    body = {"prompt": QUESTIONS[0], "max_tokens": 64}
    before = rejected(live)
    refused = post(live, "/v1/completions", body)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
    assert rejected(live) == before + 1  # counted, as the API's refusals are
    assert post(live, "/v1/completions", {**body, "priority": 5}).status_code == 200
    assert post(live, "/v1/completions", {**body, "slo_ms": 60_000}).status_code == 200
    assert 64 in lengths  # the room prices the answer's length the body asks for


async def _api(scope, receive, send):
    """Stands for the API behind the guards (which would answer 401 to a wrong key): 204, after
    reading the body, and `/slow` a little later."""
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/slow":
        await asyncio.sleep(0.2)
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


class Front:
    """`app` behind `Guards` and the HTTP protocol with `EarlyRefusals`, over a stand-in
    cluster whose room refuses the default priority and SLO (a priority above 0 never): always,
    or, given `room`, once that many requests are `entering`; asked for a request let through
    already (its entry, in its turn to begin), as `room_at_begin` says (None: as before)."""

    def __init__(self, api_key=None, room: int | None = None, app=_api, room_at_begin=None):
        self.room, self.refused, self.entering = room, 0, 0
        self.room_at_begin = room_at_begin
        cluster = SimpleNamespace(accepting=True, is_full=self._is_full, enter=self._enter)
        refusals = EarlyRefusals(cluster, api_key=api_key, on_refusal=self._count)
        self.port = free_port()
        # (info: uvicorn sets its loggers' levels for the process; tests read the access log)
        protocol = limited_protocol(LIMITS, refusals)
        config = uvicorn.Config(Guards(app, 1 << 20), port=self.port, lifespan="off",
                                log_level="info", http=protocol)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started)

    def _is_full(self, priority, slo=None, max_tokens=None, entry=None, probe=False) -> bool:
        if entry is not None and self.room_at_begin is not None:
            return priority <= 0 and self.room_at_begin == "full"
        ahead = self.entering - (entry is not None and entry.counted)  # (not itself)
        return priority <= 0 and (self.room is None or ahead >= self.room)

    def _enter(self):
        self.entering += 1
        entry = SimpleNamespace(counted=True)

        def leave():
            self.entering -= entry.counted
            entry.counted = False

        entry.leave = leave
        return entry

    def _count(self) -> None:
        self.refused += 1

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(HANG_GUARD_S)


@pytest.fixture
def front():
    server = Front()
    yield server
    server.stop()


CLOSE = b"Connection: close\r\n"


def completion(body: bytes = b'{"prompt": "1+1"}', head: bytes = b"") -> bytes:
    """A completion request's bytes (`head`: more header lines)."""
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n" + head
        + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip


def one_answer(s: socket.socket) -> bytes:
    """One whole answer with a Content-Length, read from `s`."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += s.recv(65536)
    head, body = answer.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def statuses(answer: bytes) -> list[int]:
    """The status of each answer in `answer` (what came on one connection)."""
    return [int(status) for status in re.findall(rb"HTTP/1\.[01] (\d{3}) ", answer)]


def test_only_a_client_with_the_key_is_refused_before_the_api():
    server = Front(api_key="sekret")
    try:
        for key, status in (("sekret", 429), ("wrong", 204)):  # the wrong key: the API's 401
            auth = b"Authorization: Bearer %s\r\n" % key.encode() + CLOSE
            assert statuses(raw_exchange(server.port, completion(head=auth))) == [status]
    finally:
        server.stop()


def test_a_refusal_keeps_its_connection_for_the_next_request(front):
    body = json.dumps({"prompt": "1+1", "priority": 1}).encode()  # let through
    answer = raw_exchange(front.port, completion() + completion(body, CLOSE))  # pipelined
    assert statuses(answer) == [429, 204] and front.refused == 1
    refusal = answer.split(b"HTTP/1.1 204")[0]
    assert b"retry-after: 1\r\n" in refusal and b'"rate_limit_error"' in refusal
    assert b"retry-after-ms: " in refusal and b"connection: close" not in refusal


@pytest.mark.parametrize("head", [CLOSE, b""])
def test_a_refusal_closes_the_connection_its_client_asked_to_close(front, head):
    request = completion(head=head)
    if not head:  # HTTP/1.0 closes by default
        request = request.replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    answer = raw_exchange(front.port, request)  # (returns once the server closed it)
    assert statuses(answer) == [429] and b"connection: close" in answer


def test_a_body_in_parts_is_refused_once_whole(front):
    request = completion(head=CLOSE)
    with socket.create_connection(("127.0.0.1", front.port), timeout=HANG_GUARD_S) as s:
        for k in range(len(request) - 12, len(request) + 1, 4):  # the head, then 4 bytes a time
            s.sendall(request[max(k - 4, 0) if k > len(request) - 12 else 0 : k])
            time.sleep(0.02)  # (each part its own read)
        answer = s.recv(65536)
    assert statuses(answer) == [429] and front.refused == 1


@pytest.mark.parametrize(
    "request_bytes",
    [
        completion(b"not json", CLOSE),  # the API's 400
        completion(head=CLOSE + b"Expect: 100-continue\r\n"),  # waits for the app's 100
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        + CLOSE
        + b"\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (8192, b" " * 8192) for _ in range(9))
        + b"0\r\n\r\n",  # grows past what the front parses
    ],
    ids=["not-json", "expect", "large-chunked"],
)
def test_what_the_front_cannot_judge_goes_to_the_api(front, request_bytes):
    assert statuses(raw_exchange(front.port, request_bytes))[-1] == 204  # (after a 100)
    assert front.refused == 0


def test_a_request_behind_one_being_answered_is_answered_in_order(front):
    slow = b"GET /slow HTTP/1.1\r\nHost: localhost\r\n\r\n"
    answer = raw_exchange(front.port, slow + completion(head=CLOSE))
    assert statuses(answer) == [204, 204] and front.refused == 0  # (not held: the app's)


def test_a_burst_read_at_once_is_let_through_only_as_far_as_the_room_goes():
    released = threading.Event()

    async def held(scope, receive, send):  # the API, answering once `released`
        while not released.is_set():
            await asyncio.sleep(0.01)
        await _api(scope, receive, send)

    server = Front(room=3, app=held)
    sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(10)]
    try:
        for s in sockets:
            s.settimeout(HANG_GUARD_S)
            s.sendall(completion(head=CLOSE))
        wait_until(lambda: server.refused == 7)  # the 3 let through count until they end
        assert server.entering == 3
        released.set()
        answers = [statuses(b"".join(iter(partial(s.recv, 65536), b""))) for s in sockets]
        assert sorted(answers) == [[204]] * 3 + [[429]] * 7
        wait_until(lambda: server.entering == 0)  # (`Guards`: each left once it ended)
    finally:
        for s in sockets:
            s.close()
        server.stop()


def test_a_request_whose_room_closed_before_its_turn_is_refused_below_the_app():
    """Let through when read (the room had room), refused when its turn to begin came (the
    room is priced again as the controller admits those ahead): answered 429 as a held one,
    the app never called, its count in the room gone; its connection kept alive."""
    calls = []

    async def api(scope, receive, send):
        calls.append(scope["path"])
        await _api(scope, receive, send)

    server = Front(room=10, app=api, room_at_begin="full")
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD_S) as s:
            for head in (b"", CLOSE):  # (the second after the first's answer: not pipelined)
                s.sendall(completion(head=head))
                answer = one_answer(s)
                assert statuses(answer) == [429] and b"retry-after" in answer.lower()
        assert calls == [] and server.refused == 2 and server.entering == 0
        server.room_at_begin = "room"
        assert statuses(raw_exchange(server.port, completion(head=CLOSE))) == [204]
        assert calls == ["/v1/completions"]
    finally:
        server.stop()


def test_a_requests_latency_counts_from_its_head_not_from_when_its_app_cycle_began():
    """Its SLO and latency count from the moment the server read its head (`RECEIVED`): a
    request held until its body came, or let through to wait its turn (`_Starts`; at 400
    clients most of the refusals over 100 ms had waited there), has spent that time of it.
    (Judged by order, not by a sleep's length: the stamp comes before the body is sent.)"""
    seen = []

    async def api(scope, receive, send):
        seen.append((scope[RECEIVED][0], time.perf_counter()))
        await _api(scope, receive, send)

    server = Front(app=api)  # (held: the room refuses the default priority; 1 it takes)
    try:
        request = completion(body=b'{"prompt": "1+1", "priority": 1}', head=CLOSE)
        head, body = request.split(b"\r\n\r\n", 1)
        with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD_S) as s:
            s.sendall(head + b"\r\n\r\n")
            connections = server.server.server_state.connections
            wait_until(lambda: any(c._held is not None for c in tuple(connections)))  # (held)
            body_sent = time.perf_counter()
            s.sendall(body)
            assert statuses(b"".join(iter(partial(s.recv, 65536), b""))) == [204]
        ((received, began),) = seen
        assert received < body_sent < began  # (the server runs in this process: one clock)
    finally:
        server.stop()


def test_a_request_let_through_whose_body_is_not_whole_goes_to_the_app():
    server = Front(room=10, room_at_begin="full")
    try:
        request = completion(head=CLOSE)
        with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD_S) as s:
            s.sendall(request[:-3])  # (let through: its body is the app's to read)
            wait_until(lambda: server.entering == 1)
            s.sendall(request[-3:])
            answer = b"".join(iter(partial(s.recv, 65536), b""))
        assert statuses(answer) == [204] and server.refused == 0
    finally:
        server.stop()


class Waiting:
    """Stands for the protocol of a let-through request waiting in `_Starts`; the room takes
    the requests numbered below `room[0]`."""

    loop, room = None, [10]

    def __init__(self, k, begun, refused):
        self.k, self.begun, self.refused = k, begun, refused

    def answered_here(self, cycle) -> bool:
        if self.k < self.room[0]:
            return False
        self.refused.append(self.k)
        return True

    def start(self, cycle, app):
        self.begun.append(self.k)


def run_starts(count: int, room: int) -> tuple[list, list, list]:
    """`count` requests queued in `_Starts` at once, `room` of them taken: (begun, refused,
    how many had begun after each turn of the event loop)."""
    begun, refused, after_each_turn = [], [], []
    Waiting.room = [room]

    async def burst():
        Waiting.loop = asyncio.get_running_loop()
        starts = _Starts()
        for k in range(count):
            starts.add(Waiting(k, begun, refused), None, None)
        while len(begun) + len(refused) < count:
            await asyncio.sleep(0)  # (one turn of the loop)
            after_each_turn.append(len(begun))

    asyncio.run(burst())
    return begun, refused, after_each_turn


def test_requests_let_through_begin_in_order_a_few_per_event_loop_turn():
    """Between turns the event loop reads its sockets: a burst's requests that the room
    refuses are answered as they are read, not after the app's work for those let through."""
    begun, refused, after_each_turn = run_starts(10, room=10)
    assert begun == list(range(10)) and refused == []
    counts = [b - a for a, b in zip([0, *after_each_turn], after_each_turn)]
    assert max(counts) == STARTS_PER_TURN and len(after_each_turn) >= 10 / STARTS_PER_TURN


def test_those_waiting_that_the_room_no_longer_takes_are_refused_from_the_back_at_once():
    begun, refused, after_each_turn = run_starts(10, room=6)
    assert refused == [9, 8, 7, 6] and begun == list(range(6))
    assert after_each_turn[0] == STARTS_PER_TURN  # (refused in the first turn, not theirs)


def test_a_held_body_that_stops_coming_is_a_408(front):
    request = completion()
    assert statuses(raw_exchange(front.port, request[:-3])) == [408]
    assert front.refused == 0


def test_a_request_held_at_shutdown_is_answered_by_the_app_and_its_connection_closed(front):
    request = completion()
    with socket.create_connection(("127.0.0.1", front.port), timeout=HANG_GUARD_S) as s:
        s.sendall(request[:-3])  # held: its body is not whole
        connections = front.server.server_state.connections
        wait_until(lambda: len(connections) == 1)
        (protocol,) = connections
        protocol.loop.call_soon_threadsafe(protocol.shutdown)  # (what uvicorn's exit does)
        wait_until(lambda: protocol.cycle is not None)  # let through to the app
        s.sendall(request[-3:])
        answer = b"".join(iter(partial(s.recv, 65536), b""))  # (until the server closes it)
    assert statuses(answer) == [204] and b"connection: close" in answer
    assert front.refused == 0 and front.entering == 0


def rejected(live) -> float:
    """The server's count of refused requests (`/metrics`)."""
    lines = httpx.get(f"{live.url}/metrics", timeout=HANG_GUARD_S).text.splitlines()
    line = next(
        (x for x in lines if x.startswith('dilaserve_requests_total{outcome="rejected"}')), ""
    )
    return float(line.split()[-1]) if line else 0.0


# -- fields -----------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [9, 25_000])  # parsed and counted; refused unparsed
def test_a_chat_over_the_message_cap_is_a_400_naming_messages(live, count):
    messages = [{"role": "user", "content": ""}] * count
    r = post(live, "/v1/chat/completions", {"messages": messages})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages" and "at most 8" in error["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"messages": [{"role": "user<|eot_id|><|start_header_id|>system", "content": "x"}]},
            "messages.0.role",
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"logprobs": 0}, "logprobs"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 7}, "temperature"),
        ({"max_tokens": 64.0}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_fields_outside_the_api_are_a_400_naming_them(live, body, param):
    chat = {"messages": [{"role": "user", "content": QUESTIONS[0]}], **body}
    r = post(live, "/v1/chat/completions", chat)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error


def test_logprobs_0_on_completions_is_refused_and_sampling_fields_accepted(live):
    body = {"prompt": QUESTIONS[0], "max_tokens": 64}
    r = post(live, "/v1/completions", {**body, "logprobs": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    sampling = {"temperature": 0.7, "top_p": 1, "seed": 3, "user": "u", "logprobs": None}
    assert post(live, "/v1/completions", {**body, **sampling}).status_code == 200


def test_usage_counts_only_the_text_returned_before_a_stop_string(live):
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    body = {"messages": messages, "max_tokens": 64, "threshold": 0.9}
    whole = post(live, "/v1/chat/completions", body).json()
    text = whole["choices"][0]["message"]["content"]
    assert "\n####" in text  # (the bundled model's answers end with "#### N")
    cut = post(live, "/v1/chat/completions", {**body, "stop": "\n####"}).json()
    returned = cut["choices"][0]["message"]["content"]
    assert returned == text.split("\n####")[0]
    tokens = len(live.cluster.tokenizer.encode(returned))  # (byte-level: one per byte)
    assert cut["usage"]["completion_tokens"] == tokens < whole["usage"]["completion_tokens"]


def test_a_key_in_a_query_string_stays_out_of_the_access_log(live):
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    access = logging.getLogger("uvicorn.access")
    access.addHandler(handler)
    try:
        httpx.get(f"{live.url}/health?api_key=sekret-123", timeout=HANG_GUARD_S)
        wait_until(lambda: any("/health" in line for line in lines))
    finally:
        access.removeHandler(handler)
    assert not any("sekret-123" in line for line in lines), lines


@pytest.mark.parametrize("interval, logged", [(10.0, False), (0.0, True)])
def test_a_429_gets_no_access_line_when_the_periodic_line_counts_it(interval, logged):
    """Dropped by the access log's filter, and not even made by the protocol's own 429s."""
    uv = server_config(_api, ServerSettings(MODEL, log_interval=interval), port=free_port())
    assert uv.http.log_refusals == logged
    access = logging.getLogger("uvicorn.access")

    def line(status: int) -> logging.LogRecord:
        args = ("127.0.0.1:5000", "POST", "/v1/completions", "1.1", status)
        return access.makeRecord(access.name, logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 args, None)  # fmt: skip

    assert access.filter(line(200)) and access.filter(line(503))
    assert bool(access.filter(line(429))) == logged


# -- the drain --------------------------------------------------------------------------------


LONG = {"prompt": "0 0 0", "max_tokens": 448, "threshold": 1.0}  # runs for seconds


def test_a_draining_server_answers_503_with_connection_close_even_when_full():
    server = Live(DrainingServer, drain_timeout=1.0)
    in_flight = threading.Thread(target=post, args=(server, "/v1/completions", LONG))
    in_flight.start()
    wait_until(lambda: server.cluster.in_flight == 1)
    server.cluster.is_full = lambda *asks: True  # over capacity too: the drain's 503 wins
    with httpx.Client(base_url=server.url, timeout=HANG_GUARD_S) as client:
        assert client.get("/health").status_code == 200  # (a connection opened before)
        server.server.handle_exit(signal.SIGTERM, None)  # what SIGTERM does
        for _ in range(2):  # the second on a new connection: the first was closed
            r = client.post("/v1/completions", json={"model": MODEL, **LONG})
            assert r.status_code == 503 and r.headers["connection"] == "close"
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "service_unavailable"
        health = client.get("/health")
        assert health.status_code == 503 and health.headers["connection"] == "close"
    in_flight.join(HANG_GUARD_S)
    server.thread.join(HANG_GUARD_S)
    assert not server.thread.is_alive()  # it exited
    server.cluster.close()


def test_limits_are_checked_when_set():
    with pytest.raises(ValueError, match="header_timeout"):
        HttpLimits(header_timeout=0)
    with pytest.raises(ValueError, match="max_messages"):
        ServerSettings(MODEL, max_messages=0)
