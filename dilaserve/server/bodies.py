"""Request bodies as the API reads them: json's parser, then the pydantic schema, each failure
a `RequestValidationError` whose first error names the field (`param`); and the OpenAPI
description of a body a handler parses itself. Nothing here answers a request (`app.py`)."""

from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from dilaserve.server.schemas import ChatCompletionRequest

INLINE_BODY_BYTES = 64 * 1024  # larger bodies are parsed and validated off the event loop
# a chat's bytes may hold a few "role" keys besides its messages' (tool schemas); past this
# many per message allowed it is refused unparsed
ROLE_KEYS_PER_MESSAGE = 2


def body_docs(schema: type[BaseModel]) -> dict:
    """The OpenAPI description of a body the handler parses itself (`GenerationApi.parse`)."""
    described = schema.model_json_schema()
    definitions = described.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(definitions[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        return [inline(item) for item in node] if isinstance(node, list) else node

    content = {"application/json": {"schema": inline(described)}}
    return {"requestBody": {"required": True, "content": content}}


def validated(schema: type[BaseModel], raw: bytes, max_messages: int):
    """`raw` as `schema` (json's parser, not pydantic's: that one refuses a lone surrogate as
    invalid JSON, where the 400 should name the field holding it). A chat whose bytes hold
    far more `"role"` keys than `max_messages` allows is refused before it is parsed: parsing
    25,000 empty messages holds the interpreter (and so every other request) for tens of ms."""
    roles = raw.count(b'"role"') if schema is ChatCompletionRequest else 0
    if roles > ROLE_KEYS_PER_MESSAGE * max_messages:
        message = f"a chat of about {roles} messages; at most {max_messages}"
        raise RequestValidationError([{"loc": ("messages",), "msg": message}])
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the stack
        raise RequestValidationError([{"type": "json_invalid", "loc": (), "msg": ""}]) from None
    try:
        return schema.model_validate(data, context={"max_messages": max_messages})
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


def param_of(loc) -> str | None:
    """The field a validation error's location names: `messages.0.content`, without the body
    and pydantic's tags of union members (`str`, `list[int]`, ...)."""
    names = [str(p) for p in loc if p != "body" and not _is_type_tag(p)]
    return ".".join(names) or None


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "dict", "list") or "[" in part
    )
