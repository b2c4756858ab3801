"""Request bodies of the OpenAI-compatible API, with dilaserve's extension fields.

`stop` (a string, or up to 4, each at most 256 characters) ends the answer before the first of
them; the request stops being worked on once one is committed. Sampling fields OpenAI clients
commonly send that do not apply to confidence-threshold decoding (temperature, top_p,
presence/frequency penalties, seed, user) are checked for their type and range and then
ignored, so existing clients work unchanged; other unknown fields are ignored. Fields asking
for what this server cannot give (`logprobs` or `top_logprobs` with any value but null/false,
0 included, `echo`, `best_of` above 1, `suffix`) get a 400 naming them, rather than a silently
different answer. Types are strict: `"0.5"` is not a number, `1.0` not an integer, `true` not
either. A chat's messages have a role of system, user, assistant or tool (anything else, a
template's special tokens included, is refused) and number at most `max_messages` (the server's
setting, passed as validation context; default `MAX_MESSAGES`). Extension fields:

- `slo_ms`: the latency SLO in milliseconds from submission, or `deadline`: a Unix time in
  seconds; default: the server's `--slo`;
- `priority`: higher is served first under load (default 0);
- `threshold`: a fixed confidence threshold, or `min_threshold` / `max_threshold`: bounds on the
  one the policy picks;
- `max_tokens` is the output window, rounded up to a whole number of blocks (32 tokens);
- `steps`: steps per block of the model family's step schedule (LLaDA2's `steps`, a positive
  integer; default: the server's `--steps`, else the block length); a model whose decoding
  rule has no step schedule refuses it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator

MAX_MESSAGES = 1024  # a chat's messages, unless the server says otherwise
ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates know


def _valid_unicode(value):
    """Text must be valid Unicode: JSON can spell a lone surrogate ("\\ud800"), which no
    tokenizer (nor UTF-8) takes."""
    texts = value if isinstance(value, list) else [value]
    for text in texts:
        text = text.get("text") if isinstance(text, dict) else text
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("text holds a lone surrogate (not valid Unicode)") from None
    return value


class _Generation(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1, le=1)
    slo_ms: float | None = Field(None, gt=0)
    deadline: float | None = None
    priority: int = 0
    threshold: float | None = Field(None, gt=0, le=1)
    min_threshold: float | None = Field(None, gt=0, le=1)
    max_threshold: float | None = Field(None, gt=0, le=1)
    steps: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    # accepted, checked and ignored (see the module's docstring)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    _unicode = field_validator("model", "stop")(_valid_unicode)

    def unsupported(self) -> str | None:
        """The first field asking for what this server cannot give, if any."""
        return next((name for name in _UNSUPPORTED if _asks(getattr(self, name, None))), None)


_UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix")  # each refused when set


def _asks(value) -> bool:
    """Does a field's value ask for something? Any value but null and false does: `logprobs: 0`
    asks for the chosen tokens' log-probabilities."""
    return value is not None and value is not False


class CompletionRequest(_Generation):
    prompt: str | list[StrictInt] = Field(min_length=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int = Field(1, ge=1, le=1)

    _unicode_prompt = field_validator("prompt")(_valid_unicode)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and any(isinstance(item, str) for item in value):
            raise ValueError("one prompt per request (a list of strings is several prompts)")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal[ROLES]
    content: str | list[dict]

    _unicode = field_validator("content")(_valid_unicode)

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        for part in content if isinstance(content, list) else ():
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type")
                raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
        return content

    def text(self) -> str:
        """The message's text (its text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @field_validator("messages", mode="before")
    @classmethod
    def _not_too_many(cls, messages, info: ValidationInfo):
        """Refused before each message is validated (templating 25,000 took seconds)."""
        limit = (info.context or {}).get("max_messages", MAX_MESSAGES)
        if isinstance(messages, list) and len(messages) > limit:
            raise ValueError(f"a chat of {len(messages)} messages; at most {limit}")
        return messages

    @property
    def window(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
