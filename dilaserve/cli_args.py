"""Command-line arguments shared by `cli.py`, `cli_cluster.py` and `cli_serving.py`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path

from dilaserve.protocol import EosStop

EDITING_CHOICES = ("speed", "quality", "off")  # LLaDA2.1's published modes, or none


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
        help="replay CUDA graphs for cache steps of up to N requests (GPU; 0: off)",
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
    decoding_args(p)


def engine_config(args: argparse.Namespace, **more):
    """The `EngineConfig` that `engine_args`' options describe (`more`: a command's other
    engine fields)."""
    from dilaserve.config import EngineConfig

    return EngineConfig(
        args.kv_cache,
        dtype=args.dtype,
        device=args.device,
        cuda_graphs=args.cuda_graphs,
        eos_stop=args.eos_stop,
        steps=args.steps,
        editing=args.editing,
        step_budget=args.step_budget,
        **more,
    )


def decoding_args(p: argparse.ArgumentParser) -> None:
    """The knobs of a family's published decoding rule (`models/family.py`, DecodingRule)."""
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per block of a family's step schedule (LLaDA2's `steps`); default: the "
        "block length",
    )
    p.add_argument(
        "--step-budget",
        type=int,
        default=None,
        help="tokens a step commits at most, besides the rejections carried over, where a "
        "family decodes the whole window without a cache (Dream's `none`); a divisor of the "
        "block length, default: the block length",
    )
    p.add_argument(
        "--eos-stop",
        choices=[m.value for m in EosStop],
        default=None,
        help="when a request stops before its window is decoded; default: the model family's "
        "published rule (LLaDA2: block; LLaDA, Dream: committed)",
    )
    p.add_argument(
        "--editing",
        choices=EDITING_CHOICES,
        default=None,
        help="token editing (LLaDA2.1's published decoding) in its speed or quality mode, or "
        "off; default: the checkpoint's (speed where config.json's model_type is llada21_moe)",
    )


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


def spec_options(p: argparse.ArgumentParser, cls) -> None:
    """An option for every field of the dataclass `cls` (`field_option`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        field_option(p, f, hints[f.name])


def field_option(p: argparse.ArgumentParser, f: dataclasses.Field, hint) -> None:
    """`--NAME` for the field `f` of type `hint`: its default, the help and argparse keywords
    declared beside it (`config.setting`); a bool is `--NAME/--no-NAME`, a tuple of numbers is
    comma-separated."""
    meta = dict(f.metadata)
    if "help" not in meta:
        raise TypeError(f"field {f.name!r} declares no help (use dilaserve.config.setting)")
    flag = "--" + f.name.replace("_", "-")
    kind = _option_type(hint)
    if kind is bool:
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, **meta)
        return
    p.add_argument(flag, type=kind, default=f.default, **meta)


def _option_type(hint):
    """The argparse type of a field annotated `hint` (X | None takes X's)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [h for h in typing.get_args(hint) if h is not type(None)]
    if typing.get_origin(hint) is tuple:
        return parse_thresholds if typing.get_args(hint)[0] is float else parse_ints
    if hint not in (bool, int, float, str):
        raise TypeError(f"no command-line option for a field of type {hint}")
    return hint


def field_default(cls, name: str):
    """The default of dataclass `cls`'s field `name`: an option that sets the field takes it."""
    return cls.__dataclass_fields__[name].default


def config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="settings from a TOML or JSON file, keyed by option name (kv_cache or kv-cache); "
        "options given on the command line win (docs/configuration.md)",
    )


def read_config_file(path: str | Path) -> dict:
    """A TOML or JSON file's settings, keys with dashes or underscores; lists become tuples."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            raise ValueError(f"{path}: TOML needs Python 3.11 or later; give JSON") from None
        values = tomllib.loads(text)
    else:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not JSON ({err}); TOML files end in .toml") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a table of settings, got {type(values).__name__}")
    return {k.replace("-", "_"): tuple(v) if isinstance(v, list) else v for k, v in values.items()}


def apply_config_file(parser: argparse.ArgumentParser, args, argv) -> argparse.Namespace:
    """`args` re-parsed with the --config file's settings as the command's defaults, so that
    options given on the command line win; an unknown setting is an error naming it."""
    path = getattr(args, "config", None)
    if path is None:
        return args
    _set_defaults(parser, args.command, read_config_file(path), str(path))
    return parser.parse_args(argv)


def command_args(parser: argparse.ArgumentParser, command: str, settings: dict):
    """What `command` parses with no options, `settings` (keyed by option name) in place of
    its defaults: how code builds what a command builds."""
    _set_defaults(parser, command, settings, "settings")
    return parser.parse_args([command])


def _set_defaults(parser, command: str, settings: dict, source: str) -> None:
    sub = _subparser(parser, command)
    known = {a.dest for a in sub._actions} - {"help", "config", "func"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(
            f"{source}: {unknown} are not settings of `{command}`; its settings are {sorted(known)}"
        )
    sub.set_defaults(**settings)


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise ValueError(f"no command {name!r}")


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
