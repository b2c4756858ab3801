"""The options that build a cluster (`serve`, `run-trace`): the model and its instances'
layout, the control plane's inputs and knobs, admission and timeouts, batches, the planner, DWS
and the backend. An option that sets a configuration field takes the field's default
(`field_default`); tests/test_serve_options.py checks that every field of the cluster's and the
server's configuration has an option or is named as derived.
"""

from __future__ import annotations

import argparse

from dilaserve.cli_args import (
    config_option,
    engine_args,
    field_default,
    model_arg,
    parse_thresholds,
)

INSTANCES_DEFAULT = "2"


def tp_list(text: str) -> tuple[int, ...]:
    """TP degrees such as "1,2,4"."""
    try:
        degrees = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of TP degrees: {text!r}") from None
    if not degrees or min(degrees) < 1:
        raise argparse.ArgumentTypeError(f"TP degrees must be >= 1: {text!r}")
    return degrees


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    config_option(p)
    model_arg(p)
    engine_args(p, threads=1, threads_help="torch CPU threads per worker rank")
    _layout_args(p)
    _control_args(p)
    _threshold_args(p)
    _protection_args(p)
    _batch_args(p)
    _planner_args(p)
    _dws_options(p)
    _backend_args(p)


def _layout_args(p: argparse.ArgumentParser) -> None:
    """How many instances of which TP degree start."""
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of each instance")
    p.add_argument("--instances", default=INSTANCES_DEFAULT, help="number of instances at start")
    p.add_argument(
        "--layout",
        type=tp_list,
        default=None,
        help="instead of --tp/--instances: the TP degree of each instance, e.g. 2,1",
    )
    p.add_argument(
        "--policy",
        default="dilaserve",
        help="dilaserve, fcfs, infaas, llumnix, or an ablation (see docs/control/scheduling.md)",
    )


def _control_args(p: argparse.ArgumentParser) -> None:
    """The control plane's inputs: the calibration, or a profile and a predictor."""
    p.add_argument(
        "--calibration",
        default=None,
        help="the model's calibration folder (dilaserve calibrate); default: the one that "
        "matches, next to the model or in ~/.cache/dilaserve",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="calibrate the model first if no calibration matches (before the configuration "
        "is built)",
    )
    p.add_argument(
        "--profile",
        default=None,
        help="latency profile JSON or preset name (e.g. llada-8b-h200) instead of the "
        "calibration's",
    )
    p.add_argument(
        "--predictor", default=None, help="step predictor folder instead of the calibration's"
    )


def _threshold_args(p: argparse.ArgumentParser) -> None:
    """How thresholds are chosen: the SLO and its share, the speed they are priced at, the
    ladder, and the quality budget."""
    p.add_argument("--slo", type=float, default=1.0, help="seconds; requests' default SLO")
    p.add_argument(
        "--slo-headroom",
        type=float,
        default=1.0,
        help="share of a request's remaining SLO its predicted time must fit "
        "(docs/control/thresholds.md)",
    )
    p.add_argument(
        "--measured-speed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="price steps at the measured slowdown of the instances' steps against the latency "
        "profile; --no-measured-speed: at the profile alone (docs/control/thresholds.md)",
    )
    p.add_argument(
        "--instance-speed",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="place each step by the instance's own measured speed, so that a slow GPU takes "
        "less work (needs the measured speed); default: the policy's, on for DiLaServe's, off "
        "for dilaserve-paper (docs/control/thresholds.md)",
    )
    p.add_argument(
        "--candidates",
        type=parse_thresholds,
        default=None,
        help="the thresholds a dynamic policy chooses from (default 0.5,0.6,0.7,0.8,0.9)",
    )
    p.add_argument(
        "--quality-budget",
        type=float,
        default=None,
        help="the relative quality loss (against the top threshold's) the requests served may "
        "lose before no request is given less than the top (default: the policy's, dilaserve "
        "0.01, with --quality-curve; without one, no bound; 1: no bound; "
        "docs/control/thresholds.md)",
    )
    p.add_argument(
        "--quality-curve",
        default=None,
        help="the served model's eval summary.json (accuracy per threshold): the policy's "
        "quality budget is kept on it (without it, no budget unless --quality-budget is given, "
        "then on LLaDA-8B's GSM8K curve as the paper reports it)",
    )


