"""A checkpoint's generation defaults, from its `generation_config.json`.

Only `max_new_tokens` is read: the output window a request gets when it names none. (Hugging
Face's `max_length` counts the prompt too, so it says nothing about the window.) Without one,
`DEFAULT_MAX_TOKENS` (256: LLaDA's own examples use 256-1024).
"""

from __future__ import annotations

import json
from pathlib import Path

GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_TOKENS = 256


def default_max_tokens(model: str | Path) -> int:
    path = Path(model) / GENERATION_CONFIG
    if not path.is_file():
        return DEFAULT_MAX_TOKENS
    try:
        value = json.loads(path.read_text()).get("max_new_tokens")
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{path} is not a JSON object") from None
    if value is None:
        return DEFAULT_MAX_TOKENS
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{path}: max_new_tokens={value!r} must be a positive integer")
    return value
