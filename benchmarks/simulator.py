"""Simulator speed: the paper-sized experiment (2-hour diurnal trace, 45,034 requests, 16 GPUs).

    python benchmarks/simulator.py [--policies dilaserve,infaas] [--minutes-per-hour 5]
                                   [--breakdown] [--cpus 1]

Runs the whole trace through the simulator for each policy, each in a fresh process pinned to
one CPU (`--cpus`), and prints wall-clock seconds, simulator events per second and simulated
request-steps per second; writes them to a run folder. The issue's target is under 3 minutes
for the 2-hour experiment on one core, for every policy.

After `make compile` the control plane's hot path runs as mypyc compiled it (the same source,
the same decisions; each record says `compiled`).

`--breakdown` also times the parts of each run (`PARTS`: disjoint, so what is left is the event
loop and the scheduler's own bookkeeping) and writes them to `breakdown.csv`; the timers slow a
run by a few percent, so its wall time is not the speed figure.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from dilaserve.control.decision_log import DecisionLog
from dilaserve.control.load_control import LoadControl
from dilaserve.control.placement import Placer
from dilaserve.control.reconfigure import Reconfigurer
from dilaserve.control.scheduler import Scheduler
from dilaserve.control.selection import ThresholdSelection
from dilaserve.request import Request
from dilaserve.runs import control_plane_compiled, markdown_table, write_records, write_table_run
from dilaserve.sim.behaviour import ParametricBehaviour
from dilaserve.sim.run import SimulationSpec, simulate

PARTS = {  # what --breakdown times: no part calls another
    "planner (monitor, Stage 1 and 2)": (Reconfigurer, "on_tick"),
    "step-predictor refreshes": (LoadControl, "refresh"),
    "load control (Alg. 2/4)": (LoadControl, "run_if_due"),
    "threshold selection (Alg. 1/5)": (ThresholdSelection, "choose"),
    "placement search (Alg. 3)": (Placer, "place"),
    "launching batches": (Scheduler, "_launch"),
    "simulated steps (behaviour model)": (ParametricBehaviour, "step"),
    "applying step results": (Request, "apply"),
    "decision log": (DecisionLog, "record"),
}


@contextlib.contextmanager
def timed_parts(totals: dict[str, list]):
    """Wrap each part's method with a timer adding to totals[part] = [seconds, calls]."""

    def timer(part, method):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                totals[part][0] += time.perf_counter() - start
                totals[part][1] += 1

        return timed

    originals = {part: getattr(cls, name) for part, (cls, name) in PARTS.items()}
    for part, (cls, name) in PARTS.items():
        totals[part] = [0.0, 0]
        setattr(cls, name, timer(part, originals[part]))
    try:
        yield
    finally:
        for part, (cls, name) in PARTS.items():
            setattr(cls, name, originals[part])


def breakdown_rows(policy: str, totals: dict[str, list], wall: float) -> list[dict]:
    rows = [
        {"policy": policy, "part": part, "seconds": round(seconds, 1)}
        | {"share": f"{seconds / wall:.1%}", "calls": calls}
        | {"us_per_call": round(1e6 * seconds / max(calls, 1), 1)}
        for part, (seconds, calls) in totals.items()
    ]
    rest = wall - sum(seconds for seconds, _ in totals.values())
    rows.append(
        {"policy": policy, "part": "everything else", "seconds": round(rest, 1)}
        | {"share": f"{rest / wall:.1%}", "calls": "", "us_per_call": ""}
    )
    return rows


def pin_to_cpus(count: int) -> list[int]:
    """Run on the first `count` CPUs this process may use (the issue's target is one core):
    the process is pinned, and OpenMP (LightGBM's predictions) is told to use as many threads,
    before LightGBM loads. HiGHS sizes its workers by the machine's cores, so while it plans its
    threads share the pinned CPUs. Returns the CPUs."""
    cpus = sorted(os.sched_getaffinity(0))[:count]
    os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    return cpus


def measure(policy: str, args) -> tuple[dict, list[dict]]:
    """One policy's run: its speed record, and its breakdown rows with `--breakdown`."""
    spec = SimulationSpec(
        policy=policy, peak_rps=args.peak_rps, minutes_per_hour=args.minutes_per_hour
    )

    def progress(now, done, total):
        if int(now) % 300 == 0:
            print(
                f"\r{policy}: simulated {now:6.0f} s, {done}/{total}",
                end="",
                file=sys.stderr,
                flush=True,
            )

    totals: dict[str, list] = {}
    with timed_parts(totals) if args.breakdown else contextlib.nullcontext():
        run = simulate(spec, progress)
    wall = run.timing["wall_seconds"]
    steps = sum(row["steps"] for row in run.rows)
    record = {
        "policy": policy,
        "requests": run.summary["requests"],
        "simulated_s": run.summary["simulated_seconds"],
        "wall_s": wall,
        "events": run.summary["events"],
        "events_per_s": run.timing["events_per_second"],
        "request_steps_per_s": round(steps / wall),
        "slo_attainment": run.summary["slo_attainment"],
        "decision_digest": run.summary["decision_digest"][:16],
        "compiled": control_plane_compiled(),
    }
    return record, breakdown_rows(policy, totals, wall) if totals else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policies", default="dilaserve,infaas")
    ap.add_argument("--peak-rps", type=float, default=14.0)
    ap.add_argument("--minutes-per-hour", type=float, default=5.0)
    ap.add_argument("--breakdown", action="store_true", help="time the parts of each run")
    ap.add_argument("--cpus", type=int, default=1, help="CPUs to run on (0: all)")
    ap.add_argument("--out", default="runs")
    args = ap.parse_args()
    print(f"control plane compiled (make compile): {control_plane_compiled()}", flush=True)
    if args.breakdown and control_plane_compiled():
        ap.error("--breakdown wraps methods, which compiled classes do not allow: make uncompile")
    if args.cpus:
        print(f"pinned to CPUs {pin_to_cpus(args.cpus)}", flush=True)
    records, breakdown = [], []
    # each policy in a fresh process (pinned and told its OpenMP threads as this one is): in
    # one process the policies after the first ran 4-11% slower than alone (docs/simulator/speed.md)
    spawn = multiprocessing.get_context("spawn")
    for policy in args.policies.split(","):
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as fresh:
            record, parts = fresh.submit(measure, policy, args).result()
        records.append(record)
        breakdown += parts
        print(f"\n{record}", flush=True)
    folder = write_table_run(args.out, "simulator", vars(args), records, "simulator speed")
    if breakdown:
        table = markdown_table(breakdown, list(breakdown[0]))
        write_records(folder / "breakdown.csv", breakdown)
        with open(folder / "report.md", "a") as report:
            report.write(f"\n## Where the time went (instrumented runs)\n\n{table}\n")
        print(table)


if __name__ == "__main__":
    main()