def _protection_args(p: argparse.ArgumentParser) -> None:
    """What keeps the service up: admission, the step and start-up timeouts."""
    from dilaserve.cluster.config import ClusterConfig

    p.add_argument(
        "--max-in-flight",
        type=int,
        default=1024,
        help="requests waiting or running, at most (a backstop: admission is by capacity)",
    )
    p.add_argument(
        "--overload",
        choices=["reject", "deprioritize"],
        default="reject",
        help="a request the cluster cannot serve within its SLO now: refused (429, "
        "Retry-After), or admitted at the lowest priority (deprioritize: for short bursts; "
        "under sustained overload nearly every request then misses its SLO, "
        "docs/serving/policies.md)",
    )
    p.add_argument(
        "--admission-time",
        choices=["batched", "queue"],
        default="batched",
        help="a request's predicted time at admission: its own steps in the batch it will "
        "share with the requests in flight (batched), or the load ahead of it over the "
        "cluster's throughput (queue)",
    )
    p.add_argument(
        "--admission-wait",
        type=float,
        default=field_default(ClusterConfig, "admission_wait"),
        help="seconds a request may wait, as the front expects it, for admission to answer "
        "it (behind the requests queued ahead of it): one that would wait longer is refused "
        "at once (429), not after the wait (default: %(default)s)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=None,
        help="seconds a step may run before its instance counts as hung (killed and replaced); "
        "default: 10x the slowest step the latency profile predicts, at least 10",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=field_default(ClusterConfig, "start_timeout"),
        help="seconds the initial instances may take to load",
    )


def _batch_args(p: argparse.ArgumentParser) -> None:
    """What an instance's step batch may hold, and how often the control plane re-plans (each
    option's default is its field's: `ClusterConfig`, `SchedulerConfig`, `EngineConfig`)."""
    from dilaserve.cluster.config import ClusterConfig
    from dilaserve.config import EngineConfig
    from dilaserve.control.decisions import SchedulerConfig

    def option(flag, cls, kind, text):
        name = flag[2:].replace("-", "_")
        p.add_argument(flag, type=kind, default=field_default(cls, name), help=text)

    option("--max-batch-tokens", ClusterConfig, int, "tokens one step batch may hold (Alg. 3)")
    option("--max-requests-per-instance", SchedulerConfig, int, "Alg. 2/4's batch size")
    option(
        "--max-forward-tokens",
        EngineConfig,
        int,
        "a step batch runs as forward passes of at most this many tokens (memory)",
    )
    option(
        "--cuda-graph-context",
        EngineConfig,
        int,
        "--cuda-graphs: cached tokens per request a graph holds at most",
    )
    option(
        "--kv-memory",
        EngineConfig,
        float,
        "GiB an instance's K/V and graph buffers may take (default: no bound); past it the least "
        "recently stepped requests' caches are dropped and their next steps recompute",
    )
    option(
        "--refresh-interval", SchedulerConfig, float, "seconds between batched prediction refreshes"
    )
    option(
        "--load-control-interval",
        SchedulerConfig,
        float,
        "seconds between load-control runs that refreshes alone trigger",
    )
    option(
        "--migration-price",
        SchedulerConfig,
        float,
        "seconds sooner a step must end away for a request to leave its instance (Alg. 3)",
    )


def _planner_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nodes",
        default=None,
        help="GPUs (CPU slots) per node for the ILP planner, e.g. 8,8; default: the instances' "
        "total on one node; 0: no reconfiguration",
    )
    p.add_argument("--planner-period", type=float, default=300.0, help="seconds between rounds")
    p.add_argument(
        "--plan-batch-limits",
        action="store_true",
        help="the planner's batch sizes bound each instance's batch (Alg. 3's maxBatchSize)",
    )
    p.add_argument(
        "--max-batch-requests", type=int, default=None, help="requests per step batch (no limit)"
    )


def _dws_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dws", default=None, help="DWS predictor folder (dws-sjf: the bundled one)")
    p.add_argument("--dws-cost", default=None, help="DWS cost kernel JSON (profile --dws)")
    p.add_argument(
        "--dws-prior", action="store_true", help="DWS expected steps as the step predictor's prior"
    )


def _backend_args(p: argparse.ArgumentParser) -> None:
    from dilaserve.cluster.config import ClusterConfig
    from dilaserve.cluster.worker import MAX_NICE, WORKER_NICE, WorkerConfig

    p.add_argument(
        "--tp-timeout",
        type=float,
        default=field_default(WorkerConfig, "tp_timeout"),
        help="seconds a tensor-parallel rank waits for its gang at start-up",
    )

    p.add_argument("--backend", choices=["local", "ray"], default="local")
    p.add_argument(
        "--worker-nice",
        type=int,
        default=WORKER_NICE,
        choices=range(MAX_NICE + 1),
        metavar="N",
        help=f"CPU niceness each worker rank adds (0 to {MAX_NICE}): how far the instances "
        "yield the cores to the HTTP front and the controller (docs/cluster.md, Worker priority)",
    )
    p.add_argument(
        "--spare-worker",
        action=argparse.BooleanOptionalAction,
        default=field_default(ClusterConfig, "spare_worker"),
        help="keep one worker process waiting with torch imported, so that a replacement or a "
        "new instance only loads its model (the local backend; docs/cluster.md, The spare worker); "
        "--no-spare-worker: start each from nothing",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="a running Ray cluster (HEAD:PORT; auto: one started here with ray start); default: "
        "$RAY_ADDRESS, else a Ray of our own on the loopback interface (docs/cluster-ray.md)",
    )
    p.add_argument("--tick", type=float, default=0.5, help="seconds between scheduler ticks")
