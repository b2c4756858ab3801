"""Chat templates rendered as Hugging Face's `apply_chat_template` renders them.

Published chat templates are written for the Jinja environment of `transformers`: a sandbox
with `trim_blocks` and `lstrip_blocks`, loop controls (`{% break %}`, `{% continue %}`), a
`tojson` filter that is `json.dumps` (no HTML escaping of `<`, `>`, `&` or `'`, non-ASCII kept),
`raise_exception(message)`, `strftime_now(format)`, and the tokenizer's special tokens by name
(`bos_token`, `eos_token`, ...). This module builds that environment; it knows nothing of
tokenizers or models (`models/tokenizer.py` reads the template and its special tokens).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import Template, TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


def compile_chat_template(text: str) -> Template:
    """The template, compiled once (compiling took ~2 ms, too much for every request)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", GenerationBlock],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(text)
    except TemplateError as err:
        raise ValueError(f"chat template does not compile: {err}") from None


def render(template: Template, messages: list[dict], **context) -> str:
    """`messages` through `template`, with `context` (special tokens, `tools`, ...) beside them.
    A template's own `raise_exception` or a render error is a ValueError naming the template."""
    try:
        return template.render(messages=messages, **context)
    except TemplateError as err:
        raise ValueError(f"chat template: {err}") from None


def template_text(config: dict, folder: Path) -> str:
    """tokenizer_config.json's `chat_template` (a string, or a list of named templates:
    "default"), else the folder's chat_template.jinja, as Hugging Face reads them."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = Path(folder) / "chat_template.jinja"
    if not template and jinja_file.is_file():
        template = jinja_file.read_text()
    if not template:
        raise ValueError(
            "this checkpoint has no chat template (tokenizer_config.json's chat_template "
            "or chat_template.jinja)"
        )
    return template


def special_tokens(config: dict) -> dict[str, str]:
    """tokenizer_config.json's special tokens by name (`bos_token`, `eos_token`, `pad_token`,
    ...; a token may be written as a string or as an added-token object with `content`)."""
    tokens = {}
    for name, value in config.items():
        if isinstance(value, dict):
            value = value.get("content")
        if name.endswith("_token") and isinstance(value, str):
            tokens[name] = value
    return tokens


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """`json.dumps`, as the templates expect: Jinja's own `tojson` escapes `<`, `>`, `&` and `'`
    for HTML, which changes what the model is shown."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def raise_exception(message: str):
    """What templates call on a conversation they refuse (roles out of order, ...)."""
    raise TemplateError(message)


def strftime_now(format: str) -> str:
    """Today's date or time, for templates that write it into the system prompt."""
    return datetime.now().strftime(format)


class GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`, with which a template marks the assistant's
    text for training masks; rendering keeps the text as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)
