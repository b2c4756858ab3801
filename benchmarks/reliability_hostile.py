"""The reliability suite's phases of issue 38 against a running server: an idle server after a
fault or a storm must admit; a storm of closed-loop clients; a CPU-hungry neighbour; header
floods and many-message chats while `/health` is timed; a drain at capacity; streams longer than
the drain. Each returns its summary; `reliability.py` runs them in order and writes the run
folder. `CpuHog` is also what `reliability.py --beside-hog` runs the whole suite beside."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from reliability_inputs import MODEL, PROMPT
from reliability_load import client_for, closed_loop, loop_lag, one, open_loop, stream_one
from reliability_phases import gauge_watch, gauges_now
from reliability_summaries import overload_summary, percentile, tally

from dilaserve.bench.client import NoAnswer

IDLE_REQUESTS = 25  # sent one at a time to an idle server after each fault or storm


class CpuHog:
    """One busy-looping process per core (or `processes`), niced 0: a neighbour that wants all
    of the machine. `with CpuHog(): ...` starts them and kills them on the way out.

    The loops share a session of their own, as another user's job would: where the kernel
    shares CPU time out by session (autogroup), loops in the load client's session would take
    the client's share and stretch latencies the server never saw."""

    def __init__(self, processes: int | None = None):
        self.processes = processes or os.cpu_count() or 1
        self._leader: subprocess.Popen | None = None

    def __enter__(self) -> CpuHog:
        spin = (
            f"import os\nfor _ in range({self.processes - 1}):\n"
            "    if os.fork() == 0: break\nwhile True: pass"
        )
        self._leader = subprocess.Popen([sys.executable, "-c", spin], start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        os.killpg(self._leader.pid, signal.SIGKILL)  # the leader's group: every loop
        self._leader.wait()


async def wait_idle(url: str, limit: float = 120.0) -> int:
    """Wait (at most `limit` s) until the server has nothing in flight; what is left."""
    end = time.monotonic() + limit
    async with client_for(url, timeout=10) as client:
        while True:
            try:
                left = (await client.get("/health")).json().get("in_flight", 0)
            except (NoAnswer, asyncio.TimeoutError, ValueError):
                left = -1
            if left == 0 or time.monotonic() > end:
                return left
            await asyncio.sleep(0.2)


async def metric(url: str, name: str) -> float | None:
    """One unlabelled gauge or counter of `/metrics`."""
    async with client_for(url, timeout=10) as client:
        text = (await client.get("/metrics")).body.decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def idle_admits(url: str, slo_ms: float, after: str) -> dict:
    """Once nothing is in flight, `IDLE_REQUESTS` requests one at a time: an idle server must
    admit every one (issue 38: after a fault or a storm, 25 of 25 were refused)."""
    left = await wait_idle(url)
    slowdown = await metric(url, "dilaserve_step_slowdown")
    async with client_for(url, timeout=10) as client:
        health = (await client.get("/health")).json().get("status")
    async with client_for(url) as client:
        records = [await one(client, slo_ms) for _ in range(IDLE_REQUESTS)]
    return {
        "after": after,
        "in_flight_before": left,
        "health_before": health,
        "slowdown_before": slowdown,
        "sent": len(records),
        "refused": sum(r["status"] == 429 for r in records),
        "statuses": tally(r["status"] for r in records),
    }


async def storm(
    url: str, clients: int, seconds: float, capacity: float, slo_ms: float, polite: bool
) -> dict:
    """`clients` closed-loop clients for `seconds`, each waiting 50 ms after a refusal (a
    storm) or, `polite`, as long as OpenAI's client waits (`openai_wait`); with what
    admission saw at the start and each second (`GAUGES`: the slowdown a first wave was priced
    at)."""
    lags: list[float] = []
    gauges: list = [await gauges_now(url)]  # (then one a second)
    records, _, _ = await asyncio.gather(
        closed_loop(url, clients, seconds, slo_ms, polite),
        loop_lag(time.monotonic() + seconds, lags),
        gauge_watch(url, time.monotonic() + seconds, gauges),
    )
    figures = {"clients": clients, "seconds": seconds, "polite": polite}
    figures |= overload_summary(records, seconds, capacity, slo_ms)
    return figures | {"client_loop_lag_p50_s": percentile(lags, 0.5),
                      "client_loop_lag_p99_s": percentile(lags, 0.99),
                      "gauges_each_second": gauges}  # fmt: skip


async def neighbour(url: str, rate: float, seconds: float, slo_ms: float) -> dict:
    """Open-loop load at `rate` while a CPU hog runs on every core."""
    with CpuHog() as hog:
        records = await open_loop(url, rate, seconds, slo_ms, seed=7)
    served = [r for r in records if r["status"] == 200]
    return {
        "hog_processes": hog.processes,
        "rate_per_s": round(rate, 2),
        "seconds": seconds,
        "statuses": tally(r["status"] for r in records),
        "served_within_slo": round(sum(r["within_slo"] for r in served) / max(len(served), 1), 4),
    }


# -- /health under hostile clients -------------------------------------------------------------


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


async def health_while(url: str, server_pid: int, attack, clients: int, seconds: float) -> dict:
    """/health polled every 20 ms (each poll on a new connection, as a probe does) while
    `clients` copies of `attack(host, port, end)` run; what they saw, the polls' latency and the
    server's largest resident memory."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    end = time.monotonic() + seconds
    waits: list[float] = []
    failed_polls, rss = 0, []

    async def poller():
        nonlocal failed_polls
        while time.monotonic() < end:
            start = time.perf_counter()
            try:
                async with client_for(url, timeout=30) as client:
                    await client.get("/health")
                waits.append(time.perf_counter() - start)
            except (NoAnswer, asyncio.TimeoutError):
                failed_polls += 1
            rss.append(rss_mib(server_pid) or 0.0)
            await asyncio.sleep(0.02)

    outcomes = await asyncio.gather(
        poller(), *(attack(host, int(port), end) for _ in range(clients))
    )
    return {
        "clients": clients,
        "seconds": seconds,
        "answers": tally(o for per_client in outcomes[1:] for o in per_client),
        "health_polls": len(waits),
        "health_failed_polls": failed_polls,
        "health_p50_s": percentile(waits, 0.5),
        "health_p99_s": percentile(waits, 0.99),
        "server_rss_max_mib": max(rss, default=None),
    }


async def huge_header(host: str, port: int, end: float, size: int = 64 << 20) -> list[str]:
    """Requests whose one header grows to `size` bytes, sent in 64 KiB pieces until the server
    answers or closes: what each got ("431", "400", "closed", ...)."""
    seen = []
    piece = b"a" * (64 << 10)
    while time.monotonic() < end:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            seen.append("cannot connect")
            await asyncio.sleep(0.1)
            continue
        try:
            writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\nX-Flood: ".encode())
            sent = 0
            while sent < size and time.monotonic() < end and not reader.at_eof():
                writer.write(piece)
                await asyncio.wait_for(writer.drain(), 30)
                sent += len(piece)
            writer.write(b"\r\n\r\n")
            await asyncio.wait_for(writer.drain(), 30)
            line = await asyncio.wait_for(reader.readline(), 30)
            seen.append(line.split(b" ")[1].decode() if line else "closed")
        except (OSError, asyncio.TimeoutError, IndexError):
            seen.append("closed")
        finally:
            writer.close()
    return seen


async def many_message_chat(host: str, port: int, end: float, messages: int = 25_000):
    """Chats of `messages` empty user messages (under the body limit), one after another."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": ""}] * messages}
    ).encode()
    seen = []
    async with client_for(f"http://{host}:{port}") as client:
        while time.monotonic() < end:
            try:
                seen.append(str((await client.post("/v1/chat/completions", body)).status))
            except (NoAnswer, asyncio.TimeoutError) as e:
                seen.append(f"no answer ({type(e).__name__})")
    return seen


