"""A lean HTTP/1.1 client for the benchmarks that drive a server at hundreds of requests per
second from the machine it runs on (`dilaserve.bench.loadgen`, the streaming client of
`dilaserve bench`, measures time to first text instead, through httpx).

At 200 requests/s on this 2-core machine, httpx's own CPU time was counted as the server's
latency it measured: 0.65 s of a served request's median was the client's (docs/serving.md).
This client sends pre-encoded bodies over keep-alive connections with asyncio streams and
parses only the status line, the headers and a Content-Length body: what an answer to a
non-streaming JSON request is.

    pool = Pool("127.0.0.1", 8000)
    answer = await pool.post("/v1/completions", body_bytes)   # Answer(status, headers, body)
    await pool.close()
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass


class NoAnswer(Exception):
    """The connection closed, or could not be opened, before a whole answer came."""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self):
        return json.loads(self.body)


class Pool:
    """Keep-alive connections to one server, opened as needed (at most `max_connections`)."""

    def __init__(self, host: str, port: int, max_connections: int = 1000, timeout: float = 60):
        self.host, self.port, self.timeout = host, port, timeout
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def post(self, path: str, body: bytes) -> Answer:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        request = head + body
        async with self._slots:
            reused = bool(self._idle)
            connection = self._idle.pop() if reused else await self._open()
            try:
                try:
                    answer = await self._timed(connection, request)
                except NoAnswer:
                    if not reused:
                        raise
                    # the server closed an idle keep-alive connection: once more on a new one
                    connection[1].close()
                    connection = await self._open()
                    answer = await self._timed(connection, request)
            except BaseException:
                connection[1].close()
                raise
            if answer.headers.get("connection", "").lower() == "close":
                connection[1].close()
            else:
                self._idle.append(connection)
            return answer

    async def _timed(self, connection, request: bytes) -> Answer:
        return await asyncio.wait_for(self._exchange(connection, request), self.timeout)

    async def _open(self):
        try:
            return await asyncio.open_connection(self.host, self.port)
        except OSError as e:
            raise NoAnswer(f"cannot connect: {e}") from e

    @staticmethod
    async def _exchange(connection, request: bytes) -> Answer:
        reader, writer = connection
        try:
            writer.write(request)
            await writer.drain()
            status_line = await reader.readline()
            if not status_line:
                raise NoAnswer("the connection closed before an answer")
            status = int(status_line.split(b" ", 2)[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", 0)))
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            raise NoAnswer(str(e) or type(e).__name__) from e
        return Answer(status, headers, body)

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()
