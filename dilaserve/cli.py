"""`dilaserve` command line. Heavy imports happen inside each command."""

from __future__ import annotations

import argparse
import os
import sys

from dilaserve import runs
from dilaserve.cli_args import (
    EDITING_CHOICES,
    apply_config_file,
    engine_args,
    engine_config,
    model_arg,
    parse_ints,
    parse_thresholds,
    precision_args,
    resolve_model,
    show_defaults,
)
from dilaserve.cli_cluster_args import tp_list
from dilaserve.cli_runs import add_run_commands
from dilaserve.cli_serving import add_serving_commands
from dilaserve.cli_sim import add_simulation_commands
from dilaserve.config import DEFAULT_BLOCK_LEN, DEFAULT_THRESHOLD, MEASURED_THRESHOLDS


def cmd_generate(args) -> None:
    from dilaserve.config import SamplingParams
    from dilaserve.engine.llm import LLM

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("give --prompt TEXT (repeatable) or prompts on standard input")
    llm = LLM(args.model, engine_config(args))
    params = SamplingParams(threshold=args.threshold, max_tokens=args.max_tokens)
    for out in llm.generate(prompts, params, chat=not args.raw):
        print(
            f"### {out.prompt}\n{out.text}\n[{out.num_steps} steps, "
            f"{len(out.token_ids)} tokens, {out.steps_by_kind}]"
        )


def cmd_eval(args) -> None:
    from dataclasses import fields

    from dilaserve.tasks.evaluate import EvalConfig, evaluate

    given = {f.name: getattr(args, f.name) for f in fields(EvalConfig) if hasattr(args, f.name)}
    evaluate(EvalConfig(**given, num_problems=args.num))


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
        arch=args.arch,
        batch_size=args.batch_size,
        threads=args.threads,
    )
    path = train(cfg)
    print(f"checkpoint written to {path}")


def cmd_random_checkpoint(args) -> None:
    from dilaserve.training.random_checkpoint import write_random_checkpoint

    path = write_random_checkpoint(args.family, args.dir, args.seed)
    print(f"random-weight {args.family} checkpoint written to {path}")


def cmd_profile(args) -> None:
    if args.dws:
        from dilaserve.dws.profile import DWSProfileConfig, profile_dws
        from dilaserve.models.generation import default_max_tokens

        profile_dws(
            DWSProfileConfig(
                model=args.model,
                num_probes=args.dws_probes,
                gen_len=args.gen_len or default_max_tokens(args.model),
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


def _measurement_args(p) -> None:
    """What `calibrate` and `profile` measure with."""
    model_arg(p)
    precision_args(p)
    p.add_argument("--tp", type=tp_list, default=(1,), help="TP degrees to measure, e.g. 1,2,4")
    p.add_argument(
        "--requests",
        type=parse_ints,
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
    ca.add_argument("--thresholds", type=parse_thresholds, default=MEASURED_THRESHOLDS)
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
    ca.add_argument(
        "--editing",
        choices=EDITING_CHOICES,
        default=None,
        help="token editing while the step predictor's trajectories are recorded, so that it "
        "learns the edit-only steps (serve with the same mode); default: the checkpoint's",
    )
    ca.add_argument(
        "--strict",
        action="store_true",
        help="exit 2 when the step predictor's held-out error is implausible (over 35.1%%), "
        "instead of warning",
    )
    ca.set_defaults(func=cmd_calibrate)


def _add_measurement_commands(sub) -> None:
    """calibrate, profile, train-predictor, train-model and random-checkpoint."""
    _add_calibrate_command(sub)
    _add_profile_command(sub)
    _add_training_commands(sub)
    _add_random_checkpoint_command(sub)


def _add_profile_command(sub) -> None:
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


def _add_training_commands(sub) -> None:
    tp = sub.add_parser("train-predictor", help="collect trajectories and train step predictors")
    model_arg(tp)
    tp.add_argument("--out", required=True, help="folder for the trained predictor")
    tp.add_argument("--num", type=int, default=120, help="prompts, each run at every threshold")
    tp.add_argument("--thresholds", type=parse_thresholds, default=MEASURED_THRESHOLDS)
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
    tr.add_argument(
        "--arch",
        choices=["llada", "llada2"],
        default="llada",
        help="model family: llada (bidirectional) or llada2 (block-causal MoE, block diffusion)",
    )
    tr.add_argument("--batch-size", type=int, default=64, help="problems per step")
    tr.add_argument(
        "--threads", type=int, default=2, help="torch threads (1 on a CPU shared with others)"
    )
    tr.set_defaults(func=cmd_train_model)


def _add_random_checkpoint_command(sub) -> None:
    rc = sub.add_parser(
        "random-checkpoint",
        help="write a tiny random-weight checkpoint in a family's published layout (for tests)",
    )
    rc.add_argument("family", choices=["llada", "dream", "llada2", "llada2.1"], help="model family")
    rc.add_argument("dir", help="folder to write (new or empty)")
    rc.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    rc.set_defaults(func=cmd_random_checkpoint)


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
    ev.add_argument(
        "--block-len", type=int, default=DEFAULT_BLOCK_LEN, help="semi-autoregressive block size"
    )
    ev.add_argument(
        "--data",
        default="../shared/data/eval/gsm8k_test.jsonl",
        help="GSM8K test.jsonl (for --task gsm8k)",
    )
    ev.add_argument("--out", default="runs", help="folder for run folders")
    keep = "also keep the accuracy per threshold as the model's quality curve (serve's budget)"
    ev.add_argument("--keep-curve", action="store_true", help=keep)
    ev.set_defaults(func=cmd_eval)

    _add_measurement_commands(sub)
    add_simulation_commands(sub)
    add_serving_commands(sub)
    add_run_commands(sub)
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


def _set_threads(args) -> None:
    """Torch's CPU threads for the commands that run a model in this process."""
    if getattr(args, "threads", None) and args.command not in (
        "run-trace",
        "serve",
        "calibrate",
        "profile",
    ):
        import torch

        torch.set_num_threads(args.threads)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    runs.loaded_from()  # the checkout as the command starts, which its run folder records
    try:
        args = apply_config_file(parser, args, argv)
        _set_threads(args)
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
