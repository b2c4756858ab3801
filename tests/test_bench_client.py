"""The load client sends every request once, reads whole answers and event streams, and names
what went wrong: against a raw asyncio server on a real 127.0.0.1 socket."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest

from dilaserve.bench.client import LoadClient, NoAnswer
from dilaserve.server.guards import retry_headers

from conftest import HANG_GUARD_S, import_benchmark

OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{"ok": true}'
EVENTS = b'data: {"n": 1}\n\n: a comment\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's head (its body read and dropped), or None at the end of the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = re.search(rb"content-length: *(\d+)", head.lower())
    await reader.readexactly(int(length.group(1)) if length else 0)
    return head


async def start(handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def answer_ok(writer: asyncio.StreamWriter) -> None:
    writer.write(OK)
    await writer.drain()


def one_connection(url: str) -> LoadClient:
    """The client, over at most one kept-alive connection."""
    return LoadClient(url, timeout=HANG_GUARD_S, max_connections=1)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, HANG_GUARD_S))


def test_a_request_on_a_connection_the_server_closes_is_not_sent_again():
    """The server answers a connection's first request, then reads the second and closes: the
    client says so, and the server has seen the second request once (the hand-written client
    this replaced sent it again on a new connection, so the server saw 3 requests)."""
    seen: list[bytes] = []

    async def handler(reader, writer):
        for answered in range(2):
            if (head := await read_request(reader)) is None:
                break
            seen.append(head)
            if answered:  # a reused connection: closed without an answer
                break
            await answer_ok(writer)
        writer.close()

    async def scenario():
        server, url = await start(handler)
        async with server, one_connection(url) as client:
            first = await client.post("/v1/completions", {"prompt": "a"})
            with pytest.raises(NoAnswer, match="closed") as closed:
                await client.post("/v1/completions", {"prompt": "b"})
        return first, closed.value

    first, closed = run(scenario())
    assert (first.status, first.json()) == (200, {"ok": True})
    assert not closed.refused
    assert len(seen) == 2


def test_an_event_stream_gives_each_data_object_up_to_done():
    async def handler(reader, writer):
        await read_request(reader)
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        writer.write(head + EVENTS)
        await writer.drain()
        writer.close()

    async def scenario():
        server, url = await start(handler)
        async with server, LoadClient(url, timeout=HANG_GUARD_S) as client:
            async with client.stream("/v1/completions", b'{"stream": true}') as events:
                chunks = [chunk async for chunk in events]
        return events, chunks

    events, chunks = run(scenario())
    assert (events.status, chunks, events.done) == (200, [{"n": 1}, {"n": 2}], True)


def test_a_stream_cut_short_is_not_done():
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b'data: {"n": 1}\n\n')
        await writer.drain()
        writer.close()

    async def scenario():
        server, url = await start(handler)
        async with server, LoadClient(url, timeout=HANG_GUARD_S) as client:
            async with client.stream("/x", {}) as events:
                chunks = [chunk async for chunk in events]
        return events, chunks

    events, chunks = run(scenario())
    assert chunks == [{"n": 1}] and not events.done


def test_a_closed_port_is_refused():
    async def scenario():
        server, url = await start(lambda reader, writer: writer.close())
        server.close()
        await server.wait_closed()
        async with LoadClient(url, timeout=HANG_GUARD_S) as client:
            await client.get("/health")

    with pytest.raises(NoAnswer, match="cannot connect") as refused:
        run(scenario())
    assert refused.value.refused


def test_the_reliability_suites_polite_clients_wait_as_openais_client_does():
    """`retry-after-ms` first (jittered by the server), then Retry-After: waiting Retry-After
    alone, clients refused together came back together, one wave a second."""
    load = import_benchmark("reliability_load")
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")
    for headers in (retry_headers(1), retry_headers(5), {"retry-after": "2"}, {}):
        assert load.openai_wait(headers) == client._parse_retry_after_header(headers)
    waits = {load.openai_wait(retry_headers(1)) for _ in range(50)}
    assert len(waits) > 10 and all(0.5 <= w <= 1.5 for w in waits)
    assert load.openai_wait({"retry-after": "120"}) is None  # (past 60 s: its own backoff)


def test_an_answer_says_when_its_request_went_out():
    """`Answer.sent` is when the request's head was written: after the call began and before
    the server read it, on a new connection and on a kept-alive one alike."""
    read_at: list[float] = []

    async def handler(reader, writer):
        while await read_request(reader) is not None:
            read_at.append(time.perf_counter())
            await answer_ok(writer)
        writer.close()

    async def scenario():
        server, url = await start(handler)
        async with server, one_connection(url) as client:
            answers = []
            for _ in range(2):
                called = time.perf_counter()
                answers.append((called, await client.post("/v1/completions", {"prompt": "a"})))
        return answers

    answers = run(scenario())
    assert len(read_at) == 2
    for (called, answer), seen in zip(answers, read_at):
        assert called <= answer.sent <= seen


def test_the_reliability_suite_judges_refusals_from_when_they_went_out():
    """The refusal target is judged on the time from each request's head written (the
    client's own wait before it is reported beside it), and the load client's floor (a wave
    against a server that only refuses) is measured."""
    load = import_benchmark("reliability_load")
    summaries = import_benchmark("reliability_summaries")
    targets = import_benchmark("reliability_targets")
    waited = [{"status": 429, "sent": 0.0, "latency": 0.3, "client_wait": 0.25,
               "answer_latency": 0.05, "retry_after": "1"}] * 10  # fmt: skip
    summary = summaries.overload_summary(waited, 1.0, 1.0, 2000)
    assert (summary["refusal_latency_p99_s"], summary["refusal_answer_p99_s"]) == (0.3, 0.05)
    assert summary["refusal_client_wait_p99_s"] == 0.25
    refusals = targets.overload_verdicts("a closed loop", summary)[0]
    assert refusals["met"] and "0.3 s" in refusals["measured"]
    floor = asyncio.run(asyncio.wait_for(load.client_floor(20, 2000), HANG_GUARD_S))
    assert floor["statuses"] == {"429": 20}
    assert 0 < floor["p99_from_sent_s"] <= floor["p99_s"]


def test_a_drain_with_no_request_after_the_signal_is_not_met():
    """A drain the load sent nothing into proves nothing about what new requests get."""
    targets = import_benchmark("reliability_targets")
    drain = {"drain_timeout_s": 2.0, "exit_s": 0.7, "sent_after_signal": 0,
             "statuses_after_signal": {}, "answered_503_close_retry": 0,
             "answered_otherwise": 0, "unanswered": 0}  # fmt: skip
    answers, exit_in_time = targets.drain_verdicts(drain)
    assert not answers["met"] and "none sent" in answers["measured"] and exit_in_time["met"]
    proper = {**drain, "sent_after_signal": 3, "statuses_after_signal": {"503": 3},
              "answered_503_close_retry": 3}  # fmt: skip
    assert targets.drain_verdicts(proper)[0]["met"]


def test_the_cpu_a_server_session_used_is_its_fronts_and_its_workers_not_the_clients():
    """`benchmarks/reliability.py` splits the CPU of a phase between the load client and the
    server's session (its leader: the front; the rest: its workers). Counted in CPU seconds,
    not in time: a worker spins for 0.5 s of CPU, says so, and waits."""
    reliability = import_benchmark("reliability")
    worker = (
        "import time\nwhile time.process_time() < 0.5: pass\nprint(flush=True)\ntime.sleep(600)"
    )
    leader = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {worker!r}])"
    server = subprocess.Popen(
        [sys.executable, "-c", leader], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        server.stdout.readline()  # (the worker has spun)
        used = reliability.cpu_seconds(server.pid)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(HANG_GUARD_S)
    assert used["workers"] >= 0.45 and used["front"] < used["workers"] and used["client"] > 0
