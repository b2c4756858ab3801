"""What the server checks of every HTTP request before any handler runs (a pure ASGI middleware,
so that nothing of a refused request is read or parsed):

- the time it reached the server (`received(request)`): latency and SLOs count from there, not
  from when the cluster got it;
- the Host header, against the names the server answers to (DNS rebinding);
- draining: while the server shuts down, every new request but the probes' (`/health`,
  `/metrics`) is answered 503 with Retry-After at once, whatever the load, and every answer
  carries `Connection: close`, so that no client reuses a connection the server is closing;
- capacity: a generation request the controller's `Room` refuses is answered 429 before any
  routing or validation: while the room refuses a request of the default priority and SLO,
  a small body is read and its priority and SLO (`slo_ms`, `deadline`) taken from it with
  json's parser alone, and the room asked for those; a body that is not a JSON object with
  such fields, or a large one, is left to the API (its 400s name the field). Refusing so costs
  the front little enough that refusals cannot starve the workers. The room prices a request
  by its `max_tokens` too (`admission.Room`). A request it lets through yields to the
  event loop once before the app runs it, so that in a burst the cheap refusals are answered
  before the work of the requests let through (tokenizing, queueing for the controller). A
  429 carries Retry-After and `retry-after-ms` (`retry_headers`), which OpenAI's clients read
  first: Retry-After jittered to 0.5-1.5 times its value, so that clients refused together do
  not come back together (the front answers each wave of their retries at once:
  docs/serving/reliability.md);
- the body size: a declared Content-Length over the limit, or a body that grows past it, is
  refused with 413 in OpenAI's shape before it is parsed.

`error_body` is OpenAI's error shape, shared with the API's handlers.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from collections.abc import Sequence

from dilaserve.cluster.requests import FULL

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers: no key, and answered while draining
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
EARLY_PARSE_BYTES = 64 * 1024  # larger bodies are parsed by the API, off the event loop
CLOSED_RETRY_AFTER = 5  # seconds a client refused by a server shutting down should wait
SHUTTING_DOWN = "the server is shutting down; retry on another replica or later"
RETRY_JITTER = (0.5, 1.5)  # a 429's retry-after-ms, as multiples of its Retry-After


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = {429: "rate_limit_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def draining_answer() -> bytes:
    """The whole HTTP answer of a server shutting down (what `Guards` answers while draining),
    for the requests `listener.py` answers below the app."""
    body = json.dumps(error_body(503, SHUTTING_DOWN)).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: {CLOSED_RETRY_AFTER}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


def retry_headers(seconds: int) -> dict[str, str]:
    """A 429's headers: Retry-After in whole seconds, and `retry-after-ms` (what OpenAI's
    clients read first), jittered by `RETRY_JITTER`."""
    millis = seconds * 1000 * random.uniform(*RETRY_JITTER)
    return {"retry-after": str(seconds), "retry-after-ms": str(round(millis))}


def received(request) -> tuple[float, float]:
    """(perf_counter, Unix time) when the request reached the server (now, if not recorded)."""
    return request.scope.get("dilaserve_received") or (time.perf_counter(), time.time())


class Guards:
    """ASGI middleware: stamps the arrival time, checks the Host header, refuses while draining
    or full, and checks the body size. `cluster` (`accepting`, `is_full(priority)`): None
    refuses nothing for draining or capacity; `api_key`: only requests carrying it are refused
    early for capacity (the others get the API's 401); `on_refusal()`: counts those refusals
    (the server's metrics, as the API's own)."""

    def __init__(
        self,
        app,
        max_body_bytes: int,
        allowed_hosts: Sequence[str] = ("*",),
        cluster=None,
        retry_after: int = 1,
        api_key: str | None = None,
        on_refusal=lambda: None,
    ):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = tuple(h.lower() for h in allowed_hosts)
        self.cluster = cluster
        self.retry_after = retry_after
        self.bearer = None if api_key is None else f"Bearer {api_key}".encode()
        self.on_refusal = on_refusal  # told of each request refused for draining or capacity

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope["dilaserve_received"] = (time.perf_counter(), time.time())
        headers = dict(scope.get("headers") or ())
        send = self._closing_while_draining(send)
        if not self._host_allowed(headers.get(b"host", b"").decode("latin-1")):
            return await respond(send, 400, "the Host header names no host this server serves")
        if self._draining() and scope["path"] not in OPEN_PATHS:
            self.on_refusal()
            return await respond(send, 503, SHUTTING_DOWN, CLOSED_RETRY_AFTER)
        early = self._may_refuse_early(scope, headers)
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            return await respond(send, 413, self._too_large())
        limited = _LimitedBody(receive, send, self)
        receive = limited.receive
        if early and self.cluster.is_full(0):
            body = await limited.read()
            if body is None:  # too large (413 sent) or the client left
                return None
            asks = _priority_and_slo(body)
            if asks is not None and self.cluster.is_full(*asks):
                self.on_refusal()
                retry = retry_headers(self.retry_after)
                return await respond(send, 429, FULL, headers=_encoded(retry))
            receive = limited.replay(body)
        if early:  # let through: the refusals of its burst are answered before its work
            await asyncio.sleep(0)
        await self.app(scope, receive, limited.send)

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

    def _may_refuse_early(self, scope, headers) -> bool:
        """Is this a generation request (by an authorised client) that capacity may refuse?"""
        if self.cluster is None or scope["method"] != "POST":
            return False
        if scope["path"] not in GENERATION_PATHS:
            return False
        sent = headers.get(b"authorization", b"")
        return self.bearer is None or secrets.compare_digest(sent, self.bearer)

    def _host_allowed(self, host: str) -> bool:
        if "*" in self.allowed_hosts:
            return True
        name = host.lower().rsplit(":", 1)[0] if not host.endswith("]") else host.lower()
        return name in self.allowed_hosts

    def _too_large(self) -> str:
        return f"the request body exceeds the server's limit of {self.max_body_bytes} bytes"


class _LimitedBody:
    """A request's body as the app receives it: refused with 413 once it grows past the limit
    (the app then hears the client left, and its answer is dropped); or read whole here, and
    replayed to the app."""

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

    async def read(self) -> bytes | None:
        """The whole body (None: it grew past the limit, or the client left)."""
        parts = []
        while True:
            message = await self.receive()
            if message["type"] != "http.request":
                return None
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(parts)

    def replay(self, body: bytes):
        """A receive that gives the app `body` read here, then what comes next."""
        given = False

        async def replayed():
            nonlocal given
            if given:
                return await self.receive()
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replayed


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
