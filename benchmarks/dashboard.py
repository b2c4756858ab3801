"""The dashboard at 1,000 requests in flight: is the page's data still quick to get?

    python benchmarks/dashboard.py [--requests 1000] [--seconds 30] [--layout 1,1]

Starts `dilaserve serve` (bundled model, local instances, requests over capacity deprioritized
rather than refused, so that they stay in flight) on a free loopback port, opens
`--requests` chat requests at once (each holding its connection), and while they are in flight
asks for `/dashboard/data` and, as a baseline for the event loop, `/health` every 0.5 s for
`--seconds`; where Chromium is installed, it also opens `/dashboard` headless and lets the page
poll three times. Then the clients go away (their requests are cancelled) and the server stops.
Prints and writes (run folder under runs/) the latency of each kind of request,
the size of the data and the requests in flight it reported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from dilaserve.bench.client import Answer, LoadClient, NoAnswer
from dilaserve.runs import create_run_dir, environment, markdown_table, write_json, write_records
from dilaserve.tasks import arith

RESULTS = Path(__file__).resolve().parents[1] / "runs"
POLL_SECONDS = 0.5
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, args) -> subprocess.Popen:
    command = [sys.executable, "-m", "dilaserve.cli", "serve", "--port", str(port)]
    command += ["--layout", args.layout, "--max-in-flight", str(args.requests + 100)]
    command += ["--log-interval", "0", "--drain-timeout", "1", "--overload", "deprioritize"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"the server did not come up: {server.stderr.read().decode()[-2000:]}")


async def hold_requests(client: LoadClient, count: int) -> list:
    """`count` chat requests, all at once; they are cancelled when the client closes."""
    questions = [p.question for p in arith.generate(50, seed=5, split="test")]

    async def ask(k: int):
        body = {"model": "tiny-llada", "messages": [{"role": "user", "content": questions[k % 50]}]}
        try:
            return (await client.post("/v1/chat/completions", body)).status
        except (NoAnswer, asyncio.TimeoutError) as e:
            return type(e).__name__

    return [asyncio.create_task(ask(k)) for k in range(count)]


async def timed_get(client: LoadClient, path: str) -> tuple[float, Answer]:
    start = time.perf_counter()
    response = await client.get(path)
    return time.perf_counter() - start, response


async def poll(base: str, args) -> tuple[list[dict], float | None]:
    async with (
        LoadClient(base, timeout=600, max_connections=args.requests + 10) as load,
        LoadClient(base, timeout=60) as probe,
    ):
        tasks = await hold_requests(load, args.requests)
        rows, start = [], time.monotonic()
        while time.monotonic() - start < args.seconds:
            data_s, data = await timed_get(probe, "/dashboard/data")
            health_s, _ = await timed_get(probe, "/health")
            body = data.json()
            rows.append(
                {
                    "t": round(time.monotonic() - start, 2),
                    "in_flight": body["current"]["in_flight"],
                    "data_ms": round(1000 * data_s, 2),
                    "data_bytes": len(data.body),
                    "health_ms": round(1000 * health_s, 2),
                    "finished": body["totals"]["finished"],
                }
            )
            print(rows[-1], flush=True)
            await asyncio.sleep(POLL_SECONDS)
        page_s = await asyncio.to_thread(open_in_chromium, f"{base}/dashboard")
        done = [t.result() for t in tasks if t.done() and not t.cancelled()]
        print("answered before the end:", dict(Counter(map(str, done))))
        for task in tasks:
            task.cancel()
    return rows, page_s


def open_in_chromium(url: str) -> float | None:
    """Wall seconds for headless Chromium to load the page and poll three times (None: no
    Chromium here)."""
    chromium = shutil.which("chromium")
    if chromium is None:
        return None
    with tempfile.TemporaryDirectory() as profile:
        command = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
        command += ["--virtual-time-budget=6000", "--dump-dom", url]
        start = time.perf_counter()
        dom = subprocess.run(command, capture_output=True, text=True, timeout=300).stdout
        seconds = time.perf_counter() - start
    refreshed = 'data-refreshes="' in dom and 'data-refreshes="0"' not in dom
    return round(seconds, 2) if refreshed else None


def summarize(rows: list[dict], page_s: float | None) -> dict:
    loaded = [r for r in rows if r["in_flight"] >= 0.9 * max(r["in_flight"] for r in rows)]

    def pct(key: str, q: float) -> float:
        return round(float(np.percentile([r[key] for r in loaded], q)), 2)

    return {
        "polls": len(rows),
        "polls_near_peak_in_flight": len(loaded),
        "peak_in_flight": max(r["in_flight"] for r in rows),
        "data_ms_p50": pct("data_ms", 50),
        "data_ms_p90": pct("data_ms", 90),
        "data_ms_max": pct("data_ms", 100),
        "health_ms_p50": pct("health_ms", 50),
        "health_ms_max": pct("health_ms", 100),
        "data_kib_max": round(max(r["data_bytes"] for r in rows) / 1024, 1),
        "chromium_page_and_3_polls_s": page_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--layout", default="1,1")
    args = parser.parse_args()
    port = free_port()
    server = start_server(port, args)
    try:
        rows, page_s = asyncio.run(poll(f"http://127.0.0.1:{port}", args))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    summary = summarize(rows, page_s)
    folder = create_run_dir(RESULTS, "dashboard")
    write_json(folder / "config.json", {**vars(args), "environment": environment()})
    write_records(folder / "records.csv", rows)
    write_json(folder / "summary.json", summary)
    table = markdown_table([summary], list(summary))
    (folder / "report.md").write_text(f"# dashboard at {args.requests} in flight\n\n{table}\n")
    print(table)
    print(f"run folder: {os.path.relpath(folder)}")


if __name__ == "__main__":
    main()
