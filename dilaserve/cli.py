"""`dilaserve` command line. Heavy imports happen inside each command."""

from __future__ import annotations

import argparse
import sys

from dilaserve.config import DEFAULT_THRESHOLD


def _model_arg(p: argparse.ArgumentParser) -> None:
    from dilaserve.engine.llm import BUNDLED_MODEL

    p.add_argument(
        "--model",
        default=str(BUNDLED_MODEL),
        help="checkpoint folder (config.json, *.safetensors, tokenizer files); "
        "default: the bundled model",
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache", choices=["none", "prefix", "dual"], default="dual")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="output window; rounded up to a multiple of the block size",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _thresholds(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--thresholds: not a list of numbers: {text!r}") from None


def cmd_generate(args) -> None:
    from dilaserve.config import EngineConfig, SamplingParams
    from dilaserve.engine.llm import LLM

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("give --prompt TEXT (repeatable) or prompts on standard input")
    llm = LLM(args.model, EngineConfig(kv_cache=args.kv_cache, dtype=args.dtype))
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
    from dilaserve.engine.profiling import ProfileConfig, profile

    requests = tuple(int(n) for n in args.requests.split(","))
    profile(
        ProfileConfig(
            model=args.model,
            seq_len=args.seq_len,
            gen_len=args.gen_len,
            requests=requests,
            repeats=args.repeats,
            dtype=args.dtype,
            out=args.out,
            profile_out=args.profile_out,
        )
    )


def cmd_train_predictor(args) -> None:
    from dilaserve.training.train_predictor import PredictorConfig, train_predictor

    train_predictor(
        PredictorConfig(
            model=args.model,
            out=args.out,
            num_prompts=args.num,
            thresholds=args.thresholds,
            runs=args.runs,
        )
    )


def _add_measurement_commands(sub) -> None:
    """profile, train-predictor and train-model."""
    pr = sub.add_parser("profile", help="measure step latencies on this machine's engine")
    _model_arg(pr)
    pr.add_argument("--seq-len", type=int, default=128, help="prompt + output tokens per request")
    pr.add_argument("--gen-len", type=int, default=64)
    pr.add_argument("--requests", default="1,2,4,8,16,32,64,128", help="batch sizes to measure")
    pr.add_argument("--repeats", type=int, default=3)
    pr.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    pr.add_argument("--out", default="runs", help="folder for run folders")
    pr.add_argument("--profile-out", default=None, help="where to write the profile JSON")
    pr.set_defaults(func=cmd_profile)

    tp = sub.add_parser("train-predictor", help="collect trajectories and train step predictors")
    _model_arg(tp)
    tp.add_argument("--out", required=True, help="folder for the trained predictor")
    tp.add_argument("--num", type=int, default=120, help="prompts, each run at every threshold")
    tp.add_argument("--thresholds", type=_thresholds, default=(0.5, 0.6, 0.7, 0.8, 0.9))
    tp.add_argument("--runs", default="runs", help="folder for run folders")
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
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts with the offline engine")
    _model_arg(gen)
    _engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); else stdin")
    gen.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="accuracy and steps per request across thresholds")
    _model_arg(ev)
    _engine_args(ev)
    ev.add_argument("--task", choices=["bundled", "gsm8k"], default="bundled")
    ev.add_argument("--thresholds", type=_thresholds, default=(0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0))
    ev.add_argument("--num", type=int, default=500, help="number of problems")
    ev.add_argument("--max-batch", type=int, default=128)
    ev.add_argument(
        "--data",
        default="../shared/data/eval/gsm8k_test.jsonl",
        help="GSM8K test.jsonl (for --task gsm8k)",
    )
    ev.add_argument("--out", default="runs", help="folder for run folders")
    ev.set_defaults(func=cmd_eval)

    _add_measurement_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"dilaserve {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
