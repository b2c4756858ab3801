"""engine/kv_budget.py: the K/V memory an instance's slots and graph buffers may take, and what
the engine does past it (drop the least recently stepped caches; their next steps recompute)."""

from dataclasses import replace

import pytest

from dilaserve.config import BUNDLED_LLADA2_MODEL, BUNDLED_MODEL, EngineConfig, SamplingParams
from dilaserve.engine.kv_budget import GIB, KVBudget
from dilaserve.engine.llm import LLM
from dilaserve.protocol import StepBatch, StepKind, StepOutput
from dilaserve.server.metrics import ServerMetrics
from dilaserve.tasks import arith

QUARTER = GIB // 4


def test_room_is_made_from_the_least_recently_stepped_slots_outside_the_step():
    budget, dropped = KVBudget(0.75), []
    for rid in "abc":
        assert budget.take(rid, QUARTER, set(), dropped.append)
    budget.stepped({"a"})  # least recent first: b, c, a
    assert budget.take("d", 2 * QUARTER, {"d", "b"}, dropped.append)  # b is stepping
    assert dropped == ["c", "a"] and budget.evictions == 2
    assert budget.held_bytes == 3 * QUARTER
    # no room even with every other slot dropped: nothing dropped, the store is skipped
    assert not budget.take("e", 2 * QUARTER, {"e", "b", "d"}, dropped.append)
    assert dropped == ["c", "a"] and budget.unstored == 1
    budget.release("b")
    assert budget.held_bytes == 2 * QUARTER
    assert KVBudget(None).take("f", 10 * GIB, set(), dropped.append)  # no bound


def test_graph_buffers_past_the_budget_refuse_to_start():
    with pytest.raises(ValueError, match="static buffers take 1 GiB.*0.5 GiB"):
        KVBudget(0.5, reserved_bytes=GIB)
    with pytest.raises(ValueError, match="kv_memory"):
        EngineConfig(kv_memory=0)
    llm = LLM(BUNDLED_MODEL, EngineConfig("dual", cuda_graphs=4))
    static = llm.engine._graphs.static_bytes
    assert llm.engine.kv_budget.held_bytes == static > 0
    with pytest.raises(ValueError, match="static buffers"):
        LLM(BUNDLED_MODEL, EngineConfig("dual", cuda_graphs=4, kv_memory=static / GIB / 2))


def alternate(llm: LLM, prompts: list[str], max_tokens: int, on_step) -> list:
    """The prompts' requests stepped one per step, in turn, to completion: each step's batch is
    one request, so the others' slots may be dropped."""
    requests = llm.make_requests(prompts, SamplingParams(0.9, max_tokens))
    sent: set[str] = set()
    while active := [r for r in requests if not r.is_finished]:
        for r in active:
            item = r.step_item(llm.config.kv_cache, r.request_id in sent)
            sent.add(r.request_id)
            output = llm.engine.execute(StepBatch((item,)))
            r.apply(output.results[0])
            on_step(llm.engine.kv_budget, output)
    return requests


def one_slot(model, config: EngineConfig, prompt: str, max_tokens: int) -> int:
    """Bytes of the slot `prompt`'s request takes (under a bound far above it)."""
    held = []
    llm = LLM(model, replace(config, kv_memory=1024.0))
    alternate(llm, [prompt], max_tokens, lambda budget, output: held.append(budget.held_bytes))
    return max(held)


@pytest.mark.parametrize(("model", "exact"), [(BUNDLED_MODEL, False), (BUNDLED_LLADA2_MODEL, True)])
def test_past_the_budget_caches_are_dropped_and_the_bound_holds(model, exact):
    """Room for one and a half slots, three requests stepped in turn: each store drops another
    request's cache, which then recomputes (LLaDA's approximate cache) or prefills again
    (LLaDA2's exact one, which thus commits the same tokens as with no bound)."""
    prompts = [p.question for p in arith.generate(3, seed=7, split="test")]
    config = EngineConfig("dual", block_len=32)
    free = alternate(LLM(model, config), prompts, 64, lambda budget, output: None)
    slot = one_slot(model, config, prompts[0], 64)
    limit = 1.5 * slot
    bounded_llm = LLM(model, replace(config, kv_memory=limit / GIB))
    held, drops = [], []

    def watch(budget, output):
        held.append(budget.held_bytes)
        drops.extend(output.kv_dropped)

    bounded = alternate(bounded_llm, prompts, 64, watch)
    budget = bounded_llm.engine.kv_budget
    assert max(held) <= limit and budget.evictions > 0 and budget.unstored == 0
    assert len(drops) == budget.evictions  # each step names those it dropped (for /metrics
    assert set(drops) <= {r.request_id for r in bounded}  # and the scheduler)
    assert all(r.is_finished for r in bounded)
    opening = StepKind.PREFILL if exact else StepKind.RECOMPUTE
    assert sum(r.steps_by_kind[opening] for r in bounded) > sum(
        r.steps_by_kind[opening] for r in free
    )
    if exact:
        assert [r.output_ids.tolist() for r in bounded] == [r.output_ids.tolist() for r in free]


def test_a_budget_below_one_slot_stores_nothing_and_every_step_recomputes():
    llm = LLM(BUNDLED_MODEL, EngineConfig("dual", block_len=32, kv_memory=1 / GIB))
    [problem] = arith.generate(1, seed=7, split="test")
    [request] = alternate(llm, [problem.question], 64, lambda budget, output: None)
    assert request.is_finished and llm.engine.kv_budget.unstored == request.num_steps
    assert set(request.steps_by_kind) == {StepKind.RECOMPUTE}


def test_the_drops_a_step_reports_are_counted_in_metrics():
    metrics = ServerMetrics()
    metrics.step_done("i0", 1, StepOutput((), 0, kv_dropped=("a", "b", "c")), 0.01)
    metrics.step_done("i0", 1, StepOutput((), 0), 0.01)
    assert 'dilaserve_kv_cache_drops_total{instance="i0"} 3.0' in metrics.render().decode()
