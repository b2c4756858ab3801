"""The options that build a cluster (`serve`, `run-trace`): the model and its instances'
layout, the control plane's inputs (the model's calibration, or a profile and predictor), the
scheduler's knobs and the backend, turned into a `ClusterConfig`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dilaserve.cli_args import config_option, engine_args, model_arg, parse_thresholds

INSTANCES_DEFAULT = "2"


def cluster_config(args, record: bool = False):
    """A ClusterConfig from the options `add_cluster_args` defines, its control plane built
    from the model's calibration (or the profile and predictor given)."""
    import json

    from dilaserve.cluster.runtime import ClusterConfig, with_family_cache
    from dilaserve.cluster.worker import WorkerConfig
    from dilaserve.config import EngineConfig
    from dilaserve.control.build import ControlSpec
    from dilaserve.control.decisions import SchedulerConfig
    from dilaserve.models.registry import family_of, load_config

    instances = layout(args)
    inputs = control_inputs(args, set(instances))
    meta = Path(inputs.predictor or "") / "gbm-full.json"
    k = json.loads(meta.read_text()).get("refresh_every_tokens", 8) if meta.is_file() else 8
    engine = EngineConfig(
        args.kv_cache, dtype=args.dtype, device=args.device, cuda_graphs=args.cuda_graphs
    )
    scheduler = SchedulerConfig(
        kv_cache=args.kv_cache,
        slo=args.slo,
        refresh_every_tokens=k,
        slo_headroom=args.slo_headroom,
        max_batch_requests=args.max_batch_requests,
        instance_speed=args.instance_speed,
    )
    nodes = _nodes(args.nodes, instances)
    control = ControlSpec(
        args.policy,
        inputs.profile,
        inputs.predictor or "",
        scheduler,
        nodes=nodes,
        planner_period=args.planner_period,
        plan_batch_limits=args.plan_batch_limits,
        candidates=args.candidates,
    )
    config = ClusterConfig(
        worker=WorkerConfig(args.model, engine, args.threads, nice=args.worker_nice),
        control=control,
        instances=instances,
        backend=args.backend,
        ray_address=args.ray_address,
        tick=args.tick,
        max_tokens=args.max_tokens,
        max_in_flight=args.max_in_flight,
        overload=args.overload,
        measured_speed=args.measured_speed,
        step_timeout=args.step_timeout,
        record=record,
        **_dws_args(args, inputs.dws_cost),
    )
    return with_family_cache(config, family_of(load_config(args.model))), inputs


def tp_list(text: str) -> tuple[int, ...]:
    """TP degrees such as "1,2,4"."""
    try:
        degrees = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of TP degrees: {text!r}") from None
    if not degrees or min(degrees) < 1:
        raise argparse.ArgumentTypeError(f"TP degrees must be >= 1: {text!r}")
    return degrees


def layout(args) -> tuple[int, ...]:
    """The TP degree of each instance at start: --layout, else --instances of --tp."""
    if "," in args.instances:
        raise ValueError(
            f"--instances is a count; for a layout of TP degrees use --layout {args.instances}"
        )
    try:
        count = int(args.instances)
    except ValueError:
        raise ValueError(f"--instances {args.instances!r} must be a number of instances") from None
    if args.layout is not None:
        if args.instances != INSTANCES_DEFAULT or args.tp != 1:
            raise ValueError("give --layout, or --tp and --instances, not both")
        return args.layout
    if count < 1:
        raise ValueError(f"--instances {count} must be at least 1")
    return (args.tp,) * count


def _device_name(args) -> str:
    """The device the calibration must have been made on: this machine's, or, for a Ray
    cluster whose GPUs are on other machines, the one the given --calibration names."""
    from dilaserve.calibration.run import device_name
    from dilaserve.calibration.store import Calibration

    try:
        return device_name(args.device)
    except ValueError:
        if args.backend != "ray" or not args.calibration:
            raise
        return Calibration.load(args.calibration).key.device


