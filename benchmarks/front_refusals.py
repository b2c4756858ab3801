"""What a capacity refusal costs the HTTP front: the server process's CPU per 429.

    python benchmarks/front_refusals.py [--closed-seconds 10] [--rate 600] [--seconds 10]

Serves `create_app`'s app with `server_config` (the protocol and limits `dilaserve serve` runs
with) in a child process, over a stand-in cluster whose room refuses every request, so that no
model runs and every generation request is answered 429 by the front. Then, from this process
(`dilaserve bench`'s client, aiohttp): 50 closed-loop clients for `--closed-seconds`, on
kept-alive connections (many requests per wake of the server's event loop), and Poisson
arrivals at `--rate` for `--seconds` (about one a wake, as under 3x overload). Prints the
server's CPU (user + system, from /proc) per request of each, and the refusals' latency p99.

To measure other code, run this from its checkout with `PYTHONPATH` set to it (the child
imports `dilaserve` from there). Measured in docs/serving/reliability.md ("Refusals below the
app").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from reliability_load import closed_loop, open_loop  # noqa: E402

SERVER = """
import sys
import uvicorn
from dilaserve.server.app import ServerSettings, create_app
from dilaserve.server.main import server_config
from dilaserve.server.metrics import ServerMetrics

class Entry:
    counted = False
    def leave(self):
        pass

class Full:
    "A cluster whose room refuses every request."
    accepting = True
    def is_full(self, *asks):
        return True
    def enter(self):
        return Entry()

settings = ServerSettings("tiny-llada")
app = create_app(Full(), settings, ServerMetrics(), manage=False)
config = server_config(app, settings, port=int(sys.argv[1]), lifespan="off", log_level="warning")
uvicorn.Server(config).run()
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured(server: subprocess.Popen, run) -> tuple[float, list]:
    """(server CPU seconds, `run()`'s result)."""
    before = cpu_seconds(server.pid)
    result = run()
    return cpu_seconds(server.pid) - before, result


def figures(spent: float, records: list[dict]) -> dict:
    """The requests, the refused, the server's CPU per request and the latency p99."""
    latencies = sorted(r["latency"] for r in records)
    return {"requests": len(records), "refused": sum(r["status"] == 429 for r in records),
            "server_cpu_us_per_request": round(1e6 * spent / len(records), 1),
            "latency_p99_ms": round(1000 * latencies[int(0.99 * len(latencies))], 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--closed-seconds", type=float, default=10.0, help="closed loop's")
    parser.add_argument("--rate", type=float, default=600.0, help="open loop's, per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="open loop's")
    parser.add_argument("--port", type=int, default=18_890)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(args.port)], start_new_session=True
    )
    try:
        for _ in range(200):
            try:
                httpx.get(f"{url}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        asyncio.run(closed_loop(url, 50, 1, 2000))  # warm-up
        loop = closed_loop(url, 50, args.closed_seconds, 2000)
        closed = figures(*measured(server, lambda: asyncio.run(loop)))
        loop = open_loop(url, args.rate, args.seconds, 2000, seed=0)
        opened = figures(*measured(server, lambda: asyncio.run(loop)))
    finally:
        os.killpg(server.pid, signal.SIGKILL)
    print(json.dumps({"closed_loop_50": closed, f"open_loop_{args.rate:g}_per_s": opened}))


if __name__ == "__main__":
    main()
