"""What the server checks of every HTTP request before any handler runs (a pure ASGI middleware,
so that nothing of a refused request is read or parsed):

- the time it reached the server (`received(request)`): latency and SLOs count from there, not
  from when the cluster got it;
- the Host header, against the names the server answers to (DNS rebinding);
- the API key, when the server has one (`require_api_key`, FastAPI middleware): 401 for a
  request without it, but the probes' and the dashboard's browser;
- draining: while the server shuts down, every new request but the probes' (`/health`,
  `/metrics`) is answered 503 with Retry-After at once, whatever the load, and every answer
  carries `Connection: close`, so that no client reuses a connection the server is closing;
- capacity: a generation request the controller's `Room` refuses is answered 429 below the
  app, by `EarlyRefusals` through the HTTP protocol (`limits.py`), before any ASGI cycle,
  routing or validation: while the room refuses a request of the default priority and SLO,
  the protocol holds a small body and its priority and SLO (`slo_ms`, `deadline`) are taken
  from it with json's parser alone, and the room asked for those; a body that is not a JSON
  object with such fields, or a large one, is left to the API (its 400s name the field).
  Refusing so costs the front two thirds of what a refusal through the app did, and far
  less than the workers' share (docs/serving/reliability.md, "Refusals below the app"); and
  a burst's refusals are answered as their bytes are read, before the work of any request
  let through, which counts in the room from the moment it is let through. The
  room prices a request by its `max_tokens` too (`admission.Room`). A 429 carries
  Retry-After and `retry-after-ms` (`retry_headers`), which OpenAI's clients read first:
  Retry-After jittered to 0.5-1.5 times its value, so that clients refused together do not
  come back together (the front answers each wave of their retries at once);
- the body size: a declared Content-Length over the limit, or a body that grows past it, is
  refused with 413 in OpenAI's shape before it is parsed.

`error_body` is OpenAI's error shape, shared with the API's handlers; `http_answer` frames one
as a whole HTTP answer, for what is answered below the app.
"""

from __future__ import annotations

import enum
import json
import random
import secrets
import time
from collections.abc import Sequence
from http import HTTPStatus

from fastapi.responses import JSONResponse

from dilaserve.cluster.requests import FULL
from dilaserve.server.dashboard import challenge, is_authorised

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers: no key, and answered while draining
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
EARLY_PARSE_BYTES = 64 * 1024  # larger bodies are parsed by the API, off the event loop
CLOSED_RETRY_AFTER = 5  # seconds a client refused by a server shutting down should wait
SHUTTING_DOWN = "the server is shutting down; retry on another replica or later"
RETRY_JITTER = (0.5, 1.5)  # a 429's retry-after-ms, as multiples of its Retry-After
ENTRY = "dilaserve_entry"  # a request's count in the room while on its way (`EarlyRefusals`)
# (perf_counter, Unix time) a request's head was read (`limits.py`; else when `Guards` began
# it): its latency and SLO count from there, a wait for its turn in the front included
RECEIVED = "dilaserve_received"


def has_key(authorization: bytes, key: str | None) -> bool:
    """Does an `Authorization` header carry `Bearer KEY` (any, when the server has no key)?"""
    return key is None or secrets.compare_digest(authorization, f"Bearer {key}".encode())


def require_api_key(app, key: str) -> None:
    """Answer 401 to a request without the key, but the probes' (`OPEN_PATHS`) and a browser
    the dashboard let in (`dashboard.is_authorised`, which also takes a Basic password)."""

    @app.middleware("http")
    async def authorise(request, call_next):
        sent = request.headers.get("authorization", "").encode()
        path = request.url.path
        if path not in OPEN_PATHS and not has_key(sent, key):
            if not is_authorised(path, sent, key):
                headers = challenge(path)
                return error(401, "a valid API key is required", None, headers, "invalid_api_key")
        return await call_next(request)


def error(
    status: int, message: str, param: str | None = None, headers=None, code: str | None = None
) -> JSONResponse:
    """An error in OpenAI's shape, as a response of the API's."""
    return JSONResponse(
        error_body(status, message, param, code), status_code=status, headers=headers
    )


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = {429: "rate_limit_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def http_answer(status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
    """A whole HTTP/1.1 answer: the status line, `headers` and Content-Length, and `body`."""
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())]
    lines += [name + b": " + value + b"\r\n" for name, value in headers]
    lines.append(b"content-length: %d\r\n\r\n" % len(body))
    return b"".join(lines) + body


def draining_answer() -> bytes:
    """The whole HTTP answer of a server shutting down (what `Guards` answers while draining),
    for the requests `listener.py` answers below the app."""
    body = json.dumps(error_body(503, SHUTTING_DOWN)).encode()
    retry = str(CLOSED_RETRY_AFTER).encode()
    headers = [(b"content-type", b"application/json"), (b"retry-after", retry)]
    return http_answer(503, body, [*headers, (b"connection", b"close")])


