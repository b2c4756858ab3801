"""The control plane under an exact (block-diffusion) cache: step kinds and their tokens, the
load and capacity of Algorithms 4/5 with commit steps, and migration as a priced decision."""

import numpy as np
import pytest

from dilaserve.control.policy import get_policy
from dilaserve.control.profile import LatencyProfile
from dilaserve.control.scheduler import Scheduler, SchedulerConfig
from dilaserve.control.step_costs import StepCosts
from dilaserve.control.thresholds import InstanceLoad, instance_capacity, load_matrix, step_seconds
from dilaserve.protocol import KVCacheMode, RequestStepResult, StepKind, StepOutput

from conftest import BLOCK_LEN, make_request

CURVES = {  # kind: ((batch tokens, ms), ...); TP-2 takes 60% of TP-1's time
    "prefill": ((8, 10), (1000, 200)),
    "block": ((8, 5), (800, 100)),
    "commit": ((16, 6), (1600, 120)),
    "recompute": ((8, 10), (1000, 200)),
    "cache": ((8, 5), (800, 100)),
}
PROFILE = LatencyProfile.from_dict(
    {
        "entries": [
            {"tp": tp, "kind": kind, "batch_tokens": n, "ms": ms * (0.6 if tp == 2 else 1.0)}
            for tp in (1, 2)
            for kind, points in CURVES.items()
            for n, ms in points
        ]
    }
)
EXACT = StepCosts(KVCacheMode.BLOCK, BLOCK_LEN)


class FakePredictor:
    thresholds = (0.5, 0.9)

    def at(self, thresholds):  # predicts at the scheduler's ladder, in its order
        self.thresholds = tuple(thresholds)
        return self

    def predict(self, request_ids, states):
        return np.array([[{0.5: 4.0, 0.9: 8.0}[t] for t in self.thresholds] for _ in request_ids])


def scheduler(instances=(("a", 1),), max_tokens=10_000, kv_cache="block"):
    cfg = SchedulerConfig(kv_cache=kv_cache, block_len=BLOCK_LEN, slo=100.0)
    s = Scheduler(get_policy("dilaserve", candidates=(0.5, 0.9)), PROFILE, FakePredictor(), cfg)
    for name, tp in instances:
        s.add_instance(name, tp, max_tokens)
    return s


def done(s, instance, req, positions, now, block_done=False):
    kind = StepKind.PREFILL if req.num_steps == 0 else StepKind.BLOCK
    result = RequestStepResult(
        req.request_id,
        kind,
        np.array(positions, dtype=np.int32),
        np.full(len(positions), 3, np.int32),
        np.full(req.gen_len, 0.5, np.float32),
        req.current_block,
        block_done,
        False,
    )
    return s.on_step_done(instance, StepOutput((result,), 0), now=now)


def launched(decisions) -> dict[str, tuple[str, StepKind, bool]]:
    """request -> (instance, step kind, whether its sequence travelled)."""
    return {
        item.request_id: (launch.instance_id, item.kind, item.spec is not None)
        for launch in decisions.launches
        for item in launch.batch.items
    }


@pytest.mark.parametrize(
    "mode, sequence, boundary, inner",
    [
        ("none", StepKind.FULL, StepKind.FULL, StepKind.FULL),
        ("dual", StepKind.RECOMPUTE, StepKind.RECOMPUTE, StepKind.CACHE),
        ("block", StepKind.PREFILL, StepKind.COMMIT, StepKind.BLOCK),
    ],
)
def test_each_cache_mode_names_its_step_kinds(mode, sequence, boundary, inner):
    costs = StepCosts(KVCacheMode(mode), BLOCK_LEN)
    assert (costs.sequence_kind, costs.boundary_kind, costs.inner_kind) == (
        sequence,
        boundary,
        inner,
    )


@pytest.mark.parametrize(
    "mode, kinds",
    [
        ("none", ("full",)),
        ("prefix", ("recompute", "cache")),
        ("dual", ("recompute", "cache")),
        ("block", ("prefill", "block", "commit")),
    ],
)
def test_each_cache_mode_lists_the_kinds_its_profile_prices(mode, kinds):
    assert tuple(k.value for k in StepCosts(KVCacheMode(mode)).kinds) == kinds


def test_a_bad_cache_mode_or_block_is_refused_naming_it():
    with pytest.raises(ValueError, match="self.mode='paged' must be one of"):
        StepCosts("paged")
    with pytest.raises(ValueError, match="block_len=0 must be positive"):
        StepCosts(KVCacheMode.DUAL, 0)


def test_a_step_processes_the_tokens_its_kind_runs():
    assert [EXACT.tokens(k, 100) for k in (StepKind.PREFILL, StepKind.BLOCK, StepKind.COMMIT)] == [
        100,
        BLOCK_LEN,
        2 * BLOCK_LEN,
    ]
    assert EXACT.stays_with_cache(StepKind.BLOCK) is False  # an exact cache may move, at a price
    assert StepCosts(KVCacheMode.DUAL, BLOCK_LEN).stays_with_cache(StepKind.CACHE) is True


