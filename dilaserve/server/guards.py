"""What the server checks of every HTTP request before any handler runs (a pure ASGI middleware,
so that nothing of a refused request is read or parsed):

- the time it reached the server (`received(request)`): latency and SLOs count from there, not
  from when the cluster got it;
- the Host header, against the names the server answers to (DNS rebinding);
- the body size: a declared Content-Length over the limit, or a body that grows past it, is
  refused with 413 in OpenAI's shape before it is parsed.

`error_body` is OpenAI's error shape, shared with the API's handlers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = {429: "rate_limit_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def received(request) -> tuple[float, float]:
    """(perf_counter, Unix time) when the request reached the server (now, if not recorded)."""
    return request.scope.get("dilaserve_received") or (time.perf_counter(), time.time())


class Guards:
    """ASGI middleware: stamps the arrival time, checks the Host header and the body size."""

    def __init__(self, app, max_body_bytes: int, allowed_hosts: Sequence[str] = ("*",)):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = tuple(h.lower() for h in allowed_hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope["dilaserve_received"] = (time.perf_counter(), time.time())
        headers = dict(scope.get("headers") or ())
        if not self._host_allowed(headers.get(b"host", b"").decode("latin-1")):
            return await _respond(send, 400, "the Host header names no host this server serves")
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            return await _respond(send, 413, self._too_large())
        refused = False  # the body grew past the limit: 413 sent, the app's answer dropped

        async def counting_receive():
            nonlocal refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            counting_receive.size += len(message.get("body", b""))
            if counting_receive.size > self.max_body_bytes:
                refused = True
                await _respond(send, 413, self._too_large())
                return {"type": "http.disconnect"}  # the app stops reading
            return message

        async def guarded_send(message):
            if not refused:
                await send(message)

        counting_receive.size = 0
        await self.app(scope, counting_receive, guarded_send)

    def _host_allowed(self, host: str) -> bool:
        if "*" in self.allowed_hosts:
            return True
        name = host.lower().rsplit(":", 1)[0] if not host.endswith("]") else host.lower()
        return name in self.allowed_hosts

    def _too_large(self) -> str:
        return f"the request body exceeds the server's limit of {self.max_body_bytes} bytes"


async def _respond(send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def allowed_hosts_for(host: str, given: Sequence[str] | None) -> tuple[str, ...]:
    """The Host names to accept: those `given`; else, for a server bound to loopback, only the
    loopback names (a web page elsewhere cannot reach it by DNS rebinding); else any."""
    if given:
        return tuple(given)
    return LOCAL_HOSTS if host in LOCAL_HOSTS else ("*",)
