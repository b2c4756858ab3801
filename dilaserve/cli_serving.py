"""The serving commands of `dilaserve`: run-trace, serve, bench, train-dws, export-dws.

Kept apart from `cli.py` (the offline commands and the entry point), which registers them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dilaserve.cli_args import field_default, model_arg
from dilaserve.cli_cluster import calibrate_if_missing, cluster_config
from dilaserve.cli_cluster_args import add_cluster_args


def cmd_run_trace(args) -> None:
    import logging

    from dilaserve.cluster.trace_run import TraceRunSpec, run_trace, write_trace_run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    warned = calibrate_if_missing(args)
    config, inputs = cluster_config(args, record=True, warned=warned)
    logging.getLogger("dilaserve.calibration").info("control inputs: %s", inputs.label)
    spec = TraceRunSpec(
        args.trace,
        args.rate_scale,
        args.duration,
        args.max_requests,
        args.slo,
        args.seed,
        args.parity,
        _trajectories(args.predict, inputs.profile),
        args.predict_slowdown,
    )

    def progress(done: int, total: int) -> None:
        print(f"\rsubmitted {done}/{total}", end="", file=sys.stderr, flush=True)

    run = run_trace(config, spec, progress)
    folder = write_trace_run(run, config, spec, args.out)
    print(file=sys.stderr)
    for key, value in run["summary"].items():
        print(f"{key}: {value}")
    print(f"run folder: {folder}")


def run_trace_config(record: bool = False, **settings):
    """(ClusterConfig, control inputs) that `dilaserve run-trace` would build with `settings`
    (named as its options: model=..., slo=2.0, instances=2): for scripts that drive `run_trace`
    themselves, with no argv strings. An unknown setting is an error naming it."""
    from dilaserve.cli import build_parser
    from dilaserve.cli_args import command_args, resolve_model

    args = command_args(build_parser(), "run-trace", settings)
    resolve_model(args)
    return cluster_config(args, record=record)


def _trajectories(predict: str | None, profile: str) -> str | None:
    """--predict's trajectories: the path given, or the calibration's (beside its profile)."""
    if predict != "calibration":
        return predict
    path = Path(profile).parent / "trajectories.npz"
    if not path.is_file():
        raise ValueError(
            f"--predict: the calibration has no recorded trajectories ({path}); give a "
            "trajectories.npz (from `dilaserve calibrate` or `dilaserve train-predictor`)"
        )
    return str(path)


def _add_run_trace_command(sub) -> None:
    rt = sub.add_parser("run-trace", help="replay a trace against an in-process cluster")
    add_cluster_args(rt)
    rt.add_argument("--trace", default="poisson:4:20", help="trace CSV or poisson:RPS:SECONDS")
    rt.add_argument("--rate-scale", type=float, default=1.0)
    rt.add_argument("--duration", type=float, default=None)
    rt.add_argument("--max-requests", type=int, default=None)
    rt.add_argument("--parity", action="store_true", help="replay in the simulator and compare")
    rt.add_argument(
        "--predict",
        nargs="?",
        const="calibration",
        help="also write the simulator's prediction of the run from these recorded trajectories "
        "(default: the calibration's)",
    )
    rt.add_argument(
        "--predict-slowdown",
        type=float,
        default=1.0,
        help="the prediction's steps take the profile's time times this: the host's slowdown "
        "while serving, the `step_time_ratio` an earlier run-trace on it printed",
    )
    rt.add_argument("--seed", type=int, default=0)
    rt.add_argument("--out", default="runs", help="folder for run folders")
    rt.set_defaults(func=cmd_run_trace)


def cmd_serve(args) -> None:
    import logging

    from dilaserve.server.limits import HttpLimits
    from dilaserve.server.main import bind, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    bind(args.host, args.port).close()  # a port in use stops us before calibration or loading
    warned = calibrate_if_missing(args)
    config, inputs = cluster_config(args, warned=warned)
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
        max_messages=args.max_messages,
        max_connections=args.max_connections,
        retry_after=args.retry_after,
        http=HttpLimits(
            args.max_header_bytes, args.max_headers, args.header_timeout, args.body_timeout
        ),
    )


def _add_serve_command(sub) -> None:
    from dilaserve.server.app import ServerSettings

    sv = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API (FastAPI)"
    )
    add_cluster_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: folder name)"
    )
    sv.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish requests at shutdown"
    )
    sv.add_argument(
        "--retry-after",
        type=int,
        default=field_default(ServerSettings, "retry_after"),
        help="seconds a refused client is told to wait (429's Retry-After)",
    )
    _add_api_key(sv, "clients must send it as 'Authorization: Bearer KEY'")
    sv.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="larger request bodies are refused (413) before they are read",
    )
    _add_http_limits(sv)
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


def _add_http_limits(parser) -> None:
    """`serve`'s limits on what a client may send or hold (docs/serving.md, "Limits")."""
    from dilaserve.server.app import MAX_CONNECTIONS
    from dilaserve.server.limits import HttpLimits
    from dilaserve.server.schemas import MAX_MESSAGES

    http = HttpLimits()
    limits = parser.add_argument_group("HTTP limits")
    limits.add_argument(
        "--max-messages",
        type=int,
        default=MAX_MESSAGES,
        help="a chat with more messages is refused (400) before they are validated",
    )
    limits.add_argument(
        "--max-header-bytes",
        type=int,
        default=http.max_header_bytes,
        help="a request line and headers longer than this are refused (431)",
    )
    limits.add_argument(
        "--max-headers", type=int, default=http.max_headers, help="more header fields: 431"
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=http.header_timeout,
        help="seconds a client has to send a request's head (then 408, connection closed)",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        default=http.body_timeout,
        help="seconds a request's body may pause (then 408, connection closed)",
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="open connections the server holds; requests over it get 503",
    )


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
    records, summary = run_bench(spec, progress=sys.stderr)  # an unreachable url: ValueError
    folder = write_bench_run(records, summary, spec, args.out)
    for key, value in summary.items():
        print(f"{key}: {value}")
    print(f"run folder: {folder}")
    note = unanswered_note(summary, args.slo_ms)
    if note:
        print(f"dilaserve bench: warning: {note}", file=sys.stderr)


def unanswered_note(summary: dict, slo_ms: float) -> str | None:
    """A line when most requests were not answered (refused or failed), saying why if the
    statuses tell: a 429 is the server's admission refusing a request its SLO cannot meet."""
    missing = summary["requests"] - summary["ok"]
    if missing * 2 <= summary["requests"]:
        return None
    counts = ", ".join(f"{n} x {status}" for status, n in sorted(summary["errors"].items()))
    text = f"{missing} of {summary['requests']} requests got no answer ({counts})"
    if summary["errors"].get("429", 0) * 2 > summary["requests"]:
        text += (
            f": the server refused them (429) because it predicted they could not finish "
            f"within the {slo_ms:g} ms SLO; give a longer --slo-ms or a lower rate"
        )
    if summary["ok"] == 0:
        text += "; with no answer there is no latency, and no bench.png"
    return text


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
    from dilaserve.dws.train import DWSCommandConfig, train_dws_command

    names = DWSCommandConfig.__dataclass_fields__
    train_dws_command(DWSCommandConfig(**{k: v for k, v in vars(args).items() if k in names}))


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
