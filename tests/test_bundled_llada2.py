"""The bundled block-diffusion model (`assets/tiny-llada2`): it loads as the LLaDA2 family, decodes
through the engine's exact block cache, and answers held-out arithmetic problems."""

import pytest

from dilaserve.config import BUNDLED_LLADA2_MODEL, EngineConfig, SamplingParams
from dilaserve.engine.llm import LLM
from dilaserve.protocol import KVCacheMode
from dilaserve.tasks import arith

NUM_PROBLEMS = 16


@pytest.fixture(scope="module")
def llm():
    return LLM(BUNDLED_LLADA2_MODEL, EngineConfig("dual", block_len=32))


def test_bundled_llada2_is_the_llada2_family_on_the_block_cache(llm):
    assert llm.engine.family.name == "LLaDA2"
    assert llm.config.kv_cache is KVCacheMode.BLOCK
    assert llm.engine.model.config.extra["block_len"] == 32


def test_bundled_llada2_answers_held_out_problems(llm):
    problems = arith.generate(NUM_PROBLEMS, seed=7, split="test")
    outs = llm.generate(
        [p.question for p in problems], SamplingParams(threshold=0.9, max_tokens=64)
    )
    correct = sum(arith.extract_answer(o.text) == p.answer for p, o in zip(problems, outs))
    assert correct >= 12  # 16 of 16 when it was bundled (93.6% on 500 held-out problems)
    assert all(set(o.steps_by_kind) <= {"prefill", "block", "commit"} for o in outs)
    assert all(o.num_steps < 8 for o in outs)  # many tokens per step at 0.9
