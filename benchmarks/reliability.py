"""Reliability suite (issue 22): `dilaserve serve` under hostile bodies, overload and faults.

    python benchmarks/reliability.py [--fuzz 1500] [--overload-seconds 60] [--slo-ms 2000]
                                     [--slo-headroom 1.0]

Starts `dilaserve serve` (the bundled model, two TP-1 instances, on 127.0.0.1 only) in a
process group of its own and runs these phases, each bounded in time:

1. fuzz: `--fuzz` hostile bodies (wrong types, values at and past every bound, NaN, lone
   surrogates, broken JSON, deep nesting, bodies over the size limit, prompts past the
   context), 16 at a time. Every answer must be a completion or an error in OpenAI's shape, and
   never a 5xx; afterwards a normal request is served and nothing is left in flight. Then
   /health is timed while 8 clients send the largest bodies the server reads and long prompts.
2. capacity: a closed loop of 32 clients for `--capacity-seconds`: requests served per second
   at saturation (the capacity).
3. overload: Poisson arrivals at 3x that capacity for `--overload-seconds`: how fast refusals
   come (429 with Retry-After), the share of admitted requests within their SLO, requests left
   without an answer, and the served rate against the capacity.
4. kill -9 of a worker under load (half the capacity): requests that failed, and how long
   until /health says "ok" again.
5. SIGSTOP of a worker under load: the longest wait of a request, and requests that failed
   (the instance is taken for hung after the step timeout the latency profile gives).
6. SIGTERM to the server's whole process group under streaming load (what systemd and
   `timeout` send): answers after the signal (503 with Retry-After, or refused connections),
   streams that ended with `[DONE]`, and the time to exit.

The load comes from `lean_http.Pool`, a lean HTTP client: httpx's own CPU time, on the cores the
server uses, was counted as the server's latency at these rates.

This file starts the server, runs the phases in order and writes the run folder; the phases are
in `reliability_phases.py`, the load they put on the server in `reliability_load.py`, the
hostile bodies and the check of OpenAI's answer shape in `reliability_inputs.py`, and the
figures made of the records in `reliability_summaries.py`.

Writes benchmarks/results/reliability-TIMESTAMP/: config.json, summary.json (every figure),
server.log (without its access lines) and report.md. Latency figures depend on the machine's
load: the report says what else ran (the load average at start and end).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from reliability_load import closed_loop, one, pool_for
from reliability_phases import (
    fuzz,
    health_under_large_bodies,
    kill_phase,
    overload_phase,
    term_phase,
    term_streams,
)
from reliability_summaries import served_rate

from dilaserve.runs import create_run_dir, environment, write_json

ROOT = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, slo_ms: float, log: Path, headroom: float = 1.0) -> subprocess.Popen:
    command = [sys.executable, "-m", "dilaserve.cli", "serve", "--port", str(port)]
    command += ["--slo", str(slo_ms / 1000), "--drain-timeout", "5", "--log-interval", "0"]
    command += ["--slo-headroom", str(headroom)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = log.open("w")
    server = subprocess.Popen(command, env=env, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.5)
    os.killpg(server.pid, signal.SIGKILL)
    raise RuntimeError(f"the server did not come up; see {log}")


# -- the run ---------------------------------------------------------------------------------


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def run(args, folder: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    summary: dict = {"load_average_start": load_average(), "cpus": os.cpu_count()}
    server = start_server(port, args.slo_ms, folder / "server.log", args.slo_headroom)
    try:
        t = time.monotonic()
        summary["fuzz"] = await fuzz(url, args.fuzz, args.seed, t + args.fuzz_seconds)
        summary["fuzz"]["seconds"] = round(time.monotonic() - t, 1)
        health = httpx.get(f"{url}/health", timeout=10).json()
        pool = pool_for(url)
        served = await one(pool, args.slo_ms)
        await pool.close()
        summary["after_fuzz"] = {"health": health["status"], "in_flight": health["in_flight"],
                                 "normal_request": served["status"]}  # fmt: skip
        print("fuzz:", summary["fuzz"], summary["after_fuzz"], flush=True)
        summary["large_bodies"] = await health_under_large_bodies(url, 15.0)
        print("/health under large bodies:", summary["large_bodies"], flush=True)

        records = await closed_loop(url, 32, args.capacity_seconds, args.slo_ms)
        capacity = served_rate(records, args.capacity_seconds)
        summary["capacity"] = {"clients": 32, "seconds": args.capacity_seconds,
                               "served_per_s": capacity}  # fmt: skip
        print("capacity:", summary["capacity"], flush=True)

        summary["overload"] = await overload_phase(url, 3 * capacity, capacity, args)
        print("overload:", summary["overload"], flush=True)

        await asyncio.sleep(3)
        summary["kill_9"] = await kill_phase(url, server, capacity / 2, args.slo_ms, "kill")
        print("kill -9:", summary["kill_9"], flush=True)
        summary["sigstop"] = await kill_phase(url, server, capacity / 2, args.slo_ms, "stop")
        print("SIGSTOP:", summary["sigstop"], flush=True)
        summary["sigterm"] = await term_phase(url, server, capacity / 2, args.slo_ms)
        print("SIGTERM:", summary["sigterm"], flush=True)

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(port, args.slo_ms, folder / "server-2.log", args.slo_headroom)
        summary["sigterm_streams"] = await term_streams(url, server, args.slo_ms)
        print("SIGTERM, streams:", summary["sigterm_streams"], flush=True)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    summary["load_average_end"] = load_average()
    for log in folder.glob("server*.log"):
        drop_access_lines(log)
    return summary


def drop_access_lines(log: Path) -> None:
    """Keep the server's own log lines, not one access line per request."""
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(line for line in lines if ' HTTP/1.1" ' not in line))


