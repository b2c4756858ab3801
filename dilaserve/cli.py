"""`dilaserve` command line. Heavy imports happen inside each command."""

from __future__ import annotations

import argparse
import os
import sys

from dilaserve.cli_args import (
    engine_args,
    model_arg,
    parse_thresholds,
    precision_args,
    resolve_model,
    show_defaults,
)
from dilaserve.cli_cluster import tp_list
from dilaserve.cli_serving import add_serving_commands
from dilaserve.config import DEFAULT_THRESHOLD


def cmd_generate(args) -> None:
    from dilaserve.config import EngineConfig, SamplingParams
    from dilaserve.engine.llm import LLM

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("give --prompt TEXT (repeatable) or prompts on standard input")
    engine = EngineConfig(
        args.kv_cache, dtype=args.dtype, device=args.device, cuda_graphs=args.cuda_graphs
    )
    llm = LLM(args.model, engine)
    params = SamplingParams(threshold=args.threshold, max_tokens=args.max_tokens)
    for out in llm.generate(prompts, params, chat=not args.raw):
        print(
            f"### {out.prompt}\n{out.text}\n[{out.num_steps} steps, "
            f"{len(out.token_ids)} tokens, {out.steps_by_kind}]"
        )


def cmd_eval(args) -> None:
    from dilaserve.tasks.evaluate import EvalConfig, evaluate

    evaluate(
        EvalConfig(
            model=args.model,
            task=args.task,
            thresholds=args.thresholds,
            num_problems=args.num,
            max_tokens=args.max_tokens,
            kv_cache=args.kv_cache,
            dtype=args.dtype,
            device=args.device,
            cuda_graphs=args.cuda_graphs,
            block_len=args.block_len,
            max_batch=args.max_batch,
            data=args.data,
            out=args.out,
        )
    )


def cmd_train_model(args) -> None:
    from dilaserve.training.train_model import TrainConfig, train

    cfg = TrainConfig(
        out=args.out,
        minutes=args.minutes,
        max_steps=args.max_steps,
        seed=args.seed,
        init_from=args.init_from,
        lr=args.lr,
        difficulty=args.difficulty,
    )
    path = train(cfg)
    print(f"checkpoint written to {path}")


def cmd_profile(args) -> None:
    if args.dws:
        from dilaserve.dws.profile import DWSProfileConfig, profile_dws

        profile_dws(
            DWSProfileConfig(
                model=args.model,
                num_probes=args.dws_probes,
                gen_len=args.gen_len,
                dtype=args.dtype,
                device=args.device,
                cuda_graphs=args.cuda_graphs,
                out=args.out,
                kernel_out=args.dws_out,
            )
        )
        return
    from dilaserve.calibration.run import profile_command

    profile_command(_calibrate_config(args, max_tokens=args.gen_len), args.out, args.profile_out)


def cmd_calibrate(args) -> None:
    from dilaserve.calibration.run import calibrate

    calibrate(_calibrate_config(args))


def _calibrate_config(args, **overrides):
    """A CalibrateConfig from the options of the same names."""
    from dataclasses import fields

    from dilaserve.calibration.run import CalibrateConfig

    names = {f.name for f in fields(CalibrateConfig)}
    return CalibrateConfig(**{k: v for k, v in vars(args).items() if k in names} | overrides)


def cmd_train_predictor(args) -> None:
    from dilaserve.training.train_predictor import PredictorConfig, train_predictor

    train_predictor(
        PredictorConfig(
            model=args.model,
            out=args.out,
            num_prompts=args.num,
            thresholds=args.thresholds,
            runs=args.runs,
            trajectories=args.trajectories,
        )
    )


