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


def test_generate_takes_token_ids_and_cuts_the_answer_to_max_tokens(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, EngineConfig(kv_cache="none", block_len=8, early_finish=False))
    ids = llm.tokenizer.encode("Tom has 3 apples.")
    [text] = llm.generate("Tom has 3 apples.", SamplingParams(max_tokens=5), chat=False)
    [one] = llm.generate(ids, SamplingParams(max_tokens=5))
    many = llm.generate([ids, tuple(ids)], SamplingParams(max_tokens=5))
    assert one.token_ids == text.token_ids == many[0].token_ids == many[1].token_ids
    assert len(one.token_ids) <= 5 and one.prompt == ids
    with pytest.raises(ValueError, match="token-id prompt"):
        llm.generate([[1, -2]], SamplingParams(max_tokens=5))


def tokenizer_free(folder, **ids):
    """A LLaDA2 checkpoint with its special ids in config.json and no tokenizer files."""
    from family_checkpoints import llada2_checkpoint

    path = llada2_checkpoint(folder, **ids)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    return path


def test_a_checkpoint_without_a_tokenizer_takes_token_ids(tmp_path):
    from family_checkpoints import llada2_checkpoint, prompt_ids

    with_tokenizer = LLM(llada2_checkpoint(tmp_path / "a"), EngineConfig(block_len=8))
    special = with_tokenizer.special
    llm = LLM(
        tokenizer_free(tmp_path / "b", mask_token_id=special.mask, eos_token_id=special.eos),
        EngineConfig(block_len=8),
    )
    assert llm.tokenizer is None and llm.special.mask == special.mask
    params = SamplingParams(0.7, 12)
    [out] = llm.generate(prompt_ids(5), params)
    assert (
        out.text == ""
        and out.token_ids == with_tokenizer.generate(prompt_ids(5), params)[0].token_ids
    )
    with pytest.raises(ValueError, match="no tokenizer.json: give prompts as token ids"):
        llm.generate("w1 w2", params)


def test_a_checkpoint_without_a_tokenizer_needs_its_special_ids_in_config(tmp_path):
    with pytest.raises(ValueError, match="must set mask_token_id and eos_token_id"):
        LLM(tokenizer_free(tmp_path / "c"), EngineConfig(block_len=8))
