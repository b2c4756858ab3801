"""The cluster runtime's controller overhead per step, beside the step time itself.

    python benchmarks/cluster.py [--rates 2,6,12] [--seconds 20] [--layout 1,1]

For each Poisson arrival rate, replays bundled-task problems against an in-process cluster
(local worker processes, bundled model, policy dilaserve) and reports, per step: the engine's
time measured inside the worker, the round trip the controller sees (launch to completion
event), and their difference, the controller's overhead (pickling, the pipe, the event loop,
waiting for a core). Also SLO attainment and accuracy. Writes a run folder.
"""

from __future__ import annotations

import argparse

from dilaserve.cluster.runtime import ClusterConfig
from dilaserve.cluster.trace_run import TraceRunSpec, run_trace
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.runs import write_table_run

COLUMNS = (
    "requests",
    "steps_run",
    "step_engine_ms_mean",
    "step_round_trip_ms_mean",
    "controller_overhead_ms_mean",
    "controller_overhead_ms_p99",
    "slo_attainment",
    "latency_p50",
    "accuracy",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="2,6,12")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--layout", default="1,1", help="TP degree of each instance")
    parser.add_argument("--slo", type=float, default=1.0)
    parser.add_argument("--out", default="runs")
    args = parser.parse_args()
    config = ClusterConfig(
        worker=WorkerConfig(threads=1),
        instances=tuple(int(t) for t in args.layout.split(",")),
    )
    records = []
    for rate in (float(r) for r in args.rates.split(",")):
        spec = TraceRunSpec(f"poisson:{rate}:{args.seconds}", slo=args.slo)
        summary = run_trace(config, spec)["summary"]
        records.append({"rps": rate, **{c: summary[c] for c in COLUMNS}})
    write_table_run(args.out, "cluster", vars(args), records, "cluster step round trip")


if __name__ == "__main__":
    main()