def cmd_plan(args) -> None:
    from dilaserve.control.planner import PlannerConfig
    from dilaserve.runs import create_run_dir, write_json, write_records
    from dilaserve.sim import capacity
    from dilaserve.sim.latency import load_profile
    from dilaserve.sim.traces import load_trace

    profile = load_profile(args.profile)
    trace = load_trace(args.trace)
    tokens_per_step = args.tokens_per_step or capacity.tokens_per_step_from_predictor(
        args.predictor
    )
    cfg = PlannerConfig(
        capacity.nodes_for(args.gpus, args.gpus_per_node),
        tokens_per_step,
        tp_degrees=args.tp,
        cache_block=None if args.kv_cache == "none" else args.block,
        period=args.window,
    )
    classes = capacity.workload_classes(trace, args.slo, args.block, args.window, args.safety)
    ans = capacity.answer(classes, profile, cfg, args.gpus_per_node)
    source = f"busiest {args.window:g} s of {trace.source}"
    text = capacity.report(ans, cfg, args.slo, source)
    folder = create_run_dir(args.out, "plan")
    write_json(folder / "config.json", {**vars(args), "func": None})
    write_records(folder / "records.csv", capacity.class_rows(ans))
    summary = {
        "instances": ans.plan.counts(),
        "feasible": ans.plan.feasible,
        "mean_threshold": ans.plan.mean_threshold,
        "capacity_multiple": ans.multiple,
        "smallest_gpus": ans.smallest_gpus,
    }
    write_json(folder / "summary.json", summary)
    (folder / "report.md").write_text(text)
    print(text + f"run folder: {folder}")


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


def _tokens_per_step(text: str) -> dict[float, float]:
    try:
        pairs = (item.split(":") for item in text.replace(" ", "").split(","))
        return {float(c): float(t) for c, t in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--tokens-per-step: expected THRESHOLD:TOKENS,... (e.g. 0.5:4,0.9:2), got {text!r}"
        ) from None


def _add_plan_command(sub) -> None:
    from dilaserve.config import BUNDLED_PREDICTOR

    pl = sub.add_parser("plan", help="which cluster configuration serves a trace at an SLO")
    pl.add_argument(
        "--profile", required=True, help="latency profile JSON or preset (e.g. llada-8b-h100)"
    )
    pl.add_argument("--trace", required=True, help="trace CSV (see dilaserve/sim/traces.py)")
    pl.add_argument("--gpus", type=int, required=True)
    pl.add_argument("--gpus-per-node", type=int, default=8)
    pl.add_argument("--slo", type=float, required=True, help="seconds per request")
    pl.add_argument(
        "--tp", type=lambda t: tuple(int(x) for x in t.split(",")), default=(1, 2, 4, 8)
    )
    pl.add_argument("--kv-cache", choices=["none", "dual"], default="dual")
    pl.add_argument("--block", type=int, default=32)
    pl.add_argument("--window", type=float, default=300.0, help="seconds of the busiest window")
    pl.add_argument("--safety", type=float, default=1.1, help="rate buffer above the observed")
    pl.add_argument(
        "--tokens-per-step",
        type=_tokens_per_step,
        default=None,
        help="mean tokens committed per step at each threshold, e.g. 0.5:4,0.9:2; "
        "default: from --predictor",
    )
    pl.add_argument("--predictor", default=str(BUNDLED_PREDICTOR), help="step predictor folder")
    pl.add_argument("--out", default="runs", help="folder for run folders")
    pl.set_defaults(func=cmd_plan)


def cmd_simulate(args) -> None:
    from dataclasses import asdict, fields

    from dilaserve.runs import create_run_dir, write_json
    from dilaserve.sim.run import SimulationSpec, simulate, write_run

    names = {f.name for f in fields(SimulationSpec)}
    spec = SimulationSpec(**{k: v for k, v in vars(args).items() if k in names})
    folder = create_run_dir(args.out, "simulate")  # at once, so that a long run can be watched
    write_json(folder / "config.json", asdict(spec))
    run = simulate(spec, progress=_progress(folder, show=not args.quiet))
    write_run(run, args.out, folder=folder)
    (folder / "progress.json").unlink(missing_ok=True)  # summary.json now says it all
    print(file=sys.stderr)
    for key, value in {**run.summary, **run.timing}.items():
        print(f"{key}: {value}")
    print(f"run folder: {folder}")


def _progress(folder, show: bool, every: float = 30.0):
    """Every `every` simulated seconds: the run folder's progress.json (simulated time,
    requests done, wall time, and the wall time left at the pace so far; removed when the run
    is written), and a stderr line."""
    import json
    import time

    start, last = time.monotonic(), [-every]

    def update(now: float, done: int, total: int) -> None:
        if now - last[0] < every:
            return
        last[0] = now
        wall = time.monotonic() - start
        left = wall / done * (total - done) if done else None
        state = {"simulated_s": round(now, 1), "requests_done": done, "requests": total}
        state |= {"wall_s": round(wall, 1), "wall_s_left": left and round(left, 1)}
        (folder / "progress.json").write_text(json.dumps(state) + "\n")
        if show:
            line = f"\rsimulated {now:8.0f} s  {done}/{total} requests done"
            print(line, end="", file=sys.stderr, flush=True)

    return update


