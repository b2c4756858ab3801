"""Command-line arguments shared by `cli.py` and `cli_serving.py`."""

from __future__ import annotations

import argparse


def model_arg(p: argparse.ArgumentParser) -> None:
    from dilaserve.config import BUNDLED_MODEL

    p.add_argument(
        "--model",
        default=str(BUNDLED_MODEL),
        help="checkpoint folder (config.json, *.safetensors, tokenizer files); "
        "default: the bundled model",
    )


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


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache", choices=["none", "prefix", "dual"], default="dual")
    precision_args(p)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="output window; rounded up to a multiple of the block size",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def parse_thresholds(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
