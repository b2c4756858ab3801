"""Request bodies of the OpenAI-compatible API, with dilaserve's extension fields.

Fields OpenAI clients commonly send that do not apply to a diffusion model's step-level
decoding (temperature, top_p, stop, user, ...) are accepted and ignored, so existing clients
work unchanged. Extension fields:

- `slo_ms`: the latency SLO in milliseconds from submission, or `deadline`: a Unix time in
  seconds; default: the server's `--slo`;
- `priority`: higher is served first under load (default 0);
- `threshold`: a fixed confidence threshold, or `min_threshold` / `max_threshold`: bounds on the
  one the policy picks;
- `max_tokens` is the output window, rounded up to a whole number of blocks (32 tokens).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Generation(BaseModel):
    model_config = ConfigDict(extra="ignore")

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

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Generation):
    prompt: str | list[int] = Field(min_length=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict]

    def text(self) -> str:
        """The message's text; content parts other than text are refused upstream."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def window(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
