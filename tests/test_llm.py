import pytest

from dilaserve.config import EngineConfig, SamplingParams
from dilaserve.engine.llm import LLM
from dilaserve.tasks import arith


def test_continuous_batching_gives_the_same_completions(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, EngineConfig(kv_cache="dual", block_len=8))
    questions = [p.question for p in arith.generate(5, seed=4, split="test")]
    params = SamplingParams(threshold=0.6, max_tokens=16)
    wide = llm.generate(questions, params, max_batch=8)
    narrow = llm.generate(questions, params, max_batch=2)
    assert [c.token_ids for c in wide] == [c.token_ids for c in narrow]
    assert [c.num_steps for c in wide] == [c.num_steps for c in narrow]
    assert all(c.steps_by_kind.get("recompute", 0) >= 1 for c in wide)


def test_generate_accepts_one_string_and_raw_prompts(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, EngineConfig(kv_cache="none", block_len=8))
    [out] = llm.generate("Tom has 3 apples.", SamplingParams(max_tokens=8), chat=False)
    assert out.prompt == "Tom has 3 apples." and 1 <= out.num_steps <= 8
    assert set(out.steps_by_kind) == {"full"}


def test_a_window_past_the_context_is_refused_before_any_step(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, EngineConfig(block_len=8))
    context = llm.engine.model.config.max_sequence_length
    with pytest.raises(ValueError, match=f"context of {context} tokens"):
        llm.generate("Tom has 3 apples.", SamplingParams(max_tokens=context))
