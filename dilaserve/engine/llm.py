"""Offline facade: `LLM(model_path).generate(prompts, SamplingParams(...))`.

Runs the engine's step loop for a list of prompts with continuous batching (a finished request's
slot is refilled at the next step). A prompt is text (through the chat template, or plain) or a
sequence of token ids, used as they are; a checkpoint without tokenizer.json takes token ids only
and answers with token ids (empty text). Useful for scripts, evaluation and benchmarks; serving
goes through the control plane instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dilaserve.config import BUNDLED_MODEL, EngineConfig, SamplingParams
from dilaserve.engine.engine import Engine
from dilaserve.models.tokenizer import Tokenizer, has_tokenizer
from dilaserve.protocol import StepBatch, StepKind, block_offset, window_len
from dilaserve.request import Request

Prompt = str | Sequence[int]  # text, or token ids


@dataclass(frozen=True, slots=True)
class Completion:
    prompt: Prompt
    text: str
    token_ids: tuple[int, ...]
    num_steps: int
    steps_by_kind: dict[str, int]


class LLM:
    def __init__(self, model: str | Path = BUNDLED_MODEL, config: EngineConfig = EngineConfig()):
        self.engine = Engine.from_checkpoint(model, config)
        model_config = self.engine.model.config
        self.tokenizer = Tokenizer(Path(model), model_config) if has_tokenizer(model) else None
        self.special = self.engine.special
        self.config = self.engine.config  # its kv_cache as the model's family resolved it

    def encode_prompt(self, prompt: Prompt, chat: bool) -> list[int]:
        """Text through the tokenizer (and the chat template if `chat`); token ids as given."""
        if not isinstance(prompt, str):
            return self._check_ids(prompt)
        if self.tokenizer is None:
            raise ValueError(
                "this checkpoint has no tokenizer.json: give prompts as token ids (int sequences)"
            )
        return self.tokenizer.encode_chat(prompt) if chat else self.tokenizer.encode(prompt)

    def _check_ids(self, prompt: Sequence[int]) -> list[int]:
        vocab = self.engine.model.config.vocab_size
        ids = list(prompt)
        bad = [
            t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
        ]
        if bad or not ids:
            raise ValueError(
                f"a token-id prompt must be a non-empty sequence of ints in [0, {vocab}); "
                f"got {bad[:3] if bad else 'none'}"
            )
        return ids

    def make_requests(
        self, prompts: list[Prompt], params: SamplingParams, chat: bool = True
    ) -> list[Request]:
        block_len = self.config.block_len
        context = self.engine.model.config.max_sequence_length
        aligned = self.engine.family.is_block_causal  # blocks at absolute positions
        steps = self.engine.decoding.steps_for(
            params.steps or self.config.steps or block_len, params.max_tokens
        )
        requests = []
        for i, prompt in enumerate(prompts):
            ids = tuple(self.encode_prompt(prompt, chat))
            gen_len = window_len(len(ids), params.max_tokens, block_len, aligned)
            if len(ids) + gen_len > context:
                raise ValueError(
                    f"prompt {i} ({len(ids)} tokens) + max_tokens ({gen_len}, whole blocks) "
                    f"exceeds the model's context of {context} tokens"
                )
            requests.append(
                Request(
                    str(i),
                    ids,
                    gen_len,
                    block_len,
                    self.special.mask,
                    params.threshold,
                    block_offset=block_offset(len(ids), block_len, aligned),
                    steps=steps,
                    max_tokens=params.max_tokens,
                    edits=self.engine.decoding.editing is not None,
                    step_budget=self.engine.budget,
                )
            )
        return requests

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams = SamplingParams(),
        chat: bool = True,
        max_batch: int = 64,
        on_step=None,
    ) -> list[Completion]:
        """Each prompt generated to completion; `on_step` as in `run`. One prompt is a string or
        a sequence of token ids; a list of them is many."""
        prompts = _prompt_list(prompts)
        requests = self.make_requests(prompts, params, chat)
        self.run(requests, max_batch, on_step)
        return [self._completion(p, r) for p, r in zip(prompts, requests)]

    def run(self, requests: list[Request], max_batch: int, on_step=None) -> None:
        """Step every request to completion, at most `max_batch` in flight at once.

        `on_step(request, result)` is called after each request's step, if given.
        """
        waiting, active, on_engine = list(reversed(requests)), [], set()
        while waiting or active:
            while waiting and len(active) < max_batch:
                active.append(waiting.pop())
            items = tuple(
                r.step_item(self.config.kv_cache, r.request_id in on_engine) for r in active
            )
            on_engine.update(r.request_id for r in active)
            output = self.engine.execute(StepBatch(items))
            for request, result in zip(active, output.results):
                request.apply(result)
                if on_step is not None:
                    on_step(request, result)
            active = [r for r in active if not r.is_finished]

    def _completion(self, prompt: Prompt, request: Request) -> Completion:
        ids = request.generated_ids(self.special.stop_ids)
        kinds = {StepKind(k).value: n for k, n in request.steps_by_kind.items()}
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else ""
        return Completion(prompt, text, tuple(ids), request.num_steps, kinds)


def _prompt_list(prompts) -> list[Prompt]:
    """A string, or a sequence of token ids (its first item an int), is one prompt."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    return [items] if items and isinstance(items[0], int) else items
