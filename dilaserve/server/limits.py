"""The HTTP front's limits on what a client may send, below the ASGI app (`HttpLimits`), and
uvicorn's protocol with them (`limited_protocol`).

uvicorn's fast parser (httptools) buffers a request's head however long it grows, and no uvicorn
protocol times out a client that sends its head or its body slowly: four clients sending 64 MB
headers held the event loop for 21.6 s, and 300 slow clients held their connections as long as
they liked. This protocol keeps httptools (h11, which has a head limit, cost 40% more CPU per
request: docs/serving.md) and adds:

- a head (request line and headers) over `max_header_bytes`, counted per read, or with more
  than `max_headers` fields, is answered 431 and the connection closed, before more is read;
- a head not complete `header_timeout` seconds after it began (or after the connection opened)
  is answered 408 and the connection closed;
- a body that stops arriving for `body_timeout` seconds likewise (without the 408 when the app
  has already answered, e.g. a refusal sent before the body was read);
- over `max_connections` open connections (uvicorn's `limit_concurrency`, passed on), or as
  many requests running, a request is answered 503 with Retry-After and `Connection: close`
  in OpenAI's shape (uvicorn's own answer is plain text, and logs a warning per request).

And, given the server's `EarlyRefusals` (`guards.py`), a generation request its room refuses
is answered 429 here, before any ASGI cycle: the protocol holds a request `judge` says to hold
(its small body collected here, nothing started) until the body is whole, then writes the
answer `answer` gives and reads on, or hands the request to the app as if it had just been
parsed; one let through (at once, or after holding) is counted by the room from then on.
A request is held only when nothing else on its connection is being answered, so that answers
stay in order. Under 3x overload this is most requests, and a refusal here costs the server
two thirds of what one through the app did (120 against 175 us at 600 a second:
docs/serving/reliability.md, "Refusals below the app").

Every request's receipt is stamped when its head is read (`guards.RECEIVED`): its latency and
SLO count from there, the time it was held or waited its turn here included (at 400 clients,
before 2026-12-07 evening, that wait was in neither, nor in admission's `Pace`).

The requests let through begin their ASGI cycles in order, at most `STARTS_PER_TURN` per turn
of the event loop (`_Starts`), which reads its sockets between turns: the requests of a burst
that the room refuses are answered as they are read, not after the app's work for every
request let through ahead of them. Those waiting whose room has closed since (the room is
priced again as the controller admits the requests ahead) are answered 429 from the back of
the queue at the next turn, as held ones, if their whole bodies are read and small
(docs/serving/reliability.md, "the first wave").

What the app refuses (body size, draining) is `guards.py`'s.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from dataclasses import dataclass

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dilaserve.server.guards import (
    EARLY_PARSE_BYTES,
    ENTRY,
    RECEIVED,
    EarlyRefusals,
    Verdict,
    http_answer,
    respond,
)

log = logging.getLogger("dilaserve.server")

# Let-through requests whose ASGI cycles begin per event-loop turn (`_Starts`): the first step
# of one, to its wait for admission, costs the loop about 0.5 ms on a 2-core machine
STARTS_PER_TURN = 4


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 * 1024  # request line + headers (nginx's large buffers: 32 KiB)
    max_headers: int = 100  # header fields (as Apache's LimitRequestFields)
    header_timeout: float = 10.0  # seconds to send a request's head
    body_timeout: float = 10.0  # seconds the body may pause between reads

    def __post_init__(self):
        for name in ("max_header_bytes", "max_headers", "header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; `send_400_response` answers `status`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def limited_protocol(
    limits: HttpLimits, refusals: EarlyRefusals | None = None, log_refusals: bool = True
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with `limits` and the server's `refusals` (pass it as
    `uvicorn.Config(http=...)`). `log_refusals`: an access-log line for each of `refusals`'
    429s (off where the access log drops them, `main.RefusalsCounted`: a record made only to
    be dropped was 4% of the event loop's time in the 400 clients' first wave)."""
    fields = {"limits": limits, "refusals": refusals, "log_refusals": log_refusals}
    if refusals is not None:
        fields["starts"] = _Starts()
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), fields)