def control_inputs(args, tps: set[int]):
    """The latency profile and step predictor the control plane is built from: the
    calibration that matches the model, device, dtype and TP degrees, or the --profile and
    --predictor given. Never calibrates (`calibrate_if_missing` does, when asked)."""
    import logging

    inputs = _resolve_inputs(args, tps)
    log = logging.getLogger("dilaserve.calibration")
    for warning in inputs.warnings:
        log.warning(warning)
    return inputs


def calibrate_if_missing(args) -> None:
    """--calibrate: calibrate the model now if no calibration matches its layout's TP degrees;
    called before the configuration is built, which never calibrates."""
    from dilaserve.calibration.run import CalibrateConfig, calibrate
    from dilaserve.calibration.store import CalibrationMissing

    if not args.calibrate:
        return
    tps = set(layout(args))
    try:
        _resolve_inputs(args, tps)
    except CalibrationMissing:
        cfg = CalibrateConfig(
            args.model,
            args.device,
            args.dtype,
            tuple(sorted(tps)),
            threads=args.threads,
            calibration=args.calibration,
        )
        calibrate(cfg)


def _resolve_inputs(args, tps: set[int]):
    from dilaserve.calibration.store import model_key, resolve_control_inputs
    from dilaserve.control.policy import get_policy

    policy = get_policy(args.policy)
    key = model_key(args.model, _device_name(args), args.dtype)
    options = {
        "calibration": args.calibration,
        "profile": args.profile,
        "predictor": args.predictor,
        "needs_predictor": policy.is_dynamic or policy.reconfigure or bool(args.dws),
    }
    return resolve_control_inputs(args.model, key, tps, args.device, **options)


def _nodes(text: str | None, instances: tuple[int, ...]) -> tuple[int, ...]:
    """The planner's GPUs (or CPU slots) per node: given, or the initial instances' total on one
    node; "0" turns the planner off."""
    if text is None:
        return (sum(instances),)
    try:
        nodes = tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ValueError(
            f"--nodes {text!r} must be GPUs per node, e.g. 8,8 (0: no planner)"
        ) from None
    return () if nodes == (0,) else nodes


def _dws_args(args, calibrated_cost: str | None) -> dict:
    """DWS at admission: asked for, or needed by the dws-sjf policy (the bundled one then). Its
    cost kernel: --dws-cost, else the calibration's (`calibrate --dws`), else the bundled one's
    for the bundled predictor."""
    from dilaserve.config import BUNDLED_DWS, BUNDLED_DWS_COST

    dws = args.dws or (str(BUNDLED_DWS) if args.policy == "dws-sjf" or args.dws_prior else None)
    if dws is None:
        return {}
    bundled = str(BUNDLED_DWS_COST) if dws == str(BUNDLED_DWS) else None
    cost = args.dws_cost or calibrated_cost or bundled
    return {"dws": dws, "dws_cost": cost, "dws_prior": args.dws_prior}


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    config_option(p)
    model_arg(p)
    engine_args(p, threads=1, threads_help="torch CPU threads per worker rank")
    _layout_args(p)
    _control_args(p)
    _protection_args(p)
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
    """The control plane: its inputs (calibration, or profile and predictor) and its knobs."""
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
        action="store_true",
        help="extension: place each step by the instance's own measured speed, so that a slow "
        "GPU takes less work (needs the measured speed; docs/control/thresholds.md)",
    )
    p.add_argument(
        "--candidates",
        type=parse_thresholds,
        default=None,
        help="the thresholds a dynamic policy chooses from (default 0.5,0.6,0.7,0.8,0.9)",
    )


def _protection_args(p: argparse.ArgumentParser) -> None:
    """What keeps the service up: admission, the step timeout."""
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
        "Retry-After), or served after everything else",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=None,
        help="seconds a step may run before its instance counts as hung (killed and replaced); "
        "default: 10x the slowest step the latency profile predicts, at least 10",
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
    from dilaserve.cluster.worker import MAX_NICE, WORKER_NICE

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
        "--ray-address",
        default=None,
        help="a running Ray cluster (HEAD:PORT; auto: one started here with ray start); default: "
        "$RAY_ADDRESS, else a Ray of our own on the loopback interface (docs/cluster-ray.md)",
    )
    p.add_argument("--tick", type=float, default=0.5, help="seconds between scheduler ticks")