def retry_headers(seconds: int) -> dict[str, str]:
    """A 429's headers: Retry-After in whole seconds, and `retry-after-ms` (what OpenAI's
    clients read first), jittered by `RETRY_JITTER`."""
    millis = seconds * 1000 * random.uniform(*RETRY_JITTER)
    return {"retry-after": str(seconds), "retry-after-ms": str(round(millis))}


def received(request) -> tuple[float, float]:
    """(perf_counter, Unix time) when the request reached the server (now, if not recorded)."""
    return request.scope.get(RECEIVED) or (time.perf_counter(), time.time())


class Guards:
    """ASGI middleware: stamps the arrival time (unless the HTTP protocol did when it read the
    head: `RECEIVED`), checks the Host header, refuses while draining, and checks the body
    size; a request `EarlyRefusals` counted leaves the count when it ends, at the latest.
    `cluster` (`accepting`): None refuses nothing for draining; `on_refusal()`: counts those
    refusals (the server's metrics, as the API's own)."""

    def __init__(
        self,
        app,
        max_body_bytes: int,
        allowed_hosts: Sequence[str] = ("*",),
        cluster=None,
        on_refusal=lambda: None,
    ):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = tuple(h.lower() for h in allowed_hosts)
        self.cluster = cluster
        self.on_refusal = on_refusal  # told of each request refused for draining

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        entry = scope.get(ENTRY)
        try:
            await self._guarded(scope, receive, send)
        finally:
            if entry is not None:  # (the request ended before the controller had it)
                entry.leave()

    async def _guarded(self, scope, receive, send):
        scope.setdefault(RECEIVED, (time.perf_counter(), time.time()))  # (or when read)
        headers = dict(scope.get("headers") or ())
        send = self._closing_while_draining(send)
        if not host_allowed(self.allowed_hosts, headers.get(b"host", b"")):
            return await respond(send, 400, "the Host header names no host this server serves")
        if self._draining() and scope["path"] not in OPEN_PATHS:
            self.on_refusal()
            return await respond(send, 503, SHUTTING_DOWN, CLOSED_RETRY_AFTER)
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            return await respond(send, 413, self._too_large())
        limited = _LimitedBody(receive, send, self)
        await self.app(scope, limited.receive, limited.send)

    def _draining(self) -> bool:
        return self.cluster is not None and not self.cluster.accepting

    def _closing_while_draining(self, send):
        """`send`, adding `Connection: close` to an answer begun while the server drains."""

        async def closing_send(message):
            if message["type"] == "http.response.start" and self._draining():
                close = [(b"connection", b"close")]
                message = {**message, "headers": [*message.get("headers", ()), *close]}
            await send(message)

        return closing_send

    def _too_large(self) -> str:
        return f"the request body exceeds the server's limit of {self.max_body_bytes} bytes"


class Verdict(enum.Enum):
    """What the HTTP protocol does with a request's head (`EarlyRefusals.judge`)."""

    OTHER = "not a request the room prices: the app's alone"
    HOLD = "hold its body: the room may refuse it (`EarlyRefusals.answer`)"
    ENTER = "let it through, counted ahead of later requests (`EarlyRefusals.enter`)"