def report(summary: dict, args) -> str:
    o, f = summary["overload"], summary["fuzz"]
    lines = [
        "# Reliability suite",
        "",
        f"Command: `python benchmarks/reliability.py --fuzz {args.fuzz} --overload-seconds "
        f"{args.overload_seconds} --slo-ms {args.slo_ms} --slo-headroom {args.slo_headroom}`; "
        f"load average "
        f"{summary['load_average_start']} at start, {summary['load_average_end']} at end "
        f"({summary['cpus']} CPUs).",
        "",
        f"- fuzz: {f['bodies']} hostile bodies, statuses {f['statuses']}; answers not in OpenAI's "
        f"shape or 5xx: {f['bad']}; after: {summary['after_fuzz']}",
        f"- /health under the largest bodies: {summary['large_bodies']}",
        f"- capacity: {summary['capacity']['served_per_s']} requests/s served (32 clients)",
        f"- overload at {o['rate_per_s']}/s for {o['seconds']} s: {o['refused_429']} refused "
        f"(p50 {o['refusal_latency_p50_s']} s, p99 {o['refusal_latency_p99_s']} s; "
        f"{o['refusals_with_retry_after']} with Retry-After), {o['served']} served "
        f"({o['served_within_slo']:.1%} within SLO as the client counts, "
        f"{o['served_within_slo_server']:.1%} as the server does), "
        f"{o['without_answer']} without an answer, "
        f"{o['served_per_s']}/s served vs {o['capacity_per_s']}/s at capacity",
        f"- kill -9 of a worker: {summary['kill_9']}",
        f"- SIGSTOP of a worker (30 s): {summary['sigstop']}",
        f"- SIGTERM to the process group under load: {summary['sigterm']}",
        f"- SIGTERM with 8 streams open: {summary['sigterm_streams']}",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fuzz", type=int, default=1500, help="hostile bodies")
    parser.add_argument("--fuzz-seconds", type=float, default=300, help="the fuzz's time bound")
    parser.add_argument("--capacity-seconds", type=float, default=20)
    parser.add_argument("--overload-seconds", type=float, default=60)
    parser.add_argument("--slo-ms", type=float, default=2000)
    parser.add_argument(
        "--slo-headroom",
        type=float,
        default=1.0,
        help="serve's --slo-headroom (1.0: the paper's threshold selection)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args()
    folder = create_run_dir(args.out, "reliability")
    write_json(folder / "config.json", {"args": vars(args), "environment": environment()})
    summary = asyncio.run(run(args, folder))
    write_json(folder / "summary.json", summary)
    (folder / "report.md").write_text(report(summary, args))
    print(f"run folder: {folder}")


if __name__ == "__main__":
    main()