def test_the_load_counts_commit_steps_at_two_blocks_not_the_whole_sequence():
    steps, tokens, blocks_left = np.array([[10.0, 6.0]]), [500], [2]
    exact = load_matrix(steps, tokens, blocks_left, EXACT)
    approximate = load_matrix(steps, tokens, blocks_left, BLOCK_LEN)
    assert exact.tolist() == [[8 * BLOCK_LEN + 2 * 2 * BLOCK_LEN, 4 * BLOCK_LEN + 4 * BLOCK_LEN]]
    assert approximate.tolist() == [[8 * BLOCK_LEN + 2 * 500, 4 * BLOCK_LEN + 2 * 500]]


def test_step_seconds_and_capacity_read_the_block_and_commit_curves():
    load = InstanceLoad(tp=1, num_tokens=1000, num_requests=4)
    inner, boundary = step_seconds(load, PROFILE, EXACT)
    assert inner == pytest.approx(PROFILE.step_latency(1, 4 * BLOCK_LEN, StepKind.BLOCK))
    assert boundary == pytest.approx(PROFILE.step_latency(1, 8 * BLOCK_LEN, StepKind.COMMIT))
    m = 4
    inner_s = PROFILE.step_latency(1, BLOCK_LEN * m, StepKind.BLOCK)
    commit_s = PROFILE.step_latency(1, 2 * BLOCK_LEN * m, StepKind.COMMIT)
    tokens = BLOCK_LEN * m * (BLOCK_LEN - 1) + 2 * BLOCK_LEN * m
    want = tokens / (inner_s * (BLOCK_LEN - 1) + commit_s)
    assert instance_capacity(PROFILE, 1, 1.0, EXACT, 1000, m) == pytest.approx(want)


def test_a_new_request_prefills_then_runs_block_steps_where_its_cache_is():
    s = scheduler(instances=(("a", 1), ("b", 2)))
    r = make_request("r")
    assert launched(s.on_arrival(r, 0.0)) == {"r": ("b", StepKind.PREFILL, True)}
    # a block step at home (TP-2) beats a prefill on the idle TP-1 instance: it stays
    assert launched(done(s, "b", r, [0], now=0.1)) == {"r": ("b", StepKind.BLOCK, False)}


def test_a_block_step_stays_home_when_a_prefill_elsewhere_would_finish_later():
    s = scheduler(instances=(("a", 1), ("b", 2)))
    r = make_request("r")
    s.on_arrival(r, 0.0)  # on b, TP-2
    prefill_on_a = PROFILE.step_latency(1, r.num_tokens, StepKind.PREFILL)
    block_on_b = PROFILE.step_latency(2, BLOCK_LEN, StepKind.BLOCK)
    assert prefill_on_a > block_on_b
    d = done(s, "b", r, [0], now=0.1)
    assert d.releases == () and launched(d)["r"][0] == "b"


@pytest.mark.parametrize("kv_cache, moves", [("block", True), ("dual", False)])
def test_a_request_whose_home_is_full_moves_paying_a_prefill_only_with_an_exact_cache(
    kv_cache, moves
):
    s = scheduler(max_tokens=25, kv_cache=kv_cache)
    r1, r2 = make_request("r1"), make_request("r2", arrival_time=0.1)
    s.on_arrival(r1, 0.0)  # runs on a
    s.on_arrival(r2, 0.1)  # gathered for a's next step (21 tokens of 25)
    s.add_instance("b", 1, 25)
    d = done(s, "a", r1, [0], now=0.2)  # r1's block step no longer fits a's batch
    if moves:
        assert d.releases == (("a", "r1"),)
        assert launched(d) == {
            "r2": ("a", StepKind.PREFILL, True),
            "r1": ("b", StepKind.PREFILL, True),
        }
    else:  # an approximate cache's mid-block step waits for its cache
        assert d.releases == () and set(launched(d)) == {"r2"}


def test_a_draining_instance_is_idle_once_its_step_ends_and_its_requests_prefill_elsewhere():
    s = scheduler()
    r = make_request("r")
    s.on_arrival(r, 0.0)
    s.add_instance("b", 1, 10_000)
    s.drain_instance("a", 0.05)
    assert not s.is_idle("a")  # its step runs
    d = done(s, "a", r, [0], now=0.1)
    assert s.is_idle("a")  # r holds no one up: its next step may run anywhere
    assert d.releases == (("a", "r"),)
    assert launched(d) == {"r": ("b", StepKind.PREFILL, True)}


def test_without_a_cache_a_block_diffusion_profile_prices_full_steps_as_prefills():
    exact_only = LatencyProfile.from_dict(
        {"entries": [{"tp": 1, "kind": "prefill", "batch_tokens": 64, "ms": 3.0}]}
    )
    assert exact_only.step_latency(1, 64, StepKind.FULL) == pytest.approx(0.003)
    s = Scheduler(get_policy("fcfs"), exact_only, None, SchedulerConfig(kv_cache="none"))
    s.add_instance("a", 1, 10_000)  # no missing-curve error


def test_a_prefill_is_priced_at_the_prompt_and_the_blocks_up_to_the_current_one():
    r = make_request("r", prompt_len=13, gen_len=2 * BLOCK_LEN, block_offset=13 % BLOCK_LEN)
    assert EXACT.request_tokens(StepKind.PREFILL, r) == 2 * BLOCK_LEN  # absolute block [8, 16)
    r.current_block = 2
    assert EXACT.request_tokens(StepKind.PREFILL, r) == r.num_tokens == 29  # its last block
    assert EXACT.request_tokens(StepKind.COMMIT, r) == 2 * BLOCK_LEN