# -- drain -------------------------------------------------------------------------------------

PROBES = 20  # requests sent into a drain besides the load's, at most


async def drain_at_capacity(
    url: str, server: subprocess.Popen, clients: int, slo_ms: float, drain_timeout: float
) -> dict:
    """SIGTERM to the server's process group while `clients` closed-loop clients keep it at or
    over capacity: every request sent after the signal must get 503 with Retry-After and
    `Connection: close` (or find the socket closed once the server stopped listening), and the
    server must exit within the drain timeout plus one second. Besides the clients' own
    requests, `PROBES` are sent one after another on a client of their own from the signal
    until the server exits, so that the case has new requests to judge even if every client
    is waiting on an answer then."""
    signalled: dict = {}
    probes: list[dict] = []

    async def term():
        await asyncio.sleep(5.0)
        signalled["at"] = time.perf_counter()
        os.killpg(server.pid, signal.SIGTERM)
        exited = asyncio.ensure_future(asyncio.to_thread(exited_after, server))
        async with client_for(url) as client:
            while not exited.done() and len(probes) < PROBES:
                probes.append(await one(client, slo_ms))
        signalled["exit_s"] = round(await exited - signalled["at"], 2)

    records, _ = await asyncio.gather(
        closed_loop(url, clients, 5.0 + drain_timeout + 5.0, slo_ms), term()
    )
    records += probes
    at = signalled["at"]
    after = [r for r in records if r["sent"] >= signalled["at"]]
    lost = [r for r in after if str(r["status"]).startswith("no answer")]
    answered = [r for r in after if isinstance(r["status"], int)]
    proper = [
        r
        for r in answered
        if r["status"] == 503
        and r.get("retry_after") is not None
        and (r.get("connection") or "").lower() == "close"
    ]
    return {
        "clients": clients,
        "drain_timeout_s": drain_timeout,
        "exit_s": signalled["exit_s"],
        "exit_code": server.returncode,
        "sent_after_signal": len(after),
        "statuses_after_signal": tally(r["status"] for r in after),
        "probes": tally(r["status"] for r in probes),  # (of those: `PROBES`' own)
        "answered_503_close_retry": len(proper),
        "answered_otherwise": len(answered) - len(proper),
        "unanswered": len(lost),
        "unanswered_why": tally(r.get("why", r["status"]) for r in lost),
        "unanswered_sent_s": [  # after the signal: the first and the last
            round(min((r["sent"] for r in lost), default=at) - at, 3),
            round(max((r["sent"] for r in lost), default=at) - at, 3),
        ],
    }