def _add_simulate_command(sub) -> None:
    si = sub.add_parser("simulate", help="trace-driven cluster simulation (same control plane)")
    si.add_argument("--policy", default="dilaserve")
    si.add_argument("--profile", default="llada-8b-h100", help="preset name or profile JSON")
    si.add_argument("--trace", default="paper", help="paper | poisson:RPS:SECONDS | CSV path")
    si.add_argument("--peak-rps", type=float, default=20.0, help="peak of the paper trace")
    si.add_argument(
        "--minutes-per-hour", type=float, default=5.0, help="paper trace: minutes per hour"
    )
    si.add_argument(
        "--behaviour", default="parametric", help="parametric | replay:TRAJECTORIES.npz"
    )
    si.add_argument("--predictor-path", default=None, help="replay: trained predictor folder")
    si.add_argument("--quality", default=None, help="eval summary.json for the quality model")
    si.add_argument("--duration", type=float, default=None, help="first N seconds only")
    si.add_argument("--rate-scale", type=float, default=1.0, help="speed arrivals up this much")
    si.add_argument("--gpus", type=int, default=16)
    si.add_argument("--gpus-per-node", type=int, default=4)
    si.add_argument("--initial-tp", type=int, default=1)
    si.add_argument("--slo", type=float, default=None, help="seconds (default: a multiple)")
    si.add_argument("--slo-multiple", type=float, default=5.0)
    si.add_argument("--kv-cache", choices=["none", "dual"], default="dual")
    si.add_argument("--planner-period", type=float, default=300.0)
    si.add_argument("--startup-delay", type=float, default=30.0)
    si.add_argument("--latency-noise", type=float, default=0.0)
    si.add_argument("--interval", type=float, default=300.0, help="seconds per metrics row")
    si.add_argument("--seed", type=int, default=0)
    si.add_argument("--out", default="runs", help="folder for run folders")
    si.add_argument("--quiet", action="store_true", help="no progress line")
    si.set_defaults(func=cmd_simulate)


def _measurement_args(p) -> None:
    """What `calibrate` and `profile` measure with."""
    model_arg(p)
    precision_args(p)
    p.add_argument("--tp", type=tp_list, default=(1,), help="TP degrees to measure, e.g. 1,2,4")
    p.add_argument(
        "--requests",
        type=_ints,
        default=(1, 2, 4, 8, 16, 32, 64, 128),
        help="batch sizes (requests per step) to measure",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point, after a warm-up")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker rank")


def _add_calibrate_command(sub) -> None:
    ca = sub.add_parser(
        "calibrate",
        help="measure a model's latency profile (every TP degree) and train its step predictor",
    )
    _measurement_args(ca)
    ca.add_argument(
        "--prompts",
        default=None,
        help="JSONL with a 'prompt' per line; default: the checkpoint's "
        "calibration_prompts.jsonl, else the shipped GSM8K + ShareGPT set",
    )
    ca.add_argument("--num-prompts", type=int, default=64, help="prompts recorded per threshold")
    ca.add_argument("--thresholds", type=parse_thresholds, default=(0.5, 0.6, 0.7, 0.8, 0.9))
    ca.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="output window of the recorded requests; default: the model's",
    )
    ca.add_argument(
        "--calibration",
        default=None,
        help="the calibration folder to write; default: MODEL/dilaserve-calibration/DEVICE-DTYPE "
        "if writable, else ~/.cache/dilaserve/calibration/...",
    )
    ca.add_argument(
        "--dws", action="store_true", help="also fit the DWS cost kernel (for dws-sjf, --dws-prior)"
    )
    ca.add_argument(
        "--profile-only",
        action="store_true",
        help="add the latency profile at these TP degrees to an existing calibration, keeping "
        "its step predictor",
    )
    ca.set_defaults(func=cmd_calibrate)


