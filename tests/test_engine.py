from dataclasses import replace

import numpy as np
import pytest

from dilaserve.protocol import (
    Executor,
    KVCacheMode,
    StepBatch,
    StepItem,
    StepKind,
)
from dilaserve.request import next_step_kind

from conftest import BLOCK_LEN, FakeModel, fake_engine, make_request, tiny_engine


def step(engine, *requests, kinds=None):
    """Run one step for `requests` (first time on this engine: send the spec)."""
    mode = engine.config.kv_cache
    items = [r.step_item(mode, engine.has_request(r.request_id)) for r in requests]
    if kinds:
        items = [replace(item, kind=kind) for item, kind in zip(items, kinds)]
    out = engine.execute(StepBatch(tuple(items)))
    for r, res in zip(requests, out.results):
        r.apply(res)
    return out


def run_to_end(engine, *requests, max_steps=500):
    active = list(requests)
    for _ in range(max_steps):
        if not active:
            return
        step(engine, *active)
        active = [r for r in active if not r.is_finished]
    raise AssertionError("did not finish")


PROMPT_LEN = 5


def conf_by_output_index(table):
    return lambda p: table.get(p - PROMPT_LEN, 0.3) if p >= PROMPT_LEN else 0.99


def test_the_engine_is_an_executor():
    engine, _ = fake_engine(lambda p: 0.99)
    assert isinstance(engine, Executor)
    assert not isinstance(object(), Executor)


def test_commits_exactly_the_block_positions_above_threshold():
    engine, _ = fake_engine(conf_by_output_index({0: 0.95, 3: 0.91, 5: 0.5, 9: 0.99}))
    req = make_request(prompt_len=PROMPT_LEN, threshold=0.9)
    res = step(engine, req).results[0]
    assert sorted(res.positions.tolist()) == [0, 3]  # 9 is confident but in the next block
    assert res.tokens.tolist() == [
        2 + (PROMPT_LEN + p) % 10 for p in sorted(res.positions.tolist())
    ]
    assert res.kind is StepKind.FULL and res.block_index == 0


def test_per_row_thresholds_in_one_batch():
    engine, _ = fake_engine(conf_by_output_index({0: 0.95, 1: 0.75, 2: 0.55}))
    strict = make_request("a", prompt_len=PROMPT_LEN, threshold=0.9)
    loose = make_request("b", prompt_len=PROMPT_LEN, threshold=0.5)
    out = step(engine, strict, loose)
    assert out.by_id()["a"].positions.tolist() == [0]
    assert sorted(out.by_id()["b"].positions.tolist()) == [0, 1, 2]


def test_fallback_commits_one_token_and_blocks_go_left_to_right():
    engine, _ = fake_engine(lambda p: 0.5)
    req = make_request(prompt_len=PROMPT_LEN, threshold=0.9, gen_len=2 * BLOCK_LEN)
    seen_blocks = []
    while not req.is_finished:
        res = step(engine, req).results[0]
        assert len(res.positions) == 1
        seen_blocks.append(res.block_index)
        assert res.positions[0] // BLOCK_LEN == res.block_index
    assert seen_blocks == sorted(seen_blocks) and req.num_steps == 2 * BLOCK_LEN


def test_confidences_report_latest_for_masked_and_commit_time_for_committed():
    engine, _ = fake_engine(conf_by_output_index({0: 0.95, 1: 0.6}))
    req = make_request(prompt_len=PROMPT_LEN, threshold=0.9)
    res = step(engine, req).results[0]
    assert res.confidences.shape == (req.gen_len,)
    assert res.confidences[0] == pytest.approx(0.95, abs=1e-5)  # committed this step
    assert res.confidences[1] == pytest.approx(0.6, abs=1e-5)  # still masked: latest top-1
    assert res.confidences[BLOCK_LEN + 2] == pytest.approx(0.3, abs=1e-5)  # later block, FULL step


def test_early_finish_after_eos_and_everything_before_it():
    eos_at = 2
    engine, _ = fake_engine(
        lambda p: 0.99, token_of=lambda p: FakeModel.EOS if p - PROMPT_LEN == eos_at else 3
    )
    req = make_request(prompt_len=PROMPT_LEN, threshold=0.9, gen_len=2 * BLOCK_LEN)
    res = step(engine, req).results[0]
    assert res.is_finished and req.num_steps == 1
    assert not engine.has_request(req.request_id)  # state and cache freed on finish


