"""Reliability suite (issues 22 and 38): `dilaserve serve` under hostile bodies and clients,
overload, storms, a CPU-hungry neighbour and faults, judged against issue 38's targets.

    python benchmarks/reliability.py [--fuzz 1500] [--overload-seconds 60] [--slo-ms 2000]
                                     [--storm-clients 400] [--drain-timeout 2] [--beside-hog]
                                     [--worker-nice N] [--planner-period S]

Starts `dilaserve serve` (the bundled model, two TP-1 instances, on 127.0.0.1 only) in a
process group of its own and runs these phases, each bounded in time:

1. fuzz: `--fuzz` hostile bodies (wrong types, values at and past every bound, NaN, lone
   surrogates, broken JSON, deep nesting, bodies over the size limit, prompts past the
   context), 16 at a time. Every answer must be a completion or an error in OpenAI's shape, and
   never a 5xx; afterwards a normal request is served and nothing is left in flight. Then
   /health is timed while 8 clients send the largest bodies the server reads and long prompts,
   while 4 clients send headers growing to 64 MB, and while 8 clients send chats of 25,000
   empty messages (the server's resident memory alongside).
2. capacity: a closed loop of 32 clients, then of 128, each for `--capacity-seconds`: the most
   requests served per second of the two (the capacity). 32 alone measured the rate at 32 in
   flight: under 3x overload the server then served up to 1.3x it (docs/serving/reliability.md).
   Each with the mean step threshold it ran at (`/metrics`): a rate bought at the lowest
   threshold shows (after the fuzz, 32 clients once ran at 0.700: fixed in 6efb977).
3. overload: Poisson arrivals at 3x that capacity for `--overload-seconds`: how fast refusals
   come (429 with Retry-After), the share of admitted requests within their SLO, requests left
   without an answer, and the served rate against the capacity, at its mean step threshold.
4. closed loop: `--storm-clients` closed-loop clients for `--storm-seconds`, each waiting
   after a refusal as long as OpenAI's client does (`retry-after-ms`, jittered by the server,
   else Retry-After), the same figures and admission's gauges at the start and each second;
   then a storm: the same clients waiting only 50 ms after a refusal (the same figures,
   judged only by what follows).
5. neighbour: half the capacity, open loop, beside a CPU hog on every core.
6. kill -9, then SIGSTOP, of a worker under load (half the capacity): requests that failed (a
   429 after the fault counts as failed), the longest wait, and how long until /health says
   "ok" again.
   After the overload, the storm, the neighbour and each fault, once nothing is in flight: 25
   requests one at a time, every one of which an idle server must admit.
7. drain at capacity: SIGTERM to the server's process group under `--storm-clients` clients:
   every request sent after it must get 503 with Retry-After and `Connection: close`, and the
   server must exit within `--drain-timeout` plus one second.
8. streams longer than the drain (a fresh server): SIGTERM with 16 long streams open; each must
   end with `[DONE]`, and the exit within the drain timeout plus one second.

`--beside-hog` runs all of it beside a CPU hog on every core (a busy machine); `--worker-nice N`
passes serve's option (the workers' CPU priority against the front); `--planner-period S` too
(a planner round within a fault phase: serve's default puts the first 300 s after the start).

The load comes from the load client of `dilaserve bench` (`dilaserve/bench/client.py`, aiohttp),
which sends every request once: a connection the server closes unanswered is a failed request.

This file starts the server, runs the phases in order, judges the targets and writes the run
folder; the phases are in `reliability_phases.py` and `reliability_hostile.py`, the load they
put on the server in `reliability_load.py`, the hostile bodies and the check of OpenAI's answer
shape in `reliability_inputs.py`, and the figures made of the records in
`reliability_summaries.py`.

Writes runs/reliability-TIMESTAMP/ (an ignored folder): config.json, summary.json
(every figure and the verdict of each target), server.log (without its access lines) and
report.md. Latency figures depend on the machine's load: the report says what else ran (the load
average at start and end).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from reliability_hostile import (
    CpuHog,
    drain_at_capacity,
    health_while,
    huge_header,
    idle_admits,
    many_message_chat,
    neighbour,
    storm,
    streams_past_the_drain,
)
from reliability_load import client_floor, client_for, closed_loop, one
from reliability_phases import (
    fuzz,
    health_under_large_bodies,
    kill_phase,
    mean_threshold,
    overload_phase,
    step_thresholds,
)
from reliability_summaries import served_rate
from reliability_targets import report, verdicts

from dilaserve.runs import create_run_dir, environment, write_json

ROOT = Path(__file__).resolve().parent
CASES = ("hostile", "overload", "closed_loop", "storm", "neighbour", "kill_9", "sigstop", "drain",
         "streams")  # fmt: skip
CAPACITY_CLIENTS = (32, 128)  # closed loops whose best served rate is the capacity
SERVE_OPTIONS = ("worker_nice", "planner_period", "admission_time", "admission_wait",
                 "quality_budget")  # serve's, passed on when given  # fmt: skip
LOADED = ("overload", "closed_loop", "storm", "neighbour", "kill_9", "sigstop")  # need capacity


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, args, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "dilaserve.cli", "serve", "--port", str(port)]
    command += ["--slo", str(args.slo_ms / 1000), "--drain-timeout", str(args.drain_timeout)]
    command += ["--slo-headroom", str(args.slo_headroom)]  # (serve's log lines: 429s counted)
    for name in SERVE_OPTIONS:  # (given: passed on; else serve's default)
        if getattr(args, name) is not None:
            command += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = log.open("w")
    server = subprocess.Popen(command, env=env, stdout=out, stderr=out, start_new_session=True)
    return healthy(server, port, f"the server did not come up; see {log}")


def healthy(server: subprocess.Popen, port: int, failure: str) -> subprocess.Popen:
    """`server` once its `/health` answers 200 (within 5 minutes; else it is killed and
    `failure` raised)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.5)
    os.killpg(server.pid, signal.SIGKILL)
    raise RuntimeError(failure)


