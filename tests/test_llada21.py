"""LLaDA2.1 on a tiny random checkpoint in its layout (`dilaserve random-checkpoint llada2.1`):
token editing through the exact block cache equals it without a cache, in a mixed batch, across
a move to another instance mid-edit, and through the OpenAI API."""

import numpy as np
import pytest
from family_checkpoints import plain_and_graphed, prompt_ids, run_cases

from dilaserve.cluster.runtime import ClusterConfig
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.config import BUNDLED_LLADA2_MODEL, EngineConfig, SamplingParams
from dilaserve.control.build import ControlSpec
from dilaserve.control.step_costs import StepCosts
from dilaserve.engine.engine import Engine
from dilaserve.engine.llm import LLM
from dilaserve.protocol import StepBatch, StepKind
from dilaserve.training.random_checkpoint import write_random_llada21

BLOCK = 8
CASES = [(5, 16, 0.5), (8, 11, 0.9), (13, 16, 0.7)]  # prompt length, max_tokens, threshold


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_random_llada21(tmp_path_factory.mktemp("llada21"))


def outputs(path, cache: str, mode: str | None, which=range(len(CASES))):
    """The output windows and step counts of cases `which`, run as one batch."""
    llm = LLM(path, EngineConfig(cache, block_len=BLOCK, editing=mode, early_finish=False))
    requests = run_cases(llm, CASES, which)
    return [(r.output_ids.tolist(), r.num_steps) for r in requests], requests


@pytest.mark.parametrize("mode", ["speed", "quality"])
def test_editing_through_the_block_cache_equals_it_without_a_cache(path, mode):
    cached, requests = outputs(path, "block", mode)
    assert cached == outputs(path, "none", mode)[0]
    assert cached == [outputs(path, "block", mode, [i])[0][0] for i in range(len(CASES))]
    assert all(r.edits and not r.edit_block for r in requests)
    # edit-only steps are steps like any other: a block takes more steps than it has masks
    assert any(steps > r.gen_len for (_, steps), r in zip(cached, requests))


def test_the_checkpoint_edits_by_default_and_off_is_the_llada2_rule(path):
    assert LLM(path).engine.decoding.editing.mode == "speed"
    off = LLM(path, EngineConfig(editing="off")).engine.decoding
    assert off.editing is None and off.step_schedule


def test_an_edit_only_step_is_a_block_step_the_control_plane_prices_as_one(path):
    costs = StepCosts("block", BLOCK)
    llm = LLM(path, EngineConfig("block", block_len=BLOCK, editing="speed", early_finish=False))
    (request,) = llm.make_requests([prompt_ids(5)], SamplingParams(0.5, 16), chat=False)
    priced, edit_only = [], []

    def on_step(r, result):
        if r.edit_block is not None:  # the next step edits (and commits what an edit masked)
            kind = costs.next_kind(r, has_cache=True)
            priced.append((kind, costs.request_tokens(kind, r)))
            start, end = r.block_span(r.edit_block)
            if not (r.output_ids[start:end] == r.mask_id).any():
                edit_only.append(r.num_steps)  # the index of the step that edits only

    llm.run([request], 1, on_step)
    assert priced and set(priced) == {(StepKind.BLOCK, BLOCK)}
    # each is counted as a step (the predictor's data); an edit-only one commits no new token
    assert request.num_steps == len(request.step_tokens)
    assert edit_only and all(request.step_tokens[i] == 0 for i in edit_only)


