"""Block diffusion in the simulator: requests whose blocks sit at absolute positions, LLaDA2.x
rates, and an exact cache whose requests prefill wherever they move."""

import re
import zlib
from dataclasses import replace

import numpy as np
import pytest

from dilaserve.control.decision_log import DecisionLog
from dilaserve.protocol import StepKind
from dilaserve.request import Request
from dilaserve.sim.behaviour import (
    LLADA2_MINI_TOKENS_PER_STEP,
    ParametricBehaviour,
    llada_tokens_per_step,
    tokens_per_step_for,
)
from dilaserve.sim.run import SimulationSpec, simulate
from dilaserve.sim.traces import Trace, save_trace

BLOCK = 32
LAUNCH = re.compile(r"^(\w+)\[(.*)\]$")


def block_span(r: Request, block: int) -> tuple[int, int]:
    start = block * BLOCK - r.block_offset
    return max(start, 0), min(start + BLOCK, r.gen_len)


@pytest.mark.parametrize("prompt_len", [64, 45, 95])
def test_commits_stay_inside_the_requests_absolute_block(prompt_len):
    r = Request("p0", (3,) * prompt_len, 128, BLOCK, 1, 0.95, block_offset=prompt_len % BLOCK)
    behaviour = ParametricBehaviour(seed=0, tokens_per_step=tokens_per_step_for("LLaDA2.0-mini"))
    blocks_done = []
    while not r.is_finished:
        result = behaviour.step(r, 0.95, StepKind.BLOCK)
        lo, hi = block_span(r, result.block_index)
        assert result.block_index == r.current_block
        assert len(result.positions) and all(lo <= p < hi for p in result.positions.tolist())
        r.apply(result)
        if result.is_block_done:
            assert r.committed[lo:hi].all() and not r.committed[hi:].any()
            blocks_done.append(result.block_index)
    assert blocks_done == list(range(r.num_blocks))
    assert r.num_blocks == (5 if prompt_len % BLOCK else 4)
    assert r.committed.all()


def test_an_aligned_request_commits_as_before():
    """block_offset 0 keeps the old order: each block's positions, shuffled by row keys."""
    r = Request("p0", (3,) * 64, 96, BLOCK, 1, 0.9)
    behaviour = ParametricBehaviour(seed=3)
    first = behaviour.step(r, 0.9, StepKind.CACHE)
    keys = np.random.default_rng([3, zlib.crc32(b"p0")])
    keys.lognormal(0.0, 0.35)
    expected = np.argsort(keys.random((3, BLOCK)), axis=1)[0]
    assert first.positions.tolist() == expected[: len(first.positions)].tolist()


def test_llada2_rates_are_the_published_tpf_at_095_and_rise_below_it():
    mini = tokens_per_step_for("LLaDA2.0-mini")
    assert mini(0.95) == LLADA2_MINI_TOKENS_PER_STEP == 2.55
    assert mini(1.0) == mini(0.95) and mini(0.75) == pytest.approx(2.55 / 0.62)
    assert tokens_per_step_for("LLaDA2.0-flash")(0.95) == 3.19
    assert tokens_per_step_for("Dream-7B") is llada_tokens_per_step
    assert "ASSUMED" in mini.source


def tiny_trace(tmp_path, n=16, seconds=8.0) -> str:
    rng = np.random.default_rng(0)
    arrival = np.sort(rng.uniform(0, seconds, n))
    trace = Trace(arrival - arrival[0], rng.integers(20, 300, n), rng.choice([64, 128], n))
    return str(save_trace(tmp_path / "trace.csv", trace))


def block_spec(tmp_path, **kw) -> SimulationSpec:
    return SimulationSpec(
        profile="llada2-mini-h200",
        kv_cache="block",
        trace=tiny_trace(tmp_path),
        gpus=2,
        gpus_per_node=2,
        threshold=0.95,
        planner_period=1e9,
        predictor_prompts=12,
        **kw,
    )


@pytest.mark.parametrize("policy", ["dilaserve", "fcfs", "dws-sjf"])
def test_a_block_cache_simulation_finishes_every_request(tmp_path, policy):
    candidates = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95) if policy == "dilaserve" else None
    run = simulate(block_spec(tmp_path, policy=policy, candidates=candidates))
    assert run.summary["finished"] == run.summary["requests"] == 16
    kinds = set().union(*(r.steps_by_kind for r in run.result.requests))
    assert kinds == {StepKind.PREFILL, StepKind.BLOCK, StepKind.COMMIT}
    for r in run.result.requests:
        assert r.block_offset == r.prompt_len % BLOCK
        assert r.steps_by_kind.get(StepKind.COMMIT, 0) <= r.num_blocks - 1
    if policy != "dilaserve":
        assert all(row["mean_threshold"] == 0.95 for row in run.rows)
    assert "ASSUMED" in run.summary["speed_model"]


def test_a_block_causal_profile_refuses_an_approximate_cache(tmp_path):
    with pytest.raises(ValueError, match="block-causal"):
        simulate(replace(block_spec(tmp_path), kv_cache="dual"))
    with pytest.raises(ValueError, match="block-causal model"):
        simulate(replace(block_spec(tmp_path), profile="llada-8b-h100"))


def launches(log: DecisionLog):
    """(instance, request, kind) of every launched step, in order."""
    for line in log.lines:
        for part in line.split()[2:]:
            m = LAUNCH.match(part)
            if m:
                for item in m[2].split(","):
                    rid, _, kind = item.split(":")
                    yield m[1], rid, kind


def test_a_moved_request_prefills_on_its_new_instance(tmp_path):
    """The planner replaces four TP-1 instances by one TP-4 while requests run: a request in
    the middle of a block moves off its draining instance at once (its cache is exact), and its
    first step on the new instance rebuilds that cache there (a prefill)."""
    spec = replace(
        block_spec(tmp_path, policy="dilaserve", candidates=(0.5, 0.6, 0.7, 0.8, 0.9, 0.95)),
        trace=tiny_trace(tmp_path, 40, 10.0),
        gpus=4,
        gpus_per_node=4,
        initial_tp=1,
        planner_period=5.0,
        startup_delay=0.2,  # short against the period: the move pays for its start-up
    )
    log = DecisionLog(keep_lines=True)
    run = simulate(spec, log=log)
    assert run.summary["reconfigurations"] == 1
    assert run.summary["finished"] == run.summary["requests"]
    where, moves = {}, 0
    for instance, rid, kind in launches(log):
        if where.get(rid) != instance:
            assert kind == StepKind.PREFILL.value, (rid, instance, kind)
            moves += rid in where
        else:
            assert kind != StepKind.PREFILL.value
        where[rid] = instance
    assert moves > 0
