"""Offline facade: `LLM(model_path).generate(prompts, SamplingParams(...))`.

Runs the engine's step loop for a list of prompts with continuous batching (a finished request's
slot is refilled at the next step). Useful for scripts, evaluation and benchmarks; serving goes
through the control plane instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dilaserve.config import BUNDLED_MODEL, EngineConfig, SamplingParams
from dilaserve.engine.engine import Engine
from dilaserve.models.tokenizer import Tokenizer
from dilaserve.protocol import StepBatch, StepKind, block_offset
from dilaserve.request import Request


@dataclass(frozen=True, slots=True)
class Completion:
    prompt: str
    text: str
    token_ids: tuple[int, ...]
    num_steps: int
    steps_by_kind: dict[str, int]


class LLM:
    def __init__(self, model: str | Path = BUNDLED_MODEL, config: EngineConfig = EngineConfig()):
        self.engine = Engine.from_checkpoint(model, config)
        self.tokenizer = Tokenizer(Path(model), self.engine.model.config)
        self.config = self.engine.config  # its kv_cache as the model's family resolved it

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        return self.tokenizer.encode_chat(prompt) if chat else self.tokenizer.encode(prompt)

    def make_requests(
        self, prompts: list[str], params: SamplingParams, chat: bool = True
    ) -> list[Request]:
        gen_len = params.gen_len(self.config.block_len)
        context = self.engine.model.config.max_sequence_length
        mask = self.tokenizer.special.mask
        aligned = self.engine.family.is_block_causal  # blocks at absolute positions
        requests = []
        for i, prompt in enumerate(prompts):
            ids = tuple(self.encode_prompt(prompt, chat))
            if len(ids) + gen_len > context:
                raise ValueError(
                    f"prompt {i} ({len(ids)} tokens) + max_tokens ({gen_len}, whole blocks) "
                    f"exceeds the model's context of {context} tokens"
                )
            offset = block_offset(len(ids), self.config.block_len, aligned)
            requests.append(
                Request(
                    str(i),
                    ids,
                    gen_len,
                    self.config.block_len,
                    mask,
                    params.threshold,
                    block_offset=offset,
                )
            )
        return requests

    def generate(
        self,
        prompts: str | list[str],
        params: SamplingParams = SamplingParams(),
        chat: bool = True,
        max_batch: int = 64,
        on_step=None,
    ) -> list[Completion]:
        """Each prompt generated to completion; `on_step` as in `run`."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
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

    def _completion(self, prompt: str, request: Request) -> Completion:
        ids = request.generated_ids(self.tokenizer.special.stop_ids)
        kinds = {StepKind(k).value: n for k, n in request.steps_by_kind.items()}
        return Completion(prompt, self.tokenizer.decode(ids), tuple(ids), request.num_steps, kinds)
