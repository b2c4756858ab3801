"""Simulator speed: the paper-sized experiment (2-hour diurnal trace, ~64k requests, 16 GPUs).

    python benchmarks/simulator.py [--policies dilaserve,infaas] [--minutes-per-hour 5]

Runs the whole trace through the simulator (one core) for each policy and prints wall-clock
seconds, simulator events per second and simulated request-steps per second; writes them to a
run folder. The issue's target is under 3 minutes for the 2-hour, ~64k-request experiment.
"""

from __future__ import annotations

import argparse
import sys

from dilaserve.runs import write_table_run
from dilaserve.sim.run import SimulationSpec, simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policies", default="dilaserve,infaas")
    ap.add_argument("--peak-rps", type=float, default=14.0)
    ap.add_argument("--minutes-per-hour", type=float, default=5.0)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    records = []
    for policy in args.policies.split(","):
        spec = SimulationSpec(
            policy=policy, peak_rps=args.peak_rps, minutes_per_hour=args.minutes_per_hour
        )

        def progress(now, done, total, policy=policy):
            if int(now) % 300 == 0:
                print(
                    f"\r{policy}: simulated {now:6.0f} s, {done}/{total}",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )

        run = simulate(spec, progress)
        steps = sum(row["steps"] for row in run.rows)
        records.append(
            {
                "policy": policy,
                "requests": run.summary["requests"],
                "simulated_s": run.summary["simulated_seconds"],
                "wall_s": run.timing["wall_seconds"],
                "events": run.summary["events"],
                "events_per_s": run.timing["events_per_second"],
                "request_steps_per_s": round(steps / run.timing["wall_seconds"]),
                "slo_attainment": run.summary["slo_attainment"],
            }
        )
        print(f"\n{records[-1]}", flush=True)
    write_table_run(args.out, "simulator", vars(args), records, "simulator speed")


if __name__ == "__main__":
    main()