def _add_measurement_commands(sub) -> None:
    """calibrate, profile, train-predictor and train-model."""
    _add_calibrate_command(sub)
    pr = sub.add_parser(
        "profile", help="measure step latencies (every TP degree) through the cluster's workers"
    )
    _measurement_args(pr)
    pr.add_argument("--gen-len", type=int, default=None, help="output window; default: the model's")
    pr.add_argument(
        "--seq-len", type=int, default=None, help="prompt + output tokens; default: twice gen-len"
    )
    pr.add_argument("--out", default="runs", help="folder for run folders")
    pr.add_argument("--profile-out", default=None, help="where to write the profile JSON")
    pr.add_argument(
        "--dws",
        action="store_true",
        help="instead: fit the DWS cost kernel (ms per cell) from batch-1 probes, dws/cost.py",
    )
    pr.add_argument("--dws-probes", type=int, default=48, help="--dws: probe requests")
    pr.add_argument("--dws-out", default="dws-cost.json", help="--dws: where to write the kernel")
    pr.set_defaults(func=cmd_profile)

    tp = sub.add_parser("train-predictor", help="collect trajectories and train step predictors")
    model_arg(tp)
    tp.add_argument("--out", required=True, help="folder for the trained predictor")
    tp.add_argument("--num", type=int, default=120, help="prompts, each run at every threshold")
    tp.add_argument("--thresholds", type=parse_thresholds, default=(0.5, 0.6, 0.7, 0.8, 0.9))
    tp.add_argument("--runs", default="runs", help="folder for run folders")
    tp.add_argument(
        "--trajectories",
        help="refit from the trajectories.npz of an earlier train-predictor run (no recording)",
    )
    tp.set_defaults(func=cmd_train_predictor)

    tr = sub.add_parser("train-model", help="train the bundled dLLM from scratch")
    tr.add_argument("--out", required=True, help="checkpoint folder to write")
    tr.add_argument("--minutes", type=float, default=60.0, help="wall-clock training budget")
    tr.add_argument("--max-steps", type=int, default=100_000)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--init-from", default=None, help="continue training this checkpoint")
    tr.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    tr.add_argument(
        "--difficulty",
        choices=["narrow", "wide"],
        default="narrow",
        help="number ranges of the generated problems",
    )
    tr.set_defaults(func=cmd_train_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dilaserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dilaserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts with the offline engine")
    model_arg(gen)
    engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); else stdin")
    gen.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="accuracy and steps per request across thresholds")
    model_arg(ev)
    engine_args(ev)
    ev.add_argument("--task", choices=["bundled", "gsm8k"], default="bundled")
    ev.add_argument(
        "--thresholds", type=parse_thresholds, default=(0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
    )
    ev.add_argument("--num", type=int, default=500, help="number of problems")
    ev.add_argument("--max-batch", type=int, default=128)
    ev.add_argument("--block-len", type=int, default=32, help="semi-autoregressive block size")
    ev.add_argument(
        "--data",
        default="../shared/data/eval/gsm8k_test.jsonl",
        help="GSM8K test.jsonl (for --task gsm8k)",
    )
    ev.add_argument("--out", default="runs", help="folder for run folders")
    ev.set_defaults(func=cmd_eval)

    _add_measurement_commands(sub)
    _add_plan_command(sub)
    _add_simulate_command(sub)
    add_serving_commands(sub)
    show_defaults(parser)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dilaserve")
    except PackageNotFoundError:
        return "unknown"


def _one_line(err: BaseException) -> str:
    """An error as one line: its first line, and the last line of a traceback it carries."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _resolve_defaults(args) -> None:
    """MODEL or --model, and the output window the model defaults to."""
    resolve_model(args)
    if getattr(args, "max_tokens", 0) is None and args.command in (
        "generate",
        "eval",
        "serve",
        "run-trace",
    ):
        from dilaserve.models.generation import default_max_tokens

        args.max_tokens = default_max_tokens(args.model)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None) and args.command not in (
        "run-trace",
        "serve",
        "calibrate",
        "profile",
    ):
        import torch

        torch.set_num_threads(args.threads)
    try:
        _resolve_defaults(args)
        args.func(args)
    except (ValueError, FileNotFoundError, KeyError, OSError, RuntimeError) as err:
        if os.environ.get("DILASERVE_DEBUG"):
            raise
        print(f"dilaserve {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
