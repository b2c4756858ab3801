"""A submission checked before it is queued: prompt ids (through the chat template or plain),
the output window in whole blocks within the model's context (ending on an absolute block
boundary where blocks sit at absolute positions; the answer is cut to max_tokens), the steps
per block of a family's step schedule, threshold bounds, the SLO, stop
strings, and DWS's expected cost and step prior. Every check raises `InvalidRequest` naming the
argument, so one bad request is refused alone; `Cluster.submit` then queues what passed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dilaserve.cluster.requests import InvalidRequest
from dilaserve.config import DEFAULT_THRESHOLD
from dilaserve.models.family import DecodingRule
from dilaserve.protocol import block_offset, window_len
from dilaserve.request import Request

INLINE_PROMPT_CHARS = 4096  # a prompt this short is checked on the caller's thread (`is_cheap`)


@dataclass(frozen=True)
class Submission:
    """A checked submission; `request` makes it a `Request` once it has an id and a time."""

    prompt_ids: tuple[int, ...]
    gen_len: int
    slo: float | None
    priority: int
    bounds: tuple[float, float] | None
    cost: float | None  # DWS's expected cost (None without DWS)
    prior_steps: dict[float, float] | None  # DWS's expected steps, when the prior is on
    stop: tuple[str, ...] = ()  # the answer ends before the first of these strings
    max_tokens: int | None = None  # the answer's length at most (None: the whole window)
    steps: int | None = None  # steps per block of the family's step schedule
    edits: bool = False  # the family's rule edits committed tokens (token editing)
    step_budget: int | None = None  # a whole-window rule's budget a step (Dream `none`)

    def request(
        self, request_id: str, submitted: float, block_len: int, mask_id: int, aligned: bool = False
    ) -> Request:
        """`aligned`: the model's blocks start at absolute positions (block diffusion)."""
        return Request(
            request_id,
            self.prompt_ids,
            self.gen_len,
            block_len,
            mask_id,
            DEFAULT_THRESHOLD,  # the policy sets it before the first step
            deadline=None if self.slo is None else submitted + self.slo,
            priority=self.priority,
            threshold_bounds=self.bounds,
            cost=self.cost,
            prior_steps=self.prior_steps,
            block_offset=block_offset(len(self.prompt_ids), block_len, aligned),
            steps=self.steps,
            max_tokens=self.max_tokens,
            edits=self.edits,
            step_budget=self.step_budget,
            slo=self.slo,
        )


