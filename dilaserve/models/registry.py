"""The model registry: a checkpoint's config.json picks its family (`models/family.py`).

`architectures` decides first, `model_type` second. Adding a family is one module (its config
class, model class and `FAMILY`) plus one line in `FAMILIES`. Nothing here runs code from a
checkpoint folder (`auto_map` is never followed) or touches the network.
"""

from __future__ import annotations

import json
from pathlib import Path

from dilaserve.models import dream, llada, llada2
from dilaserve.models.family import ModelFamily
from dilaserve.models.folder import no_config_error

FAMILIES: tuple[ModelFamily, ...] = (
    llada.FAMILY,
    dream.FAMILY,
    llada2.FAMILY,
)


def read_config_json(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise no_config_error(folder) from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return raw


def family_for(raw: dict) -> ModelFamily:
    """The family of a config.json's contents, by `architectures`, then `model_type`."""
    architectures = raw.get("architectures") or []
    for family in FAMILIES:
        if any(a in family.architectures for a in architectures):
            return family
    for family in FAMILIES:
        if raw.get("model_type") in family.model_types:
            return family
    supported = ", ".join(f"{f.architectures[0]} ({f.model_types[0]})" for f in FAMILIES)
    raise ValueError(
        f"config.json: architectures={architectures} and model_type={raw.get('model_type')!r} "
        f"name no supported model family (supported: {supported})"
    )


def config_from_dict(raw: dict):
    return family_for(raw).config_class.from_dict(raw)


def load_config(folder: str | Path):
    """The family config of the checkpoint in `folder` (its config.json, checked)."""
    return config_from_dict(read_config_json(folder))


def family_of(config) -> ModelFamily:
    """The family whose config class `config` is."""
    for family in FAMILIES:
        if isinstance(config, family.config_class):
            return family
    raise TypeError(f"{type(config).__name__} is not the config class of a registered family")