class EarlyRefusals:
    """The front's capacity refusals, below the app. `limits.py`'s protocol asks `judge` of
    each request's head. A generation request (POST) by an authorised client, to a Host the
    server answers, while the cluster accepts requests, is the room's: held (`HOLD`) when the
    room refuses one of the default priority, SLO and length (`cluster.is_full(0, probe=True)`:
    a question, not a refusal) and its body is at most `EARLY_PARSE_BYTES` with no `Expect`;
    else let through (`ENTER`). Of a held one the protocol collects the body and asks
    `answer`: the whole 429 when the room refuses what the body asks for, counted by
    `on_refusal()`; else None, and it is let through. A request let through is counted by the
    room (`enter`: the entry goes in its scope under `ENTRY`) from that moment until the
    controller has it or it ends, so that the requests of a burst read in one go see those let
    through before them."""

    def __init__(
        self,
        cluster,
        retry_after: int = 1,
        api_key: str | None = None,
        allowed_hosts: Sequence[str] = ("*",),
        on_refusal=lambda: None,
    ):
        self.cluster, self.retry_after, self.on_refusal = cluster, retry_after, on_refusal
        self.api_key = api_key
        self.allowed_hosts = tuple(h.lower() for h in allowed_hosts)
        self.body = json.dumps(error_body(429, FULL)).encode()

    def judge(self, method: bytes, path: str, headers: Sequence[tuple[bytes, bytes]]) -> Verdict:
        """What to do with this request's head (header names in lower case)."""
        if method != b"POST" or path not in GENERATION_PATHS or not self.cluster.accepting:
            return Verdict.OTHER
        fields = dict(headers)
        if not host_allowed(self.allowed_hosts, fields.get(b"host", b"")):
            return Verdict.OTHER
        if not has_key(fields.get(b"authorization", b""), self.api_key):
            return Verdict.OTHER  # the API's to answer (401)
        if b"expect" in fields or not self._small(fields.get(b"content-length")):
            return Verdict.ENTER
        return Verdict.HOLD if self.cluster.is_full(0, probe=True) else Verdict.ENTER

    def enter(self):
        """Count a request let through (`Cluster.enter`); it leaves when `Guards` is done."""
        return self.cluster.enter()

    def answer(
        self, body: bytes, headers: Sequence[tuple[bytes, bytes]] = (), entry=None
    ) -> bytes | None:
        """The whole 429, with `headers` (the connection's own) first, for a request whose
        whole body is `body`, held or let through already (its `entry`, not ahead of itself);
        or None to let it through."""
        asks = _priority_and_slo(body)
        if asks is None or not self.cluster.accepting:
            return None
        if not self.cluster.is_full(*asks, entry):
            return None
        self.on_refusal()
        retry = _encoded(retry_headers(self.retry_after))
        ours = [(b"content-type", b"application/json"), *retry]
        return http_answer(429, self.body, [*headers, *ours])

    @staticmethod
    def _small(declared: bytes | None) -> bool:
        """A Content-Length of at most `EARLY_PARSE_BYTES` (none: chunked, counted as read)."""
        return declared is None or (declared.isdigit() and int(declared) <= EARLY_PARSE_BYTES)


class _LimitedBody:
    """A request's body as the app receives it: refused with 413 once it grows past the limit
    (the app then hears the client left, and its answer is dropped)."""

    def __init__(self, receive, send, guards: Guards):
        self._receive, self._send, self.guards = receive, send, guards
        self.size, self.refused = 0, False

    async def receive(self):
        if self.refused:
            return {"type": "http.disconnect"}
        message = await self._receive()
        self.size += len(message.get("body", b""))
        if self.size > self.guards.max_body_bytes:
            self.refused = True
            await respond(self._send, 413, self.guards._too_large())
            return {"type": "http.disconnect"}  # the app stops reading
        return message

    async def send(self, message):
        if not self.refused:
            await self._send(message)


async def respond(
    send, status: int, message: str, retry_after: int | None = None, headers=()
) -> None:
    """An error in OpenAI's shape, from ASGI (`headers`: more headers)."""
    body = json.dumps(error_body(status, message)).encode()
    length = (b"content-length", str(len(body)).encode())
    headers = [(b"content-type", b"application/json"), length, *headers]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _encoded(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in headers.items()]


def host_allowed(allowed_hosts: Sequence[str], host: bytes) -> bool:
    """Is `host` (a Host header) one of `allowed_hosts` (lower case; "*": any)?"""
    if "*" in allowed_hosts:
        return True
    host = host.decode("latin-1").lower()
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return name in allowed_hosts


def allowed_hosts_for(host: str, given: Sequence[str] | None) -> tuple[str, ...]:
    """The Host names to accept: those `given`; else, for a server bound to loopback, only the
    loopback names (a web page elsewhere cannot reach it by DNS rebinding); else any."""
    if given:
        return tuple(given)
    return LOCAL_HOSTS if host in LOCAL_HOSTS else ("*",)


def _priority_and_slo(body: bytes) -> tuple[int, float | None, int | None] | None:
    """(priority, SLO seconds or None: the server's, max_tokens or None) a small JSON body
    asks for; None when it is large or not a well-formed request (the API reads and judges
    it)."""
    if len(body) > EARLY_PARSE_BYTES:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    priority, slo_ms, deadline = (data.get(k) for k in ("priority", "slo_ms", "deadline"))
    priority = 0 if priority is None else priority
    if not _is_number(priority) or isinstance(priority, float):
        return None
    max_tokens = data.get("max_completion_tokens") or data.get("max_tokens")
    if max_tokens is not None and not (_is_number(max_tokens) and isinstance(max_tokens, int)):
        return None
    if deadline is not None:
        slo = deadline - time.time() if _is_number(deadline) else None
    elif slo_ms is not None:
        slo = slo_ms / 1000 if _is_number(slo_ms) else None
    else:
        return priority, None, max_tokens
    if slo is None or not slo > 0:
        return None  # (the API's 400)
    return priority, slo, max_tokens


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