@dataclass(frozen=True)
class Intake:
    tokenizer: object  # models.tokenizer.Tokenizer
    block_len: int
    context: int  # the model's maximum sequence length
    default_max_tokens: int  # the output window of requests that name none
    vocab_size: int  # token ids a prompt may hold: 0 .. vocab_size - 1
    dws: object | None = None  # dws.estimate.DWSEstimator
    dws_prior: bool = False  # pass DWS's expected steps on as the step predictor's prior
    max_token_chars: int = 64  # characters of the longest token: bounds a prompt's text cheaply
    aligned: bool = False  # blocks at absolute positions (block diffusion)
    decoding: DecodingRule = DecodingRule()  # the model family's, as the engines run it
    engine_steps: int | None = None  # EngineConfig.steps
    step_budget: int | None = None  # the engines' whole-window budget (`DecodingRule.budget_for`)

    def is_cheap(self, prompt: str | list[int]) -> bool:
        """Whether `check` of `prompt` costs less than a hop to another thread: a short prompt
        (at most `INLINE_PROMPT_CHARS` characters or token ids) and no DWS encoder to run."""
        return self.dws is None and len(prompt) <= INLINE_PROMPT_CHARS

    @property
    def max_prompt_chars(self) -> int:
        """Text longer than this cannot fit the context, whatever it tokenizes to."""
        return self.context * self.max_token_chars

    def check_text_length(self, chars: int, param: str = "prompt") -> None:
        """Refuse text that cannot fit the context, before anything tokenizes it."""
        if chars > self.max_prompt_chars:
            raise InvalidRequest(
                param,
                f"{param} of {chars} characters cannot fit the model's context of "
                f"{self.context} tokens (at most {self.max_prompt_chars} characters)",
            )

    def check(
        self,
        prompt: str | list[int],
        max_tokens: int | None,
        slo: float | None,
        priority: int,
        chat: bool,
        threshold: float | None,
        min_threshold: float | None,
        max_threshold: float | None,
        text: str | None,
        stop: str | Sequence[str] | None = None,
        steps: int | None = None,
    ) -> Submission:
        """See `Cluster.submit` for the arguments."""
        bounds = threshold_bounds(threshold, min_threshold, max_threshold)
        stop = stop_strings(stop)
        ids = self._prompt_ids(prompt, chat)
        max_tokens = max_tokens if max_tokens is not None else self.default_max_tokens
        gen_len = self._window(max_tokens, len(ids))
        steps = self.decoding.steps_for(
            self._steps(steps) or self.engine_steps or self.block_len, max_tokens
        )
        if slo is not None and not slo > 0:  # (NaN is not)
            raise InvalidRequest("slo", f"slo={slo} must be positive")
        if not isinstance(priority, int) or not PRIORITIES[0] <= priority <= PRIORITIES[1]:
            raise InvalidRequest(
                "priority", f"priority={priority} must be an integer in {list(PRIORITIES)}"
            )
        cost, prior = self._estimate(
            text or (prompt if isinstance(prompt, str) else None), ids, gen_len, steps
        )
        prior = prior if self.dws_prior else None
        return Submission(
            tuple(ids),
            gen_len,
            slo,
            priority,
            bounds,
            cost,
            prior,
            stop,
            max_tokens,
            steps,
            self.decoding.editing is not None,
            self.step_budget,
        )

    def _steps(self, steps: int | None) -> int | None:
        """A request's own steps per block, refused unless a positive integer for a family
        with a step schedule."""
        if steps is None:
            return None
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InvalidRequest("steps", f"steps={steps!r} must be a positive integer")
        if not self.decoding.step_schedule:
            raise InvalidRequest(
                "steps", "steps: this model's decoding rule has no per-block step schedule"
            )
        return steps

    def _prompt_ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            self.check_text_length(len(prompt))
            ids = self.tokenizer.encode_chat(prompt) if chat else self.tokenizer.encode(prompt)
        else:
            if len(prompt) > self.context:
                message = f"prompt of {len(prompt)} tokens exceeds the context of {self.context}"
                raise InvalidRequest("prompt", message)
            ids = [int(i) for i in prompt]
            bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
            if bad is not None:  # the model could not read it, and its whole batch would fail
                raise InvalidRequest(
                    "prompt",
                    f"prompt token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1})",
                )
        if not ids:
            raise InvalidRequest("prompt", "prompt is empty")
        if self.tokenizer.special.mask in ids:  # (text can spell it too) not a prompt token
            raise InvalidRequest(
                "prompt", f"the prompt holds the mask token (id {self.tokenizer.special.mask})"
            )
        return ids

    def _window(self, window: int, prompt_tokens: int) -> int:
        """The output window for `max_tokens` (`protocol.window_len`), within the context."""
        if window <= 0:
            raise InvalidRequest("max_tokens", f"max_tokens={window} must be positive")
        gen_len = window_len(prompt_tokens, window, self.block_len, self.aligned)
        if gen_len >= self.context:
            raise InvalidRequest(
                "max_tokens",
                f"max_tokens={window} leaves no room in a context of {self.context} tokens",
            )
        if prompt_tokens + gen_len > self.context:
            raise InvalidRequest(
                "prompt",
                f"prompt ({prompt_tokens} tokens) + max_tokens ({gen_len}, whole blocks) exceeds "
                f"the model's context of {self.context} tokens",
            )
        return gen_len

    def _estimate(self, text: str | None, ids: list[int], gen_len: int, steps: int | None):
        """DWS's expected cost and step prior for a new request (None, None without DWS),
        under its steps per block and the family's token editing."""
        if self.dws is None or text is None:
            return None, None
        edits = self.decoding.editing is not None
        return self.dws.estimate([text], [len(ids)], gen_len, steps, edits)[0]


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest token the tokenizer can decode to (special tokens aside)."""
    return max((len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size)), default=1)


def threshold_bounds(
    threshold: float | None, lo: float | None, hi: float | None
) -> tuple[float, float] | None:
    """A fixed `threshold` or bounds (`lo`, `hi`) as the request's (low, high); None: any."""
    for name, value in (("threshold", threshold), ("min_threshold", lo), ("max_threshold", hi)):
        if value is not None and not 0 < value <= 1:
            raise InvalidRequest(name, f"{name}={value} must be in (0, 1]")
    if threshold is not None:
        return (threshold, threshold)
    if lo is None and hi is None:
        return None
    lo, hi = lo or 1e-6, hi or 1.0
    if lo > hi:
        raise InvalidRequest("min_threshold", f"min_threshold={lo} exceeds max_threshold={hi}")
    return (lo, hi)


MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256  # each; a stream checks every suffix of its text up to this length
PRIORITIES = (-(2**31), 2**31 - 1)  # the range a priority may take (32-bit, as a float exactly)


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """A request's stop strings: one string, or up to `MAX_STOP_STRINGS`, none empty or longer
    than `MAX_STOP_CHARS`."""
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(strings) > MAX_STOP_STRINGS:
        raise InvalidRequest("stop", f"stop has {len(strings)} strings; at most {MAX_STOP_STRINGS}")
    if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in strings):
        raise InvalidRequest("stop", f"stop strings must be strings of 1 to {MAX_STOP_CHARS} chars")
    return strings