def test_early_finish_can_be_switched_off():
    engine, _ = fake_engine(lambda p: 0.99, token_of=lambda p: FakeModel.EOS, early_finish=False)
    req = make_request(prompt_len=PROMPT_LEN, threshold=0.9, gen_len=2 * BLOCK_LEN)
    run_to_end(engine, req)
    assert req.num_steps == 2  # one step per block: every position clears the threshold


def test_eos_not_yet_preceded_by_committed_tokens_does_not_finish():
    engine, _ = fake_engine(
        conf_by_output_index({3: 0.99}),
        token_of=lambda p: FakeModel.EOS if p - PROMPT_LEN == 3 else 4,
    )
    req = make_request(prompt_len=PROMPT_LEN, threshold=0.9)
    res = step(engine, req).results[0]
    assert res.positions.tolist() == [3] and not res.is_finished


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cache_modes_recompute_at_block_start_then_run_cache_steps(mode):
    engine, model = fake_engine(lambda p: 0.5, kv_cache=mode)
    req = make_request(prompt_len=PROMPT_LEN, threshold=0.9, gen_len=2 * BLOCK_LEN)
    kinds = []
    while not req.is_finished:
        kinds.append(step(engine, req).results[0].kind)
    per_block = [StepKind.RECOMPUTE] + [StepKind.CACHE] * (BLOCK_LEN - 1)
    assert kinds == per_block * 2
    total = PROMPT_LEN + 2 * BLOCK_LEN
    cache_lens = {seq_len for _, seq_len, ctx in model.calls if ctx}
    full_lens = {seq_len for _, seq_len, ctx in model.calls if not ctx}
    assert full_lens == {total}
    if mode == "dual":
        assert cache_lens == {BLOCK_LEN}
    else:  # block plus everything after it
        assert cache_lens == {2 * BLOCK_LEN, BLOCK_LEN}


def test_cache_step_without_a_cache_on_this_instance_recomputes():
    engine, _ = fake_engine(lambda p: 0.5, kv_cache="dual")
    req = make_request(prompt_len=PROMPT_LEN, threshold=0.9)
    res = step(engine, req, kinds=[StepKind.CACHE]).results[0]
    assert res.kind is StepKind.RECOMPUTE
    assert step(engine, req, kinds=[StepKind.CACHE]).results[0].kind is StepKind.CACHE


def test_no_cache_mode_runs_full_steps_whatever_is_asked():
    engine, _ = fake_engine(lambda p: 0.5, kv_cache="none")
    req = make_request(prompt_len=PROMPT_LEN)
    assert step(engine, req, kinds=[StepKind.CACHE]).results[0].kind is StepKind.FULL


def test_an_approximate_cache_refuses_a_step_kind_of_the_exact_block_cache():
    engine, _ = fake_engine(lambda p: 0.5, kv_cache="dual")
    req = make_request("r9", prompt_len=PROMPT_LEN)
    with pytest.raises(ValueError, match="r9: a block step needs an exact block cache"):
        step(engine, req, kinds=[StepKind.BLOCK])


@pytest.mark.parametrize(
    "starts_block, has_cache, kind",
    [
        (True, False, StepKind.PREFILL),
        (False, False, StepKind.PREFILL),  # migrated mid-block: the new instance prefills
        (False, True, StepKind.BLOCK),
        (True, True, StepKind.COMMIT),  # a block just finished: store it, start the next
    ],
)
def test_the_next_step_kind_with_an_exact_block_cache(starts_block, has_cache, kind):
    assert next_step_kind(KVCacheMode.BLOCK, starts_block, has_cache) is kind


def test_release_frees_state_and_unknown_request_is_a_clear_error():
    engine, _ = fake_engine(lambda p: 0.5, kv_cache="dual")
    req = make_request(prompt_len=PROMPT_LEN)
    step(engine, req)
    assert engine.has_request("r0")
    engine.release("r0")
    assert not engine.has_request("r0")
    with pytest.raises(KeyError, match="r0"):
        engine.execute(StepBatch((StepItem("r0", 0.9, StepKind.CACHE),)))


def test_bad_batches_name_the_request():
    engine, _ = fake_engine(lambda p: 0.5)
    req = make_request("bad", prompt_len=PROMPT_LEN)
    with pytest.raises(ValueError, match="bad.*threshold"):
        engine.execute(StepBatch((StepItem("bad", 1.5, StepKind.FULL, req.spec()),)))
    twice = StepItem("bad", 0.9, StepKind.FULL, req.spec())
    with pytest.raises(ValueError, match="twice"):
        engine.execute(StepBatch((twice, twice)))
    assert engine.num_requests == 0  # a rejected batch leaves no state behind