def exited_after(server: subprocess.Popen, limit: float = 60.0) -> float:
    """When (`perf_counter`) `server` exited, read by a thread waiting on it: the load's event
    loop, busy with hundreds of clients, would see it late."""
    try:
        server.wait(limit)
    except subprocess.TimeoutExpired:
        pass
    return time.perf_counter()


async def streams_past_the_drain(
    url: str, server: subprocess.Popen, streams: int, slo_ms: float, drain_timeout: float
) -> dict:
    """SIGTERM while `streams` long streams run, more than the drain lets finish: each must end
    with an error event or its text, then `[DONE]`, and the server must exit within the drain
    timeout plus one second."""
    async with client_for(url, timeout=120) as client:
        tasks = [
            asyncio.ensure_future(stream_one(client, slo_ms, max_tokens=256, prompt=PROMPT * 4))
            for _ in range(streams)
        ]
        await asyncio.sleep(0.5)
        at = time.perf_counter()
        os.killpg(server.pid, signal.SIGTERM)
        records = await asyncio.gather(*tasks)
    while server.poll() is None and time.perf_counter() - at < 60:
        await asyncio.sleep(0.02)
    return {
        "streams": len(records),
        "drain_timeout_s": drain_timeout,
        "exit_s": round(time.perf_counter() - at, 2),
        "ended_with_done": sum(bool(r.get("done")) for r in records),
        "with_error_event": sum(bool(r.get("error_event")) for r in records),
        "statuses": tally(r["status"] for r in records),
    }
