"""The `no-placement` ablation: `dilaserve` with Alg. 3 replaced by least-tokens placement (as
`llumnix` places), everything else, migration's pricing included, unchanged."""

import dataclasses

import pytest
from scheduler_helpers import BLOCK, done, only_launch, result, scheduler

from dilaserve.control.policy import POLICIES, Placement

from conftest import make_request


def test_no_placement_differs_from_dilaserve_only_in_placement():
    ours, ablation = POLICIES["dilaserve"], POLICIES["no-placement"]
    differ = {
        f.name
        for f in dataclasses.fields(ours)
        if getattr(ours, f.name) != getattr(ablation, f.name)
    }
    assert differ == {"name", "placement"}
    assert ablation.placement is Placement.LEAST_TOKENS is POLICIES["llumnix"].placement


@pytest.mark.parametrize("policy, first", [("dilaserve", "b"), ("no-placement", "a")])
def test_alg3_picks_the_faster_instance_where_least_tokens_takes_the_first_empty_one(policy, first):
    s = scheduler(policy)  # a: TP-1, b: TP-2 (0.6x the latency); both empty
    assert only_launch(s.on_arrival(make_request("r", gen_len=2 * BLOCK), 0.0)).instance_id == first


@pytest.mark.parametrize(
    "policy, now, moves",
    [("no-placement", 4.0, True), ("no-placement", 2.0, False), ("llumnix", 2.0, True)],
)
def test_no_placement_moves_a_request_only_when_the_move_pays_as_dilaserve_does(policy, now, moves):
    # tests/test_scheduler.py's move case: b (r2's) holds fewer tokens than a (the longer r3), so
    # least tokens picks b for r1's recompute; at 2.0 waiting for b's running step costs more
    # than it saves over r1's block, and only the baseline, which does not price moves, goes
    s = scheduler(policy, instances=(("a", 1), ("b", 1)))
    r1, r2 = (make_request(f"r{i}", gen_len=2 * BLOCK, arrival_time=i) for i in (1, 2))
    r3 = make_request("r3", gen_len=3 * BLOCK, arrival_time=2)
    s.on_arrival(r1, 1.0)
    s.on_arrival(r2, 2.0)
    s.on_arrival(r3, 2.0)
    assert [s.requests[r].instance for r in ("r1", "r2", "r3")] == ["a", "b", "a"]
    d = done(s, "a", result(r1, list(range(BLOCK)), block_done=True), now=now)
    assert (d.releases == (("a", "r1"),)) is moves
