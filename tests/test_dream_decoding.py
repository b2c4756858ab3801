"""Dream's `none` mode: Fast-dLLM's whole-window decoder (`generation_utils.py`), checked
against a restatement of its loop on dilaserve's own forward: every masked position of the
window is a candidate, a step commits those over the threshold among the most confident
`budget + rejections carried over` (at least one), and steps are appended while the last
scheduled one rejects."""

import pytest
import torch
from family_checkpoints import dream_checkpoint, prompt_ids, run_cases

from dilaserve.config import EngineConfig, SamplingParams
from dilaserve.engine.engine import Engine
from dilaserve.engine.llm import LLM
from dilaserve.models.family import DecodingRule
from dilaserve.protocol import StepBatch

BLOCK = 8
CASES = [(p, g, t) for p in (5, 9) for g in (16, 24) for t in (0.9, 0.5, 0.2)]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return dream_checkpoint(tmp_path_factory.mktemp("dream"))


def restated(model, prompt, gen_len: int, budget: int, threshold: float, mask: int):
    """Fast-dLLM's loop, greedy: the window and its forward count (the committed token is the
    best one that is not the mask)."""
    x = torch.tensor(list(prompt) + [mask] * gen_len)
    steps, n, left, i = gen_len // budget, budget, 0, 0
    while i < steps:
        hidden = model(x[None], torch.arange(len(x))[None], torch.ones(1, len(x), dtype=bool))
        logits = model.logits(hidden.hidden)[0].float()
        probs = torch.softmax(torch.cat((logits[:1], logits[:-1])), -1)
        probs[:, mask] = 0.0
        conf, top = probs.max(-1)
        conf = torch.where(x == mask, conf, float("-inf"))
        current, left = n + left, 0
        chosen, order = torch.topk(conf, current)
        take = [int(order[0])]
        for k in range(1, current):
            if chosen[k] >= threshold:
                take.append(int(order[k]))
                continue
            left += 1
            if i == steps - 1:  # the last step rejects: one more step, budget the rejections
                n, steps = 0, steps + 1
        x[torch.tensor(take)] = top[torch.tensor(take)]
        i += 1
    return x[len(prompt) :].tolist(), i


def run(path, budget: int | None, cases):
    llm = LLM(path, EngineConfig("none", block_len=BLOCK, early_finish=False, step_budget=budget))
    return llm, run_cases(llm, cases)


def test_the_budget_carries_rejections_and_appended_steps_take_what_is_left():
    rule = DecodingRule(whole_window=True)
    assert rule.max_commits(16, 8, num_steps=0, num_committed=0) == 8
    assert rule.max_commits(16, 8, num_steps=1, num_committed=3) == 13  # 8 + 5 carried
    assert rule.max_commits(16, 8, num_steps=4, num_committed=14) == 2  # appended: the rest
    assert rule.max_commits(16, 8, num_steps=0, num_committed=10) == 1  # never below one


@pytest.mark.parametrize("budget", [None, 4])
def test_a_batch_equals_the_published_loop_case_by_case(path, budget):
    llm, requests = run(path, budget, CASES)
    model, mask = llm.engine.model, llm.special.mask
    appended = 0
    for (_, gen_len, threshold), request in zip(CASES, requests):
        window, forwards = restated(
            model, request.prompt_ids, gen_len, budget or BLOCK, threshold, mask
        )
        assert request.output_ids.tolist() == window
        assert request.num_steps == forwards
        appended += forwards > gen_len // (budget or BLOCK)
        assert set(request.steps_by_kind) == {"full"}
    assert 0 < appended < len(CASES)  # the grid has cases inside and past the schedule


def test_every_position_clearing_takes_the_scheduled_steps_and_none_one_a_step(path):
    _, easy = run(path, 4, [(5, 16, 1e-9)])
    _, hard = run(path, 4, [(5, 16, 1.0)])
    assert easy[0].step_tokens == [4, 4, 4, 4]  # capped at the budget
    assert hard[0].step_tokens == [1] * 16  # the top-1 alone, the rest carried


def test_the_window_step_count_moves_with_the_request(path):
    """Moved to another instance after 2 steps, a request goes on where its budget stood."""
    config = EngineConfig("none", block_len=BLOCK, early_finish=False, step_budget=4)
    case = [(5, 16, 0.2)]
    _, (whole,) = run(path, 4, case)
    llm = LLM(path, config)
    (moved,) = llm.make_requests([prompt_ids(5)], SamplingParams(0.2, 16), chat=False)
    moved.request_id = "0"
    engines = [Engine.from_checkpoint(path, config) for _ in range(2)]
    while not moved.is_finished:
        engine = engines[moved.num_steps >= 2]
        item = moved.step_item(config.kv_cache, engine.has_request(moved.request_id))
        moved.apply(engine.execute(StepBatch((item,))).results[0])
    assert moved.step_tokens == whole.step_tokens
    assert moved.output_ids.tolist() == whole.output_ids.tolist()
    assert max(whole.step_tokens[2:]) > 1  # a count begun again would allow one a step
