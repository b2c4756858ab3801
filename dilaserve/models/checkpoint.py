"""Load and save checkpoints in the Hugging Face layout (config.json + safetensors shards).

A folder holds `config.json`, either `model.safetensors` or shards with a
`model.safetensors.index.json` weight map, and the tokenizer files. config.json picks the model
family (`models/registry.py`). Loading checks every key and shape against the architecture and
names the offending key when one is missing, unexpected or the wrong shape. Each parameter takes
its own tensor-parallel shard (`load_full`); a key another rank holds (a routed expert) is
skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dilaserve.models import registry
from dilaserve.models.layers import TPGroup

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class CheckpointError(ValueError):
    """A checkpoint folder does not match the architecture; the message names the key."""


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / INDEX_FILE
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = folder / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"no {INDEX_FILE} or {SINGLE_FILE} in {folder}")
    with safe_open(str(single), framework="pt") as f:
        return {key: SINGLE_FILE for key in f.keys()}


def _module_for(model: torch.nn.Module, key: str):
    """The module that loads checkpoint `key`, and the name it knows it by: the key's owner and
    last part, or the nearest owner that loads the rest of the key itself (stacked experts), or
    a child of that owner that does (merged projections: `q_proj.weight` of a block)."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            module = model.get_submodule(".".join(parts[:cut]))
        except AttributeError:
            continue
        rest = ".".join(parts[cut:])
        if rest in getattr(module, "full_shapes", {}):
            return module, rest
        for child in module.children():
            if rest in getattr(child, "full_shapes", {}):
                return child, rest
        return module, rest
    return model, key


def check_device(device: str) -> None:
    """A clear error for a device string torch cannot use here."""
    try:
        kind = torch.device(device).type
    except RuntimeError as err:
        raise ValueError(f"device {device!r} is not a torch device ({err})") from None
    if kind == "cuda" and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = "here" if visible is None else f"with CUDA_VISIBLE_DEVICES={visible!r}"
        raise ValueError(f"device {device!r}: torch {torch.__version__} sees no CUDA GPU {where}")


def load_model(
    folder: str | Path,
    dtype: str | torch.dtype = "float32",
    tp: TPGroup = TPGroup(),
    device: str = "cpu",
) -> torch.nn.Module:
    """The model of the checkpoint in `folder` (its family from config.json), this rank's
    shard of it, in `dtype` on `device`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    check_device(device)
    cfg = registry.load_config(folder)
    with torch.device("meta"):
        model = registry.family_of(cfg).model_class(cfg, tp)
    model = model.to_empty(device=device)
    model.reset_buffers()
    expected = set(model.state_dict())
    weight_map = _weight_map(folder)
    held_elsewhere = getattr(model, "is_held_elsewhere", lambda key: False)
    weight_map = {k: f for k, f in weight_map.items() if not held_elsewhere(k)}
    missing = sorted(expected - set(weight_map))
    unexpected = sorted(set(weight_map) - expected)
    if missing:
        raise CheckpointError(
            f"checkpoint {folder} is missing weight {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    if unexpected:
        raise CheckpointError(f"checkpoint {folder} has unexpected weight {unexpected[0]!r}")
    by_file: dict[str, list[str]] = {}
    for key, fname in weight_map.items():
        by_file.setdefault(fname, []).append(key)
    for fname, keys in by_file.items():
        path = folder / fname
        if not path.exists():
            raise CheckpointError(f"shard {fname} named in {INDEX_FILE} is not in {folder}")
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                _load_param(model, key, f.get_tensor(key))
    target = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    return model.to(target).eval()


def _load_param(model: torch.nn.Module, key: str, tensor: torch.Tensor) -> None:
    module, attr = _module_for(model, key)
    expected = tuple(module.full_shapes[attr])
    if tuple(tensor.shape) != expected:
        raise CheckpointError(
            f"weight {key!r} has shape {tuple(tensor.shape)}, expected {expected}"
        )
    with torch.no_grad():
        module.load_full(tensor.float(), attr)


def save_checkpoint(
    model: torch.nn.Module,
    folder: str | Path,
    num_shards: int = 1,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write config.json and weights; with num_shards > 1, shards plus the index file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if num_shards == 1:
        save_file(state, str(folder / SINGLE_FILE), metadata={"format": "pt"})
        return
    keys = list(state)
    weight_map, total = {}, 0
    for i in range(num_shards):
        name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i::num_shards]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