def test_a_request_moved_mid_edit_ends_as_one_never_moved(path):
    config = EngineConfig("block", block_len=BLOCK, editing="speed", early_finish=False)
    llm = LLM(path, config)
    (alone,) = llm.make_requests([prompt_ids(5)], SamplingParams(0.5, 16), chat=False)
    llm.run([alone], 1)
    (moved,) = llm.make_requests([prompt_ids(5)], SamplingParams(0.5, 16), chat=False)
    first = Engine(llm.engine.model, llm.special, config)
    while not (moved.edit_block == 1 and moved.post_steps):  # edit-only steps of block 1
        assert not moved.is_finished
        item = moved.step_item(config.kv_cache, first.has_request(moved.request_id))
        moved.apply(first.execute(StepBatch((item,))).results[0])
    second = Engine(llm.engine.model, llm.special, config)
    kinds = []
    while not moved.is_finished:
        item = moved.step_item(config.kv_cache, second.has_request(moved.request_id))
        result = second.execute(StepBatch((item,))).results[0]
        kinds.append(result.kind)
        moved.apply(result)
    assert kinds[0] is StepKind.PREFILL  # the sequence travelled, with its edit phase
    assert moved.output_ids.tolist() == alone.output_ids.tolist()
    assert moved.num_steps == alone.num_steps


def test_the_openai_api_answers_with_editing_on(path):
    from fastapi.testclient import TestClient

    from dilaserve.server.main import build_app

    engine = EngineConfig("block", editing="quality")
    calibration = BUNDLED_LLADA2_MODEL / "dilaserve-calibration" / "cpu-float32"  # block kinds
    control = ControlSpec(profile=str(calibration / "profile.json"))
    worker = WorkerConfig(str(path), engine, threads=1)
    config = ClusterConfig(worker, control, instances=(1,), tick=0.2)
    app, cluster = build_app(config)
    body = {"model": path.name, "max_tokens": 24, "threshold": 0.7, "prompt": "w3 w5 w7"}
    with TestClient(app) as client:
        reply = client.post("/v1/completions", json=body)
        streamed = client.post("/v1/completions", json={**body, "stream": True})
    assert reply.status_code == streamed.status_code == 200, (reply.text, streamed.text)
    offline = LLM(path, EngineConfig(editing="quality"))
    (want,) = offline.generate(["w3 w5 w7"], SamplingParams(0.7, 24), chat=False)
    assert offline.engine.decoding.editing.mode == "quality"
    assert reply.json()["choices"][0]["text"] == want.text
    chunks = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert _joined(chunks) == want.text  # a stream sends finished blocks only: never edited


def _joined(chunks: list[str]) -> str:
    import json

    return "".join(json.loads(c[len("data: ") :])["choices"][0]["text"] for c in chunks)


def test_recorded_trajectories_hold_each_steps_new_commits_and_every_step(path):
    from dilaserve.engine.record import record_trajectories

    llm = LLM(path, EngineConfig("block", block_len=BLOCK, early_finish=False))  # speed
    (t,) = record_trajectories(llm, ["w3 w5 w7"], (0.5,), max_tokens=16)
    committed = np.concatenate(t.commits)
    assert sorted(committed.tolist()) == list(range(t.gen_len))  # each position once
    assert any(len(c) == 0 for c in t.commits)  # the edit-only steps, counted as steps
    assert t.num_steps == len(t.kinds) == t.confidences.shape[0]


@pytest.mark.parametrize("editing", ["off", "speed"])  # LLaDA2.0's rule, and 2.1's edits
def test_block_steps_on_static_buffers_commit_the_same_tokens(path, editing):
    """engine/graphs.py's path (eager here: graphs are captured only on CUDA) runs the exact
    cache's block steps, edit-only ones included, and its commit steps, which store the
    finished block, with padding rows (3 -> 4) and fallbacks (prefills, 4 requests > 3): the
    same tokens and steps as the plain path."""

    config = EngineConfig(
        "block", block_len=BLOCK, editing=editing, early_finish=False, cuda_graphs=3
    )
    plain, graphed, calls = plain_and_graphed(path, config, CASES + [(9, 32, 0.3)])
    assert graphed == plain
    rows, queried = zip(*calls)
    assert max(rows) == 3 and set(queried) == {BLOCK, 2 * BLOCK}  # block and commit steps
