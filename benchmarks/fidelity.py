"""Predictive fidelity: the simulator's prediction of live cluster runs, from its own models.

    python benchmarks/fidelity.py [--rates 30,50,80] [--policies dilaserve,fcfs] [--seconds 40]
        [--slo 0.3] [--instances 2] [--calibration-rate run] [--calibration-seconds 20]

For each policy and Poisson rate, `run-trace`'s load (bundled model, held-out problems, every
request with the same SLO) runs on an in-process cluster of local workers, and the simulator
predicts the same arrivals from the latency profile, the bundled model's recorded trajectories
of other prompts and the step predictor (`sim/run_prediction.py`), with no replayed outcome or
duration. `--profile`: a profile measured now (`dilaserve profile`), for both the live control
plane and the prediction (the bundled calibration's was measured on another day).

The profile is measured with one instance on a quiet machine; serving, the two workers share
the host's cores with the controller, and the machine drifts. So before each predicted run the
policy runs once more at the same rate on other arrivals (a run that is not predicted), and its
steps' measured slowdown over the profile (`step_time_ratio`) is the prediction's
`step_slowdown`: the slowdown grows with the load (the controller's share of the cores), and
the machine drifts less over 20 s than over a whole sweep. `--calibration-rate 40`: one
calibration per policy at that rate instead (the method of the runs before 2026-12-02 15:00).
`--by-batch`: the calibration's slowdown per batch size (`step_time_ratio_by_batch`: the
steps of 1, 2-3, 4-7, ... requests), which grows with the batch on this host.
Each row also gives the prediction at the slowdown the run itself measured (`_at_run_speed`):
what is left there is the models' error, the rest the host's drift since the calibration run.
Targets
(issue 23 item 7): SLO attainment within 5 points and mean latency within 10% of the real run.
Writes a run folder with one row per run.
"""

from __future__ import annotations

import argparse

from dilaserve.cli_serving import run_trace_config
from dilaserve.config import BUNDLED_CALIBRATION, BUNDLED_PREDICTOR
from dilaserve.runs import write_table_run


def settings(policy: str, args) -> dict:
    """`run-trace`'s settings for one policy's runs."""
    out = {"policy": policy, "instances": args.instances, "slo": args.slo, "max_tokens": 64}
    if args.profile:  # measured now (`dilaserve profile`), for the live run and the prediction
        out |= {"profile": args.profile, "predictor": str(BUNDLED_PREDICTOR)}
    return out


def calibrate(config, args, rate: float) -> tuple[float, dict[int, float] | None]:
    """The host's step slowdown while this policy serves, overall and (`--by-batch`) per batch
    size: a run at `rate`, on arrivals of another seed than the predicted runs'."""
    from dilaserve.cluster.trace_run import TraceRunSpec, run_trace

    trace = f"poisson:{rate:g}:{args.calibration_seconds}"
    spec = TraceRunSpec(trace, slo=args.slo, seed=args.seed + 1000)
    summary = run_trace(config, spec)["summary"]
    slowdown, by_batch = summary["step_time_ratio"], summary["step_time_ratio_by_batch"]
    print(f"calibration run {trace}: step slowdown {slowdown}, by batch {by_batch}", flush=True)
    return slowdown, by_batch if args.by_batch else None


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="30,50,80")
    parser.add_argument("--policies", default="dilaserve,fcfs")
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--slo", type=float, default=0.3)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--calibration-rate", default="run", help="run: each run's own rate; or one rate"
    )
    parser.add_argument("--calibration-seconds", type=float, default=20.0)
    parser.add_argument(
        "--by-batch",
        action="store_true",
        help="predict with the calibration's slowdown per batch size, not one for every step",
    )
    parser.add_argument(
        "--profile", help="a latency profile to use instead of the bundled calibration's"
    )
    parser.add_argument("--out", default="runs")
    return parser.parse_args()


def predicted_run(config, args, policy: str, rate: float, slowdown, by_batch) -> dict:
    """One live run at `rate` beside the simulator's prediction of it: the table's row."""
    from dilaserve.cluster.trace_run import TraceRunSpec, run_trace

    spec = TraceRunSpec(
        f"poisson:{rate}:{args.seconds}",
        slo=args.slo,
        seed=args.seed,
        predict=str(BUNDLED_CALIBRATION / "trajectories.npz"),
        predict_slowdown=slowdown,
        predict_slowdown_by_batch=by_batch,
    )
    s = run_trace(config, spec)["summary"]
    p = s["prediction"]
    post = p["at_run_speed"]
    return {
        "policy": policy,
        "rps": rate,
        "requests": s["requests"],
        "calibrated_slowdown": slowdown,
        "run_slowdown": s["step_time_ratio"],
        "real_slo_attainment": s["slo_attainment"],
        "predicted_slo_attainment": p["slo_attainment"],
        "error_pp": p["slo_attainment_error_pp"],
        "real_latency_mean": s["latency_mean"],
        "predicted_latency_mean": p["latency_mean"],
        "latency_ratio": p["latency_mean_ratio"],
        "refused": s["refused"],  # by the controller's admission: predicted too
        "refused_at_submit": s["refused_at_submit"],  # before it: in neither
        "error_pp_at_run_speed": post["slo_attainment_error_pp"],
        "latency_ratio_at_run_speed": post["latency_mean_ratio"],
    }


def main() -> None:
    args = parse_args()
    records = []
    for policy in args.policies.split(","):
        config, _ = run_trace_config(record=True, **settings(policy, args))
        once = args.calibration_rate != "run"
        if once:
            slowdown, by_batch = calibrate(config, args, float(args.calibration_rate))
        for rate in (float(r) for r in args.rates.split(",")):
            if not once:
                slowdown, by_batch = calibrate(config, args, rate)
            records.append(predicted_run(config, args, policy, rate, slowdown, by_batch))
            print(records[-1], flush=True)
    write_table_run(args.out, "fidelity", vars(args), records, "simulator vs live cluster")


if __name__ == "__main__":
    main()
