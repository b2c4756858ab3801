"""The 400 closed-loop clients' refusal tail, alternated across checkouts (issue 38).

    python benchmarks/refusal_tail.py [--pairs 4] [--beside-hog] CHECKOUT [CHECKOUT ...]

For each pair, each checkout in turn: `dilaserve serve` from that checkout (bundled model, two
TP-1 instances, SLO 2 s, as `reliability.py` starts it), `--pre-rate` Poisson arrivals for
`--pre-seconds` (the suite's overload before its closed loop: admission's estimates learnt under
load), `--pause` seconds, then `--clients` closed-loop clients waiting after a refusal as
OpenAI's client does, for `--seconds`. One line per run: the refusals, how many were answered
over 100 ms after they were sent (in the first second), their p99, the requests served, the
share on time, and the first two seconds' served and share on time.

On this 2-core machine the suite's refusal p99 over one run moves by tens of milliseconds from
run to run; what tells a change is the same measure over alternated runs of both checkouts
(docs/serving/reliability.md, "where the refusals over 100 ms waited")."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from reliability import free_port, healthy
from reliability_hostile import CpuHog
from reliability_load import closed_loop, open_loop
from reliability_summaries import answer_latencies, percentile

SLOW = 0.1  # seconds: issue 38's bound on a refusal's p99


def serve(checkout: Path, port: int, slo_ms: float) -> subprocess.Popen:
    """`dilaserve serve` from `checkout` (its package first on the path), once healthy."""
    command = [sys.executable, "-m", "dilaserve.cli", "serve", "--port", str(port)]
    command += ["--slo", str(slo_ms / 1000), "--drain-timeout", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(checkout)}
    server = subprocess.Popen(
        command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    return healthy(server, port, f"the server from {checkout} did not come up")


async def load(url: str, args) -> list[dict]:
    if args.pre_seconds > 0:
        await open_loop(url, args.pre_rate, args.pre_seconds, args.slo_ms, 1)
    await asyncio.sleep(args.pause)
    return await closed_loop(url, args.clients, args.seconds, args.slo_ms, polite=True)


def line(records: list[dict]) -> str:
    t0 = min(r["sent"] for r in records)
    refused = [r for r in records if r["status"] == 429]
    slow = [r for r in refused if r["answer_latency"] > SLOW]
    first = sum(r["sent"] - t0 < 1.0 for r in slow)
    served = [r for r in records if r["status"] == 200]
    early = [r for r in served if r["sent"] - t0 < 2.0]
    p99 = percentile(answer_latencies(refused), 0.99) or 0.0
    return (
        f"refused {len(refused)} >100ms {len(slow)} (first s {first}) p99 {p99:.3f} | "
        f"served {len(served)} on time {on_time(served):.3f} | first 2 s: served "
        f"{len(early)} on time {on_time(early):.2f}"
    )


def on_time(served: list[dict]) -> float:
    return sum(r["within_slo"] for r in served) / len(served) if served else 1.0


def run(checkout: Path, args) -> str:
    port = free_port()
    server = serve(checkout, port, args.slo_ms)
    try:
        return line(asyncio.run(load(f"http://127.0.0.1:{port}", args)))
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkouts", nargs="+", type=Path, help="folders holding dilaserve/")
    parser.add_argument("--pairs", type=int, default=4, help="rounds over the checkouts")
    parser.add_argument("--clients", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--pre-rate", type=float, default=390.0, help="arrivals per second")
    parser.add_argument("--pre-seconds", type=float, default=5.0, help="0: none")
    parser.add_argument("--pause", type=float, default=3.0)
    parser.add_argument("--slo-ms", type=float, default=2000.0)
    parser.add_argument("--beside-hog", action="store_true", help="a CPU hog on every core")
    args = parser.parse_args()
    checkouts = [c.resolve() for c in args.checkouts]
    with CpuHog() if args.beside_hog else contextlib.nullcontext():
        for _ in range(args.pairs):
            for checkout in checkouts:
                print(f"{time.strftime('%H:%M:%S')} {checkout}: {run(checkout, args)}", flush=True)


if __name__ == "__main__":
    main()
