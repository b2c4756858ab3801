"""The reliability suite's phases against a running server, each bounded in time: the fuzz and
/health under large bodies, the overload at a rate, and the faults (kill -9 or SIGSTOP of a
worker). Each returns its summary; starting the server and writing the run folder are
`reliability.py`'s (issue 38's phases are in `reliability_hostile.py`)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from reliability_inputs import MODEL, hostile_body, is_openai_answer
from reliability_load import client_for, loop_lag, open_loop
from reliability_summaries import fault_summary, overload_summary, percentile

from dilaserve.bench.client import NoAnswer

# -- fuzz ----------------------------------------------------------------------------------


async def fuzz(url: str, count: int, seed: int, deadline: float) -> dict:
    rng = random.Random(seed)
    bodies = [hostile_body(rng) for _ in range(count)]
    statuses: dict[str, int] = {}
    bad: list[str] = []
    queue: asyncio.Queue = asyncio.Queue()
    for item in bodies:
        queue.put_nowait(item)

    async def sender(client):
        while not queue.empty() and time.monotonic() < deadline:
            path, raw, headers = queue.get_nowait()
            try:
                r = await client.post(path, raw, headers)
            except (NoAnswer, asyncio.TimeoutError) as e:
                statuses["no answer"] = statuses.get("no answer", 0) + 1
                bad.append(f"{path} {raw[:80]!r}: {type(e).__name__}")
                continue
            statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
            if r.status >= 500 or not is_openai_answer(r.status, r.body):
                bad.append(f"{path} {raw[:80]!r}: {r.status} {r.body[:120]!r}")

    async with client_for(url) as client:
        await asyncio.gather(*(sender(client) for _ in range(16)))
    sent = sum(statuses.values())
    return {"bodies": sent, "statuses": statuses, "bad": len(bad), "bad_examples": bad[:10]}


async def health_under_large_bodies(url: str, seconds: float) -> dict:
    """/health polled every 20 ms while 8 clients send the largest bodies the server reads
    (just under its 1 MiB limit, a prompt past the context) and long prompts it admits."""
    huge = json.dumps({"model": MODEL, "prompt": "7" * ((1 << 20) - 100)}).encode()
    long = json.dumps({"model": MODEL, "prompt": "7 " * 200, "max_tokens": 32}).encode()
    end, waits, statuses = time.monotonic() + seconds, [], {}

    async def sender(client, body: bytes):
        while time.monotonic() < end:
            status = str((await client.post("/v1/completions", body)).status)
            statuses[status] = statuses.get(status, 0) + 1

    async def poller(client):
        while time.monotonic() < end:
            start = time.perf_counter()
            await client.get("/health")
            waits.append(time.perf_counter() - start)
            await asyncio.sleep(0.02)

    async with client_for(url) as load, client_for(url) as probe:
        await asyncio.gather(poller(probe), *(sender(load, b) for b in [huge] * 4 + [long] * 4))
    return {
        "seconds": seconds,
        "large_requests": statuses,
        "health_polls": len(waits),
        "health_p50_s": percentile(waits, 0.5),
        "health_p99_s": percentile(waits, 0.99),
        "health_max_s": round(max(waits), 4),
    }


# -- overload ------------------------------------------------------------------------------


async def overload_phase(url: str, rate: float, capacity: float, args) -> dict:
    """Poisson arrivals at `rate` for `--overload-seconds`, with the server's measured step
    slowdown watched alongside."""
    slowdowns: list[float] = []
    lags: list[float] = []
    seconds = args.overload_seconds
    thresholds = await step_thresholds(url)
    records, _, _ = await asyncio.gather(
        open_loop(url, rate, seconds, args.slo_ms, args.seed),
        slowdown_watch(url, time.monotonic() + seconds, slowdowns),
        loop_lag(time.monotonic() + seconds, lags),
    )
    summary = {"rate_per_s": round(rate, 2), "seconds": seconds}
    summary |= overload_summary(records, seconds, capacity, args.slo_ms)
    summary |= {"client_loop_lag_p50_s": percentile(lags, 0.5),
                "client_loop_lag_p99_s": percentile(lags, 0.99)}  # fmt: skip
    summary["mean_threshold"] = mean_threshold(thresholds, await step_thresholds(url))
    summary["step_slowdown"] = {
        "min": min(slowdowns, default=None),
        "median": percentile(slowdowns, 0.5),
        "max": max(slowdowns, default=None),
    }
    return summary


async def metrics_each_second(url: str, until: float):
    """`/metrics` as a dict of sample name to value every second until `until` (None for a
    scrape that got no answer)."""
    async with client_for(url, timeout=5) as client:
        while time.monotonic() < until:
            await asyncio.sleep(1.0)
            try:
                text = (await client.get("/metrics")).body.decode()
            except (NoAnswer, asyncio.TimeoutError):
                yield None
                continue
            yield metric_values(text)


def metric_values(text: str) -> dict[str, str]:
    """`/metrics`' text as a dict of sample name (with its labels) to value."""
    return dict(line.split()[:2] for line in text.splitlines() if " " in line)


