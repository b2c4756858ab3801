"""The reliability suite's load on the server, over the load client (`dilaserve/bench/client.py`,
aiohttp, which sends each request once): one completion, closed and open loops of them, and one
streamed completion. Each request gives a record (`status`, `latency`, ...) for
`reliability_summaries.py`; what the load is for, and the faults injected under it, are
`reliability_phases.py`'s."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import time

from reliability_inputs import MODEL, PROMPT, is_openai_answer
from reliability_summaries import answer_latencies, percentile, tally

from dilaserve.bench.client import LoadClient, NoAnswer


async def one(client: LoadClient, slo_ms: float) -> dict:
    """One completion; its status is the HTTP status, "refused" (no connection), or "no answer
    (closed)" / "no answer (timeout)". `latency` counts from the call; `answer_latency` from
    when its head went out, `client_wait` the time before (this process's, `LoadClient`)."""
    start = time.perf_counter()
    record, answer = {"sent": start}, None
    try:
        answer = await client.post("/v1/completions", completion_body(slo_ms))
        record["status"], record["retry_after"] = answer.status, answer.headers.get("retry-after")
        record["wait_s"] = openai_wait(answer.headers)
        record["connection"] = answer.headers.get("connection")
        record["openai_shape"] = is_openai_answer(answer.status, answer.body)
        if answer.status == 200:  # the latency the server counts, from when it got the request
            record["server_latency"] = answer.json()["dilaserve"]["latency_s"]
        elif answer.status == 429 and record["openai_shape"]:  # (why: the front's or admission's)
            record["message"] = answer.json()["error"]["message"]
    except NoAnswer as e:
        record["status"] = "refused" if e.refused else "no answer (closed)"
        record["why"] = f"{type(e.__cause__).__name__}: {e.__cause__}"[:80]  # (a reset, ...)
    except asyncio.TimeoutError:
        record["status"] = "no answer (timeout)"
    end = record["latency"] = time.perf_counter() - start
    if answer is not None and answer.sent is not None:  # the client's own wait, then the server's
        record["client_wait"] = answer.sent - start
        record["answer_latency"] = end - record["client_wait"]
    record["within_slo"] = record["status"] == 200 and record["latency"] * 1000 <= slo_ms
    return record


def openai_wait(headers: dict[str, str]) -> float | None:
    """Seconds OpenAI's Python client waits before it retries a refusal with these headers:
    `retry-after-ms` first (the server jitters it, so that clients refused together do not
    come back together), else `Retry-After`; None (its own backoff) unless in (0, 60]."""
    for header, per_second in (("retry-after-ms", 1000), ("retry-after", 1)):
        try:
            wait = float(headers[header]) / per_second
        except (KeyError, ValueError):
            continue
        return wait if 0 < wait <= 60 else None
    return None


def completion_body(slo_ms: float) -> bytes:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "slo_ms": slo_ms}
    return json.dumps(body).encode()


def client_for(url: str, timeout: float = 60.0) -> LoadClient:
    return LoadClient(url, timeout, max_connections=2000)


async def closed_loop(
    url: str, clients: int, seconds: float, slo_ms: float, polite: bool = False
) -> list[dict]:
    """`clients` clients, each sending its next request when its last is answered: 50 ms after
    a refusal, or, `polite`, as long as OpenAI's client waits (`openai_wait`)."""
    records: list[dict] = []
    end = time.monotonic() + seconds

    async def loop(client: LoadClient):
        while time.monotonic() < end:
            record = await one(client, slo_ms)
            records.append(record)
            if record["status"] != 200:
                wait = record.get("wait_s") if polite else None
                await asyncio.sleep(wait or 0.05)

    async with client_for(url) as client:
        await asyncio.gather(*(loop(client) for _ in range(clients)))
    return records


async def loop_lag(until: float, seen: list[float], every: float = 0.01) -> None:
    """How late this process's event loop wakes (seconds past each `every`), until `until`
    (monotonic): the load client's own share of the latencies it records."""
    while time.monotonic() < until:
        start = time.perf_counter()
        await asyncio.sleep(every)
        seen.append(max(time.perf_counter() - start - every, 0.0))


async def open_loop(url: str, rate: float, seconds: float, slo_ms: float, seed: int, during=None):
    """Poisson arrivals at `rate` for `seconds`; `during(t0)` runs alongside (a fault)."""
    rng = random.Random(seed)
    async with client_for(url) as client:
        tasks, t0 = [], time.monotonic()
        fault = asyncio.ensure_future(during(t0)) if during else None
        next_at = t0
        while next_at < t0 + seconds:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(client, slo_ms)))
            next_at += rng.expovariate(rate)
        records = await asyncio.gather(*tasks)
        if fault is not None:
            await fault
    return list(records)


# -- the load client's own floor -------------------------------------------------------------

# A server that writes a bare 429 for each request head and does nothing else (a process of its
# own, serving the listening socket whose descriptor it is given; "up" once it serves)
REFUSING_SERVER = """
import asyncio, socket, sys
REFUSAL = b"HTTP/1.1 429 Too Many Requests\\r\\ncontent-length: 0\\r\\n\\r\\n"
class Refuses(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
    def data_received(self, data):
        self.transport.write(REFUSAL * data.count(b"\\r\\n\\r\\n"))
async def serve():
    listener = socket.socket(fileno=int(sys.argv[1]))
    server = await asyncio.get_running_loop().create_server(Refuses, sock=listener)
    print("up", flush=True)
    await server.serve_forever()
asyncio.run(serve())
"""


async def client_floor(clients: int, slo_ms: float) -> dict:
    """What this process alone makes a closed loop's first wave wait: `clients` requests sent
    at once, each on a new connection, to a server on this machine that only writes a 429 per
    request head (`REFUSING_SERVER`). Their p99 from the call and from their head sent."""
    with socket.create_server(("127.0.0.1", 0), backlog=4096) as listener:
        fd = listener.fileno()
        command = [sys.executable, "-c", REFUSING_SERVER, str(fd)]
        server = subprocess.Popen(command, pass_fds=[fd], stdout=subprocess.PIPE)
        try:
            if await asyncio.to_thread(server.stdout.readline) != b"up\n":
                raise RuntimeError("the refusing server did not start")
            url = f"http://127.0.0.1:{listener.getsockname()[1]}"
            async with client_for(url) as client:
                records = await asyncio.gather(*(one(client, slo_ms) for _ in range(clients)))
        finally:
            server.kill()
            server.wait()
    return {
        "requests": len(records),
        "statuses": tally(r["status"] for r in records),
        "p99_s": percentile([r["latency"] for r in records], 0.99),
        "p99_from_sent_s": percentile(answer_latencies(records), 0.99),
    }


async def stream_one(
    client: LoadClient, slo_ms: float, max_tokens: int = 32, prompt: str = PROMPT
) -> dict:
    """One streamed completion: its status, whether it ended with `[DONE]`, and whether an
    error event came."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "slo_ms": slo_ms,
            "stream": True}  # fmt: skip
    try:
        async with client.stream("/v1/completions", body) as events:
            chunks = [chunk async for chunk in events] if events.status == 200 else []
    except NoAnswer as e:
        return {"status": "refused" if e.refused else "no answer (closed)"}
    except asyncio.TimeoutError:
        return {"status": "no answer (timeout)"}
    return {
        "status": events.status,
        "done": events.done,
        "error_event": any("error" in chunk for chunk in chunks),
    }
