"""The serving commands of `dilaserve`: run-trace, serve, bench, train-dws, export-dws.

Kept apart from `cli.py` (the offline commands and the entry point), which registers them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dilaserve.cli_args import model_arg, parse_thresholds, precision_args

INSTANCES_DEFAULT = "2"


def _cluster_config(args, record: bool = False):
    """A ClusterConfig from the options `_add_cluster_args` defines, its control plane built
    from the model's calibration (or the profile and predictor given)."""
    import json

    from dilaserve.cluster.runtime import ClusterConfig, refuse_block_diffusion
    from dilaserve.cluster.worker import WorkerConfig
    from dilaserve.config import EngineConfig
    from dilaserve.control.build import ControlSpec
    from dilaserve.control.decisions import SchedulerConfig
    from dilaserve.models.registry import family_of, load_config

    refuse_block_diffusion(args.model, family_of(load_config(args.model)))
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
    )
    nodes = _nodes(args.nodes, instances)
    control = ControlSpec(
        args.policy,
        inputs.profile,
        inputs.predictor or "",
        scheduler,
        nodes=nodes,
        planner_period=args.planner_period,
        candidates=args.candidates,
    )
    config = ClusterConfig(
        worker=WorkerConfig(args.model, engine, args.threads),
        control=control,
        instances=instances,
        backend=args.backend,
        ray_address=args.ray_address,
        tick=args.tick,
        max_tokens=args.max_tokens,
        max_in_flight=args.max_in_flight,
        overload=args.overload,
        step_timeout=args.step_timeout,
        record=record,
        **_dws_args(args, inputs.dws_cost),
    )
    return config, inputs


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
    calibration that matches the model, device, dtype and TP degrees (made now with
    --calibrate), or the --profile and --predictor given."""
    import logging

    from dilaserve.calibration.run import CalibrateConfig, calibrate
    from dilaserve.calibration.store import (
        CalibrationMissing,
        model_key,
        resolve_control_inputs,
    )
    from dilaserve.control.policy import get_policy

    policy = get_policy(args.policy)
    key = model_key(args.model, _device_name(args), args.dtype)
    options = {
        "calibration": args.calibration,
        "profile": args.profile,
        "predictor": args.predictor,
        "needs_predictor": policy.is_dynamic or policy.reconfigure or bool(args.dws),
    }
    try:
        inputs = resolve_control_inputs(args.model, key, tps, args.device, **options)
    except CalibrationMissing:
        if not args.calibrate:
            raise
        tp = tuple(sorted(tps))
        calibrate(
            CalibrateConfig(
                args.model,
                args.device,
                args.dtype,
                tp,
                threads=args.threads,
                calibration=args.calibration,
            )
        )
        inputs = resolve_control_inputs(args.model, key, tps, args.device, **options)
    log = logging.getLogger("dilaserve.calibration")
    for warning in inputs.warnings:
        log.warning(warning)
    return inputs


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


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    model_arg(p)
    p.add_argument("--kv-cache", choices=["none", "prefix", "dual"], default="dual")
    precision_args(p)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="requests' default output window (whole 32-token blocks); default: the "
        "checkpoint's generation_config.json max_new_tokens, else 256",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker rank")
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
        help="dilaserve, fcfs, infaas, llumnix, or an ablation (see docs/control.md)",
    )
    p.add_argument(
        "--calibration",
        default=None,
        help="the model's calibration folder (dilaserve calibrate); default: the one that "
        "matches, next to the model or in ~/.cache/dilaserve",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="calibrate the model now if no calibration matches",
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
        help="share of a request's remaining SLO its predicted time must fit (docs/control.md)",
    )
    p.add_argument(
        "--candidates",
        type=parse_thresholds,
        default=None,
        help="the thresholds a dynamic policy chooses from (default 0.5,0.6,0.7,0.8,0.9)",
    )
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
    p.add_argument(
        "--nodes",
        default=None,
        help="GPUs (CPU slots) per node for the ILP planner, e.g. 8,8; default: the instances' "
        "total on one node; 0: no reconfiguration",
    )
    p.add_argument("--planner-period", type=float, default=300.0, help="seconds between rounds")
    p.add_argument(
        "--max-batch-requests", type=int, default=None, help="requests per step batch (no limit)"
    )
    p.add_argument("--dws", default=None, help="DWS predictor folder (dws-sjf: the bundled one)")
    p.add_argument("--dws-cost", default=None, help="DWS cost kernel JSON (profile --dws)")
    p.add_argument(
        "--dws-prior", action="store_true", help="DWS expected steps as the step predictor's prior"
    )
    p.add_argument("--backend", choices=["local", "ray"], default="local")
    p.add_argument("--ray-address", default=None, help="a running Ray cluster (HEAD:PORT)")
    p.add_argument("--tick", type=float, default=0.5, help="seconds between scheduler ticks")


def cmd_run_trace(args) -> None:
    import logging

    from dilaserve.cluster.trace_run import TraceRunSpec, run_trace, write_trace_run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config, inputs = _cluster_config(args, record=True)
    logging.getLogger("dilaserve.calibration").info("control inputs: %s", inputs.label)
    spec = TraceRunSpec(
        args.trace,
        args.rate_scale,
        args.duration,
        args.max_requests,
        args.slo,
        args.seed,
        args.parity,
    )

    def progress(done: int, total: int) -> None:
        print(f"\rsubmitted {done}/{total}", end="", file=sys.stderr, flush=True)

    run = run_trace(config, spec, progress)
    folder = write_trace_run(run, config, spec, args.out)
    print(file=sys.stderr)
    for key, value in run["summary"].items():
        print(f"{key}: {value}")
    print(f"run folder: {folder}")


def _add_run_trace_command(sub) -> None:
    rt = sub.add_parser("run-trace", help="replay a trace against an in-process cluster")
    _add_cluster_args(rt)
    rt.add_argument("--trace", default="poisson:4:20", help="trace CSV or poisson:RPS:SECONDS")
    rt.add_argument("--rate-scale", type=float, default=1.0)
    rt.add_argument("--duration", type=float, default=None)
    rt.add_argument("--max-requests", type=int, default=None)
    rt.add_argument("--parity", action="store_true", help="replay in the simulator and compare")
    rt.add_argument("--seed", type=int, default=0)
    rt.add_argument("--out", default="runs", help="folder for run folders")
    rt.set_defaults(func=cmd_run_trace)


def cmd_serve(args) -> None:
    import logging

    from dilaserve.server.main import bind, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    bind(args.host, args.port).close()  # a port in use stops us before calibration or loading
    config, inputs = _cluster_config(args)
    serve(
        config,
        args.host,
        args.port,
        args.served_model_name,
        args.drain_timeout,
        _api_key(args),
        args.log_interval,
        calibration=inputs.label,
        max_body_bytes=args.max_body_bytes,
        allowed_hosts=tuple(args.allowed_host) or None,
        docs=args.docs,
    )


def _add_serve_command(sub) -> None:
    sv = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API (FastAPI)"
    )
    _add_cluster_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: folder name)"
    )
    sv.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish requests at shutdown"
    )
    _add_api_key(sv, "clients must send it as 'Authorization: Bearer KEY'")
    sv.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="larger request bodies are refused (413) before they are read",
    )
    sv.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        help="a Host header name clients may use (repeat; default: the loopback names when "
        "--host is loopback, else any)",
    )
    sv.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json")
    sv.add_argument(
        "--log-interval",
        type=float,
        default=10.0,
        help="seconds between log lines of what the server did (0: none)",
    )
    sv.set_defaults(func=cmd_serve)


def _add_api_key(parser, meaning: str) -> None:
    parser.add_argument(
        "--api-key-file",
        default=None,
        help=f"a file holding the API key: {meaning} (or set $DILASERVE_API_KEY; neither: no "
        "key). Never on the command line, where every user of the machine can read it",
    )
    parser.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # refused: _api_key


def _api_key(args) -> str | None:
    """The API key from --api-key-file or $DILASERVE_API_KEY (None: no key); one given on the
    command line, or an empty one, is refused."""
    if args.api_key is not None:
        raise ValueError(
            "--api-key puts the key where every user of this machine can read it (ps); "
            "set $DILASERVE_API_KEY or pass --api-key-file FILE"
        )
    if args.api_key_file is not None:
        key, source = Path(args.api_key_file).read_text().strip(), args.api_key_file
    else:
        key, source = os.environ.get("DILASERVE_API_KEY"), "$DILASERVE_API_KEY"
    if key is not None and not key.strip():
        raise ValueError(f"the API key in {source} is empty (unset it to serve without a key)")
    return key


def cmd_bench(args) -> None:
    import httpx

    from dilaserve.bench.loadgen import BenchSpec, run_bench, write_bench_run

    extra = {} if args.threshold is None else {"threshold": args.threshold}
    spec = BenchSpec(
        url=args.url,
        trace=args.trace,
        rate_scale=args.rate_scale,
        duration=args.duration,
        max_requests=args.max_requests,
        slo_ms=args.slo_ms,
        endpoint=args.endpoint,
        max_tokens=args.max_tokens,
        model=args.model,
        seed=args.seed,
        timeout=args.timeout,
        extra=extra,
        api_key=_api_key(args),
    )
    try:
        records, summary = run_bench(spec, progress=sys.stderr)
    except httpx.HTTPError as err:
        raise ValueError(f"cannot reach the server at {args.url}: {err}") from None
    folder = write_bench_run(records, summary, spec, args.out)
    for key, value in summary.items():
        print(f"{key}: {value}")
    print(f"run folder: {folder}")


def _add_bench_command(sub) -> None:
    b = sub.add_parser("bench", help="replay a trace against a live server (load generator)")
    b.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    b.add_argument("--trace", required=True, help="trace CSV or poisson:RPS:SECONDS")
    b.add_argument("--rate-scale", type=float, default=1.0)
    b.add_argument("--duration", type=float, default=None)
    b.add_argument("--max-requests", type=int, default=None)
    b.add_argument("--slo-ms", type=float, default=1000.0, help="each request's SLO")
    b.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--threshold", type=float, default=None, help="pin every request's threshold")
    b.add_argument("--model", default=None, help="default: the server's first model")
    b.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    _add_api_key(b, "sent as 'Authorization: Bearer KEY'")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default="runs", help="folder for run folders")
    b.set_defaults(func=cmd_bench)


def cmd_train_dws(args) -> None:
    from dilaserve.dws.train import TrainDWSConfig, train_dws_command

    names = TrainDWSConfig.__dataclass_fields__
    train_dws_command(TrainDWSConfig(**{k: v for k, v in vars(args).items() if k in names}))


def _add_train_dws_command(sub) -> None:
    t = sub.add_parser("train-dws", help="collect DWS labels on the engine and train the predictor")
    model_arg(t)
    t.add_argument("--out", required=True, help="folder for the trained DWS predictor")
    t.add_argument("--num", type=int, default=1500, help="prompts to label")
    t.add_argument("--gen-len", type=int, default=64, help="the output window to label")
    t.add_argument("--threshold", type=float, default=0.9)
    t.add_argument(
        "--prompts", default=None, help="JSONL with a 'prompt' per line (default: bundled task)"
    )
    t.add_argument(
        "--encoder",
        default="auto",
        help="all-MiniLM-L6-v2 (the dws extra's), hashed, or a sentence-transformers folder; "
        "auto: MiniLM where the dws extra is installed, else hashed",
    )
    t.add_argument("--runs", default="runs", help="folder for run folders")
    t.set_defaults(func=cmd_train_dws)


def cmd_export_dws(args) -> None:
    from dilaserve.dws.onnx_export import export_dws_command

    export_dws_command(args.dws, not args.no_int8, args.model, args.num, args.seed)


def _add_export_dws_command(sub) -> None:
    e = sub.add_parser(
        "export-dws",
        help="export a DWS predictor to ONNX (FP32 and INT8) and compare it with PyTorch",
    )
    e.add_argument("--dws", required=True, help="a DWS predictor folder (dilaserve train-dws)")
    e.add_argument("--no-int8", action="store_true", help="write only the FP32 graph")
    model_arg(e)  # its tokenizer gives the comparison prompts' lengths
    e.add_argument("--num", type=int, default=200, help="bundled-task prompts to compare on")
    e.add_argument("--seed", type=int, default=0)
    e.set_defaults(func=cmd_export_dws)


def add_serving_commands(sub) -> None:
    _add_run_trace_command(sub)
    _add_serve_command(sub)
    _add_bench_command(sub)
    _add_train_dws_command(sub)
    _add_export_dws_command(sub)