async def step_thresholds(url: str) -> tuple[float, float]:
    """The server's step thresholds so far, (their sum, their count), from `/metrics`."""
    async with client_for(url, timeout=10) as client:
        text = (await client.get("/metrics")).body.decode()
    values = metric_values(text)
    return (float(values.get("dilaserve_step_threshold_sum", 0.0)),
            float(values.get("dilaserve_step_threshold_count", 0.0)))  # fmt: skip


def mean_threshold(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The mean step threshold between two `step_thresholds` (None: no step): what a served
    rate was bought with (a fuzz once left every later step at the lowest, 6efb977)."""
    steps = after[1] - before[1]
    return round((after[0] - before[0]) / steps, 3) if steps else None


async def slowdown_watch(url: str, until: float, seen: list) -> None:
    """Record the server's measured step slowdown (`/metrics`) every second."""
    async for values in metrics_each_second(url, until):
        if values and "dilaserve_step_slowdown" in values:
            seen.append(float(values["dilaserve_step_slowdown"]))


# -- faults --------------------------------------------------------------------------------


def worker_pids(server_pid: int) -> list[int]:
    """The server's worker processes (children running dilaserve.cluster.worker), oldest
    first: the first serves, since the spare rank waiting is started after the others are up."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if int(stat[1]) == server_pid and b"dilaserve.cluster.worker" in command:
            pids.append(int(entry.name))
    return sorted(pids)


async def health_watch(url: str, t0: float, until: float, seen: list) -> None:
    """Record (seconds since t0, /health status) every 0.2 s."""
    async with client_for(url, timeout=5) as client:
        while time.monotonic() < until:
            try:
                r = await client.get("/health")
                seen.append((round(time.monotonic() - t0, 2), r.json()["status"]))
            except (NoAnswer, asyncio.TimeoutError, ValueError):
                seen.append((round(time.monotonic() - t0, 2), "no answer"))
            await asyncio.sleep(0.2)


async def kill_phase(url: str, server: subprocess.Popen, rate: float, slo_ms: float, how: str):
    pid = worker_pids(server.pid)[0]
    seen: list = []
    hold = 30.0 if how == "stop" else 0.0
    fault_at: list[float] = []

    async def fault(t0):
        watch = asyncio.ensure_future(health_watch(url, t0, t0 + 35 + hold, seen))
        await asyncio.sleep(3.0)
        fault_at.append(time.perf_counter())
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        await asyncio.sleep(hold)
        if how == "stop":
            try:
                os.kill(pid, signal.SIGCONT)  # (the server has killed it for hung by now)
            except ProcessLookupError:
                pass
        await watch

    gauges: list = []
    watch = asyncio.ensure_future(gauge_watch(url, time.monotonic() + 18.0 + hold, gauges))
    records = await open_loop(url, rate, 15.0 + hold, slo_ms, seed=5, during=fault)
    await watch
    figures = fault_summary(records, seen, 3.0, fault_at[0]) | {"worker": pid}
    return figures | {"gauges_each_second": gauges}


GAUGES = ("requests_in_flight", "step_slowdown", "admission_on_time_factor", "deadline_factor",
          "instances_stalled", "queue_length", "admission_capacity",
          "admission_modelled_capacity", "admission_pace_seconds")  # fmt: skip


async def gauge_watch(url: str, until: float, seen: list) -> None:
    """Record `GAUGES` of `/metrics` every second (what admission saw around a fault)."""
    async for values in metrics_each_second(url, until):
        seen.append(None if values is None else gauge_row(values))


async def gauges_now(url: str) -> list | None:
    """`GAUGES` of `/metrics` once (None: no answer)."""
    async with client_for(url, timeout=5) as client:
        try:
            return gauge_row(metric_values((await client.get("/metrics")).body.decode()))
        except (NoAnswer, asyncio.TimeoutError):
            return None


def gauge_row(values: dict[str, str]) -> list:
    row = [values.get(f"dilaserve_{name}") for name in GAUGES]
    return [None if v is None else round(float(v), 4) for v in row]  # (the pace: ms)
