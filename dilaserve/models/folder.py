"""The error for a checkpoint folder without a config.json, with a hint when the name given is
a Hugging Face model id (`org/name`) rather than a folder: dilaserve never downloads. No torch."""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def no_config_error(folder: str | Path) -> FileNotFoundError:
    """What to raise when `folder` has no config.json."""
    text = str(folder)
    message = f"no config.json in checkpoint folder {text}"
    if HUB_ID.fullmatch(text) and not Path(text).exists():
        name = text.split("/")[1]
        message += (
            f"; {text} looks like a Hugging Face model id, and dilaserve never downloads: "
            f"download it first (e.g. huggingface-cli download {text} --local-dir "
            f"~/models/{name}) and give that folder"
        )
    return FileNotFoundError(message)
