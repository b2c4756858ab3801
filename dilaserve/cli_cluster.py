"""Building a cluster (`serve`, `run-trace`) from its options: the model and its instances'
layout, the control plane's inputs (the model's calibration, or a profile and predictor), the
scheduler's knobs and the backend, turned into a `ClusterConfig`. The options themselves are
in `cli_cluster_args.py`; building never calibrates (`calibrate_if_missing` does, first).
"""

from __future__ import annotations

import logging
from pathlib import Path

from dilaserve.cli_args import engine_config
from dilaserve.cli_cluster_args import INSTANCES_DEFAULT

log = logging.getLogger("dilaserve.calibration")


def cluster_config(args, record: bool = False, warned: bool = False):
    """A ClusterConfig from the options `add_cluster_args` defines, its control plane built
    from the model's calibration (or the profile and predictor given); `warned`: the
    calibration's warnings were said already (by the calibration just run)."""
    from dilaserve.cluster.runtime import ClusterConfig, with_family_cache
    from dilaserve.cluster.worker import WorkerConfig
    from dilaserve.control.build import ControlSpec
    from dilaserve.models.registry import family_of, load_config

    instances = layout(args)
    inputs = control_inputs(args, set(instances), warned)
    engine = engine_config(
        args,
        max_forward_tokens=args.max_forward_tokens,
        cuda_graph_context=args.cuda_graph_context,
        kv_memory=args.kv_memory,
    )
    curve = args.quality_curve or inputs.quality
    scheduler = _scheduler_config(args, inputs.predictor, curve)
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
        quality_budget=_live_quality_budget(args, curve),
    )
    config = ClusterConfig(
        worker=WorkerConfig(args.model, engine, args.threads, args.tp_timeout, args.worker_nice),
        control=control,
        instances=instances,
        backend=args.backend,
        ray_address=args.ray_address,
        spare_worker=args.spare_worker,
        tick=args.tick,
        max_tokens=args.max_tokens,
        max_batch_tokens=args.max_batch_tokens,
        start_timeout=args.start_timeout,
        max_in_flight=args.max_in_flight,
        overload=args.overload,
        admission_time=args.admission_time,
        admission_wait=args.admission_wait,
        measured_speed=args.measured_speed,
        step_timeout=args.step_timeout,
        record=record,
        **_dws_args(args, inputs.dws_cost),
    )
    return with_family_cache(config, family_of(load_config(args.model))), inputs


def _live_quality_budget(args, curve: str | None) -> float | None:
    """The quality budget of a live cluster: the option's if given; else the policy's only on
    the served model's own curve (`curve`: `--quality-curve`, else its calibration's, `eval
    --keep-curve`; the bundled model ships one), and none without one. Kept on a curve that is
    not the served model's, the budget would bind on an assumption, and it costs throughput
    where it binds (live at 3x capacity, 117 against 167 requests a second served:
    docs/serving/reliability.md). The simulator's quality metric is the curve it keeps the
    budget on, so `simulate` keeps the policy's."""
    if args.quality_budget is not None:
        return args.quality_budget
    if curve:
        return None
    from dilaserve.control.policy import get_policy

    if get_policy(args.policy).is_dynamic:
        log.info(
            "no quality curve for %s: no quality budget (dilaserve eval MODEL --keep-curve "
            "keeps one beside its calibration)",
            args.model,
        )
    return 1.0


def _scheduler_config(args, predictor: str | None, curve: str | None = None):
    """The scheduler's settings from the options; the step predictor's refresh period."""
    import json

    from dilaserve.control.decisions import SchedulerConfig
    from dilaserve.quality import LLADA_GSM8K, QualityModel

    meta = Path(predictor or "") / "gbm-full.json"
    k = json.loads(meta.read_text()).get("refresh_every_tokens", 8) if meta.is_file() else 8
    return SchedulerConfig(
        kv_cache=args.kv_cache,
        slo=args.slo,
        refresh_every_tokens=k,
        max_requests_per_instance=args.max_requests_per_instance,
        max_batch_requests=args.max_batch_requests,
        load_control_interval=args.load_control_interval,
        refresh_interval=args.refresh_interval,
        slo_headroom=args.slo_headroom,
        instance_speed=args.instance_speed,
        migration_price=args.migration_price,
        quality=QualityModel.from_eval(curve) if curve else LLADA_GSM8K,
    )


def layout(args) -> tuple[int, ...]:
    """The TP degree of each instance at start: --layout, else --instances of --tp."""
    instances = str(args.instances)  # a count (or, from code, an int)
    if "," in instances:
        raise ValueError(
            f"--instances is a count; for a layout of TP degrees use --layout {instances}"
        )
    try:
        count = int(instances)
    except ValueError:
        raise ValueError(f"--instances {instances!r} must be a number of instances") from None
    if args.layout is not None:
        if instances != INSTANCES_DEFAULT or args.tp != 1:
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


def control_inputs(args, tps: set[int], warned: bool = False):
    """The latency profile and step predictor the control plane is built from: the
    calibration that matches the model, device, dtype and TP degrees, or the --profile and
    --predictor given, its warnings logged unless `warned`. Never calibrates
    (`calibrate_if_missing` does, when asked)."""
    import logging

    inputs = _resolve_inputs(args, tps)
    log = logging.getLogger("dilaserve.calibration")
    for warning in () if warned else inputs.warnings:
        log.warning(warning)
    for warning in editing_warnings(args.model, getattr(args, "editing", None), inputs.predictor):
        log.warning(warning)
    return inputs


def editing_warnings(model: str, editing: str | None, predictor: str | None) -> list[str]:
    """A line when the step predictor was calibrated with another token-editing mode than
    the engines decode with (`editing`, resolved for the checkpoint): its edit-only steps are
    then not the ones served. Predictors that do not say their mode are not judged."""
    import json

    from dilaserve.models.registry import family_of, load_config

    meta = Path(predictor) / "gbm-full.json" if predictor else None
    calibrated = json.loads(meta.read_text()).get("editing") if meta and meta.is_file() else None
    if calibrated is None:
        return []
    config = load_config(model)
    rule = family_of(config).decoding_for(config, editing).editing
    served = rule.mode if rule is not None else "off"
    if served == calibrated:
        return []
    return [
        f"the step predictor in {predictor} was calibrated with editing={calibrated!r} and "
        f"the engines decode with editing={served!r}: its steps are not the ones served (run "
        f"dilaserve calibrate --editing {served})"
    ]


def calibrate_if_missing(args) -> bool:
    """--calibrate: calibrate the model now if no calibration matches its layout's TP degrees;
    called before the configuration is built, which never calibrates. Whether it calibrated
    (and so has said the calibration's warnings)."""
    from dilaserve.calibration.run import CalibrateConfig, calibrate
    from dilaserve.calibration.store import CalibrationMissing

    if not args.calibrate:
        return False
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
            editing=args.editing,
        )
        calibrate(cfg)
        return True
    return False


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
