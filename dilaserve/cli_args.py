"""Command-line arguments shared by `cli.py`, `cli_cluster.py` and `cli_serving.py`."""

from __future__ import annotations

import argparse


def model_arg(p: argparse.ArgumentParser) -> None:
    """The checkpoint folder, as a positional MODEL (as vLLM and SGLang take it) or --model."""
    p.add_argument(
        "model_path",
        nargs="?",
        metavar="MODEL",
        help="checkpoint folder (config.json, *.safetensors, tokenizer files); "
        "default: the bundled model",
    )
    p.add_argument("--model", default=None, help="the same as MODEL")


def resolve_model(args: argparse.Namespace) -> None:
    """Set `args.model` from MODEL or --model (the bundled model when neither is given)."""
    from dilaserve.config import BUNDLED_MODEL

    if not hasattr(args, "model_path"):
        return
    given = {m for m in (args.model_path, args.model) if m is not None}
    if len(given) > 1:
        raise ValueError(f"MODEL {args.model_path!r} and --model {args.model!r} differ: give one")
    args.model = given.pop() if given else str(BUNDLED_MODEL)


def precision_args(p: argparse.ArgumentParser) -> None:
    """Where the model runs and in what precision."""
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--device", default="cpu", help="torch device of the model: cpu, cuda, cuda:1, ..."
    )
    p.add_argument(
        "--cuda-graphs",
        type=int,
        default=0,
        metavar="N",
        help="replay CUDA graphs for dual-cache steps of up to N requests (GPU; 0: off)",
    )


def engine_args(
    p: argparse.ArgumentParser, threads: int | None = None, threads_help: str = "torch CPU threads"
) -> None:
    """The engine's options: cache mode, precision and device, the output window, threads."""
    p.add_argument("--kv-cache", choices=["none", "prefix", "dual"], default="dual")
    precision_args(p)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="output window (a request's default when serving), rounded up to whole blocks; "
        "default: the checkpoint's generation_config.json max_new_tokens, else 256",
    )
    p.add_argument("--threads", type=int, default=threads, help=threads_help)


def parse_thresholds(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option of `parser` and its subcommands says its default in --help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)
            continue
        flag = isinstance(action, argparse._StoreTrueAction)
        if action.default is None or action.default == argparse.SUPPRESS or flag:
            continue
        if not action.option_strings:
            continue
        if "%(default)" not in (action.help or ""):
            action.help = f"{action.help or ''} (default: %(default)s)".strip()