# -- the run ---------------------------------------------------------------------------------


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


TICK = os.sysconf("SC_CLK_TCK")  # /proc's CPU times are in these


def cpu_seconds(session: int) -> dict[str, float]:
    """CPU seconds used so far by this process (the load client, every thread) and by the
    server's session: its leader (the front) and the rest (its workers)."""
    used = {"client": sum(os.times()[:2]), "front": 0.0, "workers": 0.0}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # (from the state on)
        except OSError:
            continue  # (ended meanwhile)
        if int(fields[3]) == session:
            part = "front" if int(stat.parent.name) == session else "workers"
            used[part] += (int(fields[11]) + int(fields[12])) / TICK  # utime + stime
    return used


class Run:
    """The phases in order against one server after another, each phase's summary kept and
    printed as it ends."""

    def __init__(self, args, folder: Path):
        self.args, self.folder = args, folder
        self.summary: dict = {"load_average_start": load_average(), "cpus": os.cpu_count()}
        self.servers = 0
        self.server, self.url = None, ""

    def start(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = self.folder / f"server-{self.servers}.log"
        self.server = start_server(port, self.args, log)
        self.servers += 1

    def keep(self, name: str, figures: dict) -> None:
        self.summary[name] = figures
        print(f"{name}:", figures, flush=True)

    async def idle(self, after: str) -> None:
        self.summary.setdefault("idle_after", []).append(
            await idle_admits(self.url, self.args.slo_ms, after)
        )
        print("idle after", after, self.summary["idle_after"][-1], flush=True)

    async def hostile(self) -> None:
        args, url = self.args, self.url
        t = time.monotonic()
        figures = await fuzz(url, args.fuzz, args.seed, t + args.fuzz_seconds)
        self.keep("fuzz", figures | {"seconds": round(time.monotonic() - t, 1)})
        health = httpx.get(f"{url}/health", timeout=10).json()
        async with client_for(url) as client:
            served = await one(client, args.slo_ms)
        self.keep("after_fuzz", {"health": health["status"], "in_flight": health["in_flight"],
                                 "normal_request": served["status"]})  # fmt: skip
        self.keep("large_bodies", await health_under_large_bodies(url, 15.0))
        pid = self.server.pid
        self.keep("header_flood", await health_while(url, pid, huge_header, 4, 15.0))
        self.keep("many_message_chats", await health_while(url, pid, many_message_chat, 8, 15.0))

    async def cores_used(self, phase) -> tuple:
        """What `phase` returns, and the cores each part used on average while it ran (what
        the load client took of a 2-core machine, the workers could not)."""
        before, started = cpu_seconds(self.server.pid), time.monotonic()
        result = await phase
        after, seconds = cpu_seconds(self.server.pid), time.monotonic() - started
        return result, {part: round((after[part] - before[part]) / seconds, 2) for part in after}

    async def with_cores(self, phase) -> dict:
        """`phase`'s figures, with the cores each part used while it ran (`cores_used`)."""
        figures, cores = await self.cores_used(phase)
        return figures | {"cores_used": cores}

    def wants(self, *cases: str) -> bool:
        return any(case in self.args.cases for case in cases)

    async def measure_capacity(self) -> float:
        args = self.args
        if args.capacity is not None:
            return args.capacity
        served, thresholds, cores = {}, {}, {}
        for clients in CAPACITY_CLIENTS:
            before = await step_thresholds(self.url)
            loop = closed_loop(self.url, clients, args.capacity_seconds, args.slo_ms)
            records, cores[clients] = await self.cores_used(loop)
            served[clients] = served_rate(records, args.capacity_seconds)
            thresholds[clients] = mean_threshold(before, await step_thresholds(self.url))
        capacity = max(served.values())
        figures = {"seconds": args.capacity_seconds, "served_per_s": served, "cores_used": cores}
        self.keep("capacity", figures | {"mean_threshold": thresholds, "capacity_per_s": capacity})
        return capacity

    async def load(self, capacity: float) -> None:
        args, url = self.args, self.url
        if self.wants("overload"):
            phase = overload_phase(url, 3 * capacity, capacity, args)
            self.keep("overload", await self.with_cores(phase))
            await self.idle("overload")
        clients, seconds = args.storm_clients, args.storm_seconds
        if self.wants("closed_loop"):
            phase = storm(url, clients, seconds, capacity, args.slo_ms, polite=True)
            figures = await self.with_cores(phase)
            figures["client_floor"] = await client_floor(clients, args.slo_ms)
            self.keep("closed_loop", figures)
        if self.wants("storm"):
            phase = storm(url, clients, seconds, capacity, args.slo_ms, False)
            self.keep("storm", await self.with_cores(phase))
            await self.idle("storm")
        if self.wants("neighbour"):
            self.keep("neighbour", await neighbour(url, capacity / 2, 20.0, args.slo_ms))
            await self.idle("neighbour")

    async def faults(self, capacity: float) -> None:
        rate, slo_ms = capacity / 2, self.args.slo_ms
        for case, how, after in (("kill_9", "kill", "kill -9"), ("sigstop", "stop", "SIGSTOP")):
            if self.wants(case):
                before = len(self.restored())
                figures = await kill_phase(self.url, self.server, rate, slo_ms, how)
                self.keep(case, figures | {"capacity_restored_after_s": self.restored()[before:]})
                await self.idle(after)

    def restored(self) -> list[float]:
        """Seconds each lost instance took to be replaced, as the server logged them."""
        log = (self.folder / f"server-{self.servers - 1}.log").read_text(errors="replace")
        return [float(m) for m in re.findall(r"lost capacity restored after ([0-9.]+) s", log)]

    async def drains(self) -> None:
        args = self.args
        if self.wants("drain"):
            figures = await drain_at_capacity(
                self.url, self.server, args.storm_clients, args.slo_ms, args.drain_timeout
            )
            self.keep("drain_at_capacity", figures)
        if self.wants("streams"):
            if self.server.poll() is None:
                os.killpg(self.server.pid, signal.SIGKILL)
            self.start()
            figures = await streams_past_the_drain(
                self.url, self.server, 16, args.slo_ms, args.drain_timeout
            )
            self.keep("streams_past_the_drain", figures)

    async def run(self) -> dict:
        self.start()
        try:
            if self.wants("hostile"):
                await self.hostile()
            if self.wants(*LOADED):
                capacity = await self.measure_capacity()
                await self.load(capacity)
                await self.faults(capacity)
            await self.drains()
        finally:
            if self.server.poll() is None:
                os.killpg(self.server.pid, signal.SIGKILL)
        self.summary["load_average_end"] = load_average()
        for log in self.folder.glob("server*.log"):
            drop_access_lines(log)
        return self.summary


def drop_access_lines(log: Path) -> None:
    """Keep the server's own log lines, not one access line per request."""
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(line for line in lines if ' HTTP/1.1" ' not in line))


