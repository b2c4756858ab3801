"""The HTTP load client of `dilaserve bench` and the benchmarks: aiohttp (as vLLM's serving
benchmark), keep-alive connections to one server, whole answers or server-sent event streams.

An answer carries `sent`, the `time.perf_counter()` at which its request's head was written:
what came before it (opening a connection, waiting for one from the pool) is this process's
own time, not the server's. With hundreds of requests started at once it is most of what they
wait (docs/serving/reliability.md, "The load client's own wave").

Every request is sent once. A connection the server closes before a whole answer came is a
`NoAnswer`, never a second send: the server may have taken the request in already (a POST that
it would run twice). aiohttp itself retries only idempotent methods, on a reused connection.

    async with LoadClient("http://127.0.0.1:8000") as client:
        answer = await client.post("/v1/completions", body)       # Answer(status, headers, body)
        answer.sent                                               # when its bytes went out
        async with client.stream("/v1/completions", body) as events:
            async for chunk in events:                            # each `data:` JSON object
                ...
        events.done                                               # whether `data: [DONE]` came
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp


class NoAnswer(Exception):
    """The connection could not be opened (`refused`), or closed before a whole answer came,
    or what came was not HTTP."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes
    sent: float | None = None  # perf_counter when the request's head was written

    def json(self):
        return json.loads(self.body)


class EventStream:
    """A response read as server-sent events: iterate it for each `data:` payload (JSON) up to
    `data: [DONE]`; `done` says whether that came. A status other than 200 has no events:
    read `body()` instead."""

    def __init__(self, response: aiohttp.ClientResponse):
        self.status = response.status
        self.headers = _headers(response)
        self.done = False
        self._response = response

    async def body(self) -> bytes:
        return await _read(self._response.read())

    async def __aiter__(self) -> AsyncIterator[dict]:
        lines = aiter(self._response.content)
        while (line := await _read(anext(lines, None))) is not None:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            payload = line[len(b"data:") :].strip()
            if payload == b"[DONE]":
                self.done = True
                return
            yield json.loads(payload)


class LoadClient:
    """Keep-alive connections to the server at `base_url`: at most `max_connections` open (0:
    no limit), each request bounded by `timeout` seconds in all (`asyncio.TimeoutError`)."""

    def __init__(
        self,
        base_url: str,
        timeout: float = 60.0,
        max_connections: int = 0,
        headers: dict[str, str] | None = None,
    ):
        self.base_url, self.timeout = base_url, timeout
        self.max_connections, self.headers = max_connections, headers or {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> LoadClient:
        self._session = aiohttp.ClientSession(
            self.base_url,
            connector=aiohttp.TCPConnector(limit=self.max_connections),
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            headers=self.headers,
            trace_configs=[_SENT],
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def get(self, path: str) -> Answer:
        return await self._whole("GET", path, None)

    async def post(
        self, path: str, body: dict | bytes, headers: dict[str, str] | None = None
    ) -> Answer:
        """POST `body` (a dict as JSON, or bytes already encoded) once; `headers` replace the
        JSON content type."""
        return await self._whole("POST", path, body, headers)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, body: dict | bytes) -> AsyncIterator[EventStream]:
        """POST `body` once and read the answer as it comes."""
        async with _no_answer_on_close():
            async with self._send("POST", path, body) as response:
                yield EventStream(response)

    async def _whole(self, method: str, path: str, body, headers=None) -> Answer:
        sent: dict = {}
        async with _no_answer_on_close():
            async with self._send(method, path, body, headers, sent) as response:
                answer = await response.read()
                return Answer(response.status, _headers(response), answer, sent.get("at"))

    def _send(self, method: str, path: str, body, headers=None, sent: dict | None = None):
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        if headers is None and body is not None:
            headers = {"Content-Type": "application/json"}
        return self._session.request(
            method, path, data=body, headers=headers, trace_request_ctx=sent
        )


async def _head_written(session, context, params) -> None:
    """aiohttp's trace hook: note when the request's head went out (`Answer.sent`)."""
    if isinstance(context.trace_request_ctx, dict):
        context.trace_request_ctx["at"] = time.perf_counter()


_SENT = aiohttp.TraceConfig()
_SENT.on_request_headers_sent.append(_head_written)
_SENT.freeze()


@contextlib.asynccontextmanager
async def _no_answer_on_close():
    """aiohttp's connection errors as `NoAnswer` (timeouts stay `asyncio.TimeoutError`)."""
    try:
        yield
    except asyncio.TimeoutError:
        raise
    except aiohttp.ClientConnectorError as e:
        raise NoAnswer(f"cannot connect: {e}", refused=True) from e
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as e:
        raise NoAnswer(f"the connection closed before an answer: {e}") from e
    except aiohttp.ClientPayloadError as e:
        raise NoAnswer(f"the connection closed within the answer: {e}") from e
    except aiohttp.ClientError as e:  # an answer HTTP cannot read, ...
        raise NoAnswer(f"no well-formed answer: {type(e).__name__}: {e}") from e


async def _read(awaitable):
    """Await a read of the answer, with the connection errors `_no_answer_on_close` maps."""
    async with _no_answer_on_close():
        return await awaitable


def _headers(response: aiohttp.ClientResponse) -> dict[str, str]:
    return {name.lower(): value for name, value in response.headers.items()}