class _Starts:
    """The ASGI cycles of requests the room let through, begun in order, at most
    `STARTS_PER_TURN` per turn of the event loop (the module's docstring)."""

    def __init__(self):
        self._queue: deque = deque()

    def add(self, protocol: LimitedHttpToolsProtocol, cycle, app) -> None:
        self._queue.append((protocol, cycle, app))
        if len(self._queue) == 1:
            protocol.loop.call_soon(self._begin_some, protocol.loop)

    def _begin_some(self, loop) -> None:
        try:
            self._refuse_from_the_back()
            for _ in range(min(STARTS_PER_TURN, len(self._queue))):
                protocol, cycle, app = self._queue.popleft()
                if not protocol.answered_here(cycle):
                    protocol.start(cycle, app)
        finally:
            if self._queue:  # (the rest after the loop's next read of its sockets)
                loop.call_soon(self._begin_some, loop)

    def _refuse_from_the_back(self) -> None:
        """Answer here the requests at the back of the queue that the room refuses now, each
        behind all those queued ahead of it, up to the first it takes (or cannot judge): when
        the room shrinks, the last let through are refused at once, not in their turn."""
        while self._queue:
            protocol, cycle, _ = self._queue[-1]
            if not protocol.answered_here(cycle):
                return
            self._queue.pop()


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with the limits of `HttpLimits` and `max_connections`, and
    the capacity refusals of `refusals` (None: none)."""

    limits = HttpLimits()
    refusals: EarlyRefusals | None = None
    log_refusals = True
    starts: _Starts | None = None  # (with `refusals`)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # uvicorn's own check answers plain text and logs a warning per request: ours instead
        self.max_connections, self.limit_concurrency = self.limit_concurrency, None
        self._timer = None
        self._held: bytearray | None = None  # the body of a request held for `refusals`
        self._begin_head()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._held = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)  # all read so far left the head unfinished
            if self._head_bytes > self.limits.max_header_bytes:
                self._answer_and_close(431, self._too_long())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:  # (a connection's first request began when it opened)
            self._begin_head()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.limits.max_headers:
            raise _Refused(431, f"more than {self.limits.max_headers} header fields")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.limits.body_timeout)
        self.scope[RECEIVED] = (time.perf_counter(), time.time())  # (before any wait of ours)
        if self._is_over_capacity():
            app, self.app = self.app, too_many_connections
            try:
                return super().on_headers_complete()  # (its cycle, answered by that app)
            finally:
                self.app = app
        verdict = self._verdict()
        if verdict is Verdict.HOLD:
            self._held = bytearray()  # its cycle begins if it is let through
            return None
        if verdict is Verdict.ENTER:
            self.scope[ENTRY] = self.refusals.enter()
        return super().on_headers_complete()

    def _verdict(self) -> Verdict:
        """`refusals`' verdict on this request; `OTHER` while an answer before it on its
        connection is unfinished (a refusal now would overtake it)."""
        if self.refusals is None or self.parser.should_upgrade():
            return Verdict.OTHER
        if self.cycle is not None and not self.cycle.response_complete:
            return Verdict.OTHER
        path = httptools.parse_url(self.url).path.decode("latin-1")
        return self.refusals.judge(self.parser.get_method(), path, self.headers)

    def _is_over_capacity(self) -> bool:
        """As uvicorn's `limit_concurrency`: too many connections open, or requests running."""
        limit = self.max_connections
        return limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit)

    def on_body(self, body: bytes) -> None:
        self._arm(self.limits.body_timeout)
        if self._held is None:
            return super().on_body(body)
        self._held += body
        if len(self._held) > EARLY_PARSE_BYTES:
            self._let_through()  # (chunked, growing past what is parsed here)
        return None

    def on_message_complete(self) -> None:
        self._disarm()
        if self._held is not None:
            keep_alive = self._keeps_alive()
            answer = self.refusals.answer(bytes(self._held), self._own_headers(keep_alive))
            if answer is not None:
                return self._refuse(answer, keep_alive)
            self._let_through()
        return super().on_message_complete()

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown, which answers a request it has begun (the app's 503)."""
        if self._held is not None:
            self._let_through()
        super().shutdown()

    def _let_through(self) -> None:
        """Begin the held request's cycle, as uvicorn would have, with its body so far."""
        body, self._held = bytes(self._held), None
        self.scope[ENTRY] = self.refusals.enter()
        super().on_headers_complete()
        if body:
            super().on_body(body)

    def _start_asgi_task(self, cycle, app) -> None:
        """uvicorn's, but a request the room let through (its entry in its scope) waits its
        turn in `starts`."""
        if self.starts is None or ENTRY not in cycle.scope:
            return super()._start_asgi_task(cycle, app)
        self.starts.add(self, cycle, app)
        return None

    def start(self, cycle, app) -> None:
        """Begin a let-through request's cycle (its turn in `starts` came)."""
        super()._start_asgi_task(cycle, app)

    def answered_here(self, cycle) -> bool:
        """Is a let-through request waiting its turn done with here? When its client has gone
        (nothing to answer), or the room refuses now what its whole body asks for
        (`EarlyRefusals.answer`, its entry not ahead of itself: a 429, as a held one's). Its
        count in the room then leaves."""
        entry = cycle.scope[ENTRY]
        if cycle.disconnected or self.transport.is_closing():
            entry.leave()
            return True
        try:
            answer = self._refusal_now(cycle, entry)
        except Exception:  # a bug here must not lose the request: the app answers it
            log.exception("judging a request let through failed; it goes to the app")
            return False
        if answer is None:
            return False
        entry.leave()
        cycle.response_complete = True  # (uvicorn's callbacks leave it be)
        self._refuse(answer, cycle.keep_alive)
        return True

    def _refusal_now(self, cycle, entry) -> bytes | None:
        """The room's 429 for a let-through request whose body is whole, or None. Not for one
        the room leaves to the API when read (`Expect`); only for the connection's latest
        request, nothing pipelined behind it: the parser still holds its request line (the
        access log's)."""
        if cycle is not self.cycle or self.pipeline or cycle.more_body:
            return None
        if any(name == b"expect" for name, _ in cycle.scope["headers"]):
            return None
        headers = self._own_headers(cycle.keep_alive)
        return self.refusals.answer(bytes(cycle.body), headers, entry)

    def _own_headers(self, keep_alive: bool) -> list[tuple[bytes, bytes]]:
        """The connection's headers on an answer written here (server, date; close)."""
        closing = [] if keep_alive else [(b"connection", b"close")]
        return [*self.server_state.default_headers, *closing]

    def _keeps_alive(self) -> bool:
        """Does the request being parsed leave its connection open (as uvicorn's cycle)?"""
        return self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()

    def _refuse(self, answer: bytes, keep_alive: bool) -> None:
        """Send the held request's refusal, then read on (as after a cycle) or close."""
        self._held = None
        self.transport.write(answer)
        if self.access_log and self.log_refusals:  # (as uvicorn's cycle logs it)
            client = "{}:{}".format(*self.client) if self.client else "-"
            method, version = self.parser.get_method().decode(), self.parser.get_http_version()
            line = '%s - "%s %s HTTP/%s" %d'
            self.access_logger.info(line, client, method, self.url.decode("latin-1"), version, 429)
        if not keep_alive:
            self.transport.close()
        self.on_response_complete()

    def send_400_response(self, msg: str) -> None:
        """The parser stopped: on a refusal of ours, its answer; else uvicorn's 400."""
        cause = _refused_by_callback()
        if cause is None:
            return super().send_400_response(msg)
        self._answer_and_close(cause.status, str(cause))

    def _begin_head(self) -> None:
        self._in_head, self._head_bytes, self._num_headers = True, 0, 0
        self._arm(self.limits.header_timeout)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        part = "head" if self._in_head else "body"
        seconds = self.limits.header_timeout if self._in_head else self.limits.body_timeout
        if self._is_waiting_for_us():
            self._arm(seconds)
            return
        self._answer_and_close(408, f"the request's {part} did not arrive within {seconds:g} s")

    def _is_waiting_for_us(self) -> bool:
        """Is the server, not the client, why the request is unfinished? Its body is not read
        because the app has not read what came (flow control paused reading), or its head is
        a pipelined request's, sent while the previous one is still being answered."""
        if not self._in_head:
            return self.flow.read_paused
        return self.cycle is not None and not self.cycle.response_complete

    def _too_long(self) -> str:
        return f"the request's head exceeds {self.limits.max_header_bytes} bytes"

    def _answer_and_close(self, status: int, message: str) -> None:
        self._disarm()
        cycle = self.cycle if self._held is None else None  # (a held request has none yet)
        self._held = None
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app, if it runs, hears the client has gone
            cycle.message_event.set()
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.close()  # mid-answer: a status line now would corrupt it
            return
        if cycle is not None and cycle.response_complete and not self._in_head:
            self.transport.close()  # answered already (before the body came): just close
            return
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        self.transport.write(http_answer(status, message.encode(), headers))
        self.transport.close()


async def too_many_connections(scope, receive, send) -> None:
    """The answer over `max_connections`: 503 in OpenAI's shape, with Retry-After, closing."""
    message = "the server holds as many connections as it takes; retry later"
    await respond(send, 503, message, retry_after=1, headers=[(b"connection", b"close")])


def _refused_by_callback() -> _Refused | None:
    """The `_Refused` a parser callback raised, if that is what stopped the parser (uvicorn
    calls `send_400_response` handling the `HttpParserCallbackError` httptools raises while
    handling the callback's exception)."""
    cause = sys.exc_info()[1]
    cause = getattr(cause, "__context__", None)
    return cause if isinstance(cause, _Refused) else None