def cases_list(text: str) -> tuple[str, ...]:
    """`--cases`: names of `CASES`, comma-separated."""
    cases = tuple(c.strip() for c in text.split(",") if c.strip())
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise argparse.ArgumentTypeError(f"unknown cases {unknown}; choose from {','.join(CASES)}")
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fuzz", type=int, default=1500, help="hostile bodies")
    parser.add_argument("--fuzz-seconds", type=float, default=300, help="the fuzz's time bound")
    parser.add_argument("--capacity-seconds", type=float, default=20)
    parser.add_argument("--overload-seconds", type=float, default=60)
    parser.add_argument("--storm-clients", type=int, default=400)
    parser.add_argument("--storm-seconds", type=float, default=30)
    parser.add_argument("--drain-timeout", type=float, default=2.0, help="serve's")
    parser.add_argument("--slo-ms", type=float, default=2000)
    parser.add_argument(
        "--slo-headroom",
        type=float,
        default=1.0,
        help="serve's --slo-headroom (1.0: the paper's threshold selection)",
    )
    parser.add_argument(
        "--beside-hog", action="store_true", help="run beside a CPU hog on every core"
    )
    parser.add_argument("--worker-nice", type=int, metavar="N", help="serve's (default: its)")
    parser.add_argument("--planner-period", type=float, metavar="S", help="serve's (default: its)")
    parser.add_argument(
        "--admission-time", choices=["batched", "queue"], help="serve's (default: its)"
    )
    parser.add_argument("--admission-wait", type=float, metavar="S", help="serve's (default: its)")
    parser.add_argument(
        "--quality-budget", type=float, metavar="LOSS", help="serve's (default: its; 1: none)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cases",
        type=cases_list,
        default=CASES,
        help=f"comma-separated, of {','.join(CASES)} (default: all, in that order)",
    )
    parser.add_argument(
        "--capacity",
        type=float,
        metavar="PER_S",
        help="take the capacity as given rather than measure it (32 closed-loop clients)",
    )
    parser.add_argument("--out", default=str(ROOT.parent / "runs"), help="(an ignored folder)")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    folder = create_run_dir(args.out, "reliability")
    write_json(folder / "config.json", {"args": vars(args), "environment": environment()})
    if args.beside_hog:
        with CpuHog():
            summary = asyncio.run(Run(args, folder).run())
    else:
        summary = asyncio.run(Run(args, folder).run())
    summary["verdicts"] = verdicts(summary, args)
    write_json(folder / "summary.json", summary)
    (folder / "report.md").write_text(report(summary, args))
    for v in summary["verdicts"]:
        print(f"{'met' if v['met'] else 'NOT MET'}: {v['target']}: {v['measured']}")
    print(f"run folder: {folder}")


if __name__ == "__main__":
    main()