def test_num_tokens_counts_processed_tokens_by_step_kind():
    engine, _ = fake_engine(lambda p: 0.5, kv_cache="dual")
    a, b = make_request("a", prompt_len=5), make_request("b", prompt_len=9)
    first = step(engine, a, b)
    assert first.num_tokens == (5 + 16) + (9 + 16)
    assert step(engine, a, b).num_tokens == 2 * BLOCK_LEN


# -- the real model: batching invariance and migration -------------------------------------


def _requests(tok, thresholds):
    from dilaserve.request import Request
    from dilaserve.tasks import arith

    problems = arith.generate(len(thresholds), seed=7, split="test")
    return [
        Request(
            f"q{i}",
            tuple(tok.encode_chat(p.question)),
            (1 + i % 2) * BLOCK_LEN * 2,
            BLOCK_LEN,
            tok.special.mask,
            t,
        )
        for i, (p, t) in enumerate(zip(problems, thresholds))
    ]


@pytest.mark.parametrize("mode", ["none", "prefix", "dual"])
def test_tokens_do_not_depend_on_batch_companions(tiny_checkpoint, tiny_tokenizer, mode):
    thresholds = [0.3, 0.5, 0.7, 0.9]
    alone = _requests(tiny_tokenizer, thresholds)
    for r in alone:
        run_to_end(tiny_engine(tiny_checkpoint, mode), r)
    together = _requests(tiny_tokenizer, thresholds)
    run_to_end(tiny_engine(tiny_checkpoint, mode), *together)
    for a, b in zip(alone, together):
        assert np.array_equal(a.output_ids, b.output_ids)
        assert a.num_steps == b.num_steps
    assert len({a.num_steps for a in alone}) > 1  # thresholds really differ in effect


def test_migrated_request_continues_from_its_committed_tokens(tiny_checkpoint, tiny_tokenizer):
    [stay] = _requests(tiny_tokenizer, [0.6])
    run_to_end(tiny_engine(tiny_checkpoint, "none"), stay)
    [moved] = _requests(tiny_tokenizer, [0.6])
    first, second = tiny_engine(tiny_checkpoint, "none"), tiny_engine(tiny_checkpoint, "none")
    for _ in range(3):
        step(first, moved)
    first.release(moved.request_id)
    run_to_end(second, moved)  # second sees the spec: prompt + committed tokens so far
    assert np.array_equal(stay.output_ids, moved.output_ids)


@pytest.mark.parametrize("mode", ["dual", "prefix"])
@pytest.mark.parametrize("graph_requests", [1, 3, 8])
def test_static_buffer_cache_steps_commit_the_same_tokens(
    tiny_checkpoint, tiny_tokenizer, graph_requests, mode
):
    """engine/graphs.py's path (eager here: graphs are captured only on CUDA) matches the plain
    one, with padding rows (3 -> 4), fallbacks (4 requests > 1) and rows reused across steps;
    a prefix-cache step queries the rest of its window (1 to 4 blocks here), each length a
    graph of its own."""
    thresholds = [0.3, 0.5, 0.7, 0.9]
    plain = _requests(tiny_tokenizer, thresholds)
    run_to_end(tiny_engine(tiny_checkpoint, mode), *plain)
    graphed = _requests(tiny_tokenizer, thresholds)
    engine = tiny_engine(tiny_checkpoint, mode, cuda_graphs=graph_requests)
    calls = []
    hidden = engine._graphs.hidden
    engine._graphs.hidden = lambda seqs, ids, *a: (
        calls.append((len(seqs), ids.shape[1])) or hidden(seqs, ids, *a)
    )
    run_to_end(engine, *graphed)
    for a, b in zip(plain, graphed):
        assert np.array_equal(a.output_ids, b.output_ids)
        assert a.num_steps == b.num_steps
    assert calls and max(rows for rows, _ in calls) <= graph_requests
    queried = {tokens for _, tokens in calls}
    assert queried == ({BLOCK_LEN} if mode == "dual" else {BLOCK_LEN * n for n in (1, 2, 3, 4)})


def test_cache_steps_beyond_the_graph_context_run_eagerly(tiny_checkpoint, tiny_tokenizer):
    engine = tiny_engine(tiny_checkpoint, "dual", cuda_graphs=4, cuda_graph_context=8)
    calls = []
    engine._graphs.hidden = lambda seqs, *a: calls.append(len(seqs))
    requests = _requests(tiny_tokenizer, [0.5, 0.9])
    run_to_end(engine, *requests)
    assert calls == [] and all(r.steps_by_kind[StepKind.CACHE] > 0 for r in requests)
