"""The quality budget (`control/quality_budget.py`): finished requests' quality against the top
threshold's, and the floor it raises under Alg. 1, Alg. 2/4 and lost work while over budget."""

import dataclasses

import pytest
from scheduler_helpers import BLOCK, PROFILE, FakePredictor, only_launch

from dilaserve.control.lost_work import Lost
from dilaserve.control.policy import POLICIES, get_policy
from dilaserve.control.quality_budget import QualityBudget
from dilaserve.control.scheduler import Scheduler, SchedulerConfig
from dilaserve.quality import LLADA_GSM8K
from dilaserve.sim.run import SimulationSpec, simulate

from conftest import make_request

LADDER = (0.9, 0.8, 0.7)


def test_the_floor_is_the_top_while_the_finished_requests_lose_more_than_the_budget():
    b = QualityBudget(LLADA_GSM8K, LADDER, budget=0.01)
    assert b.floor(0.0) == 0.7 and b.loss(0.0) == 0.0
    for _ in range(40):
        b.finished_at(0.9, now=1.0)
    for _ in range(24):
        b.finished_at(0.7, now=2.0)  # 24 / 64 x 1.9% = 0.72%: within
    assert b.floor(2.0) == 0.7 and b.raised == 0
    for _ in range(20):
        b.finished_at(0.7, now=3.0)  # every request so far: 44 / 84 x 1.9% = 1.0%
    assert b.loss(3.0) == pytest.approx(44 / 84 * (1 - 0.770 / 0.785))
    assert b.floor(3.0) == 0.9 and b.raised == 1
    # an estimate is not a fact: with nothing finishing, the loss read decays and the floor falls
    assert b.floor(3.0 + 1.0) == 0.7
    for _ in range(4):
        b.finished_at(0.9, now=3.0)  # requests at the top pay it back: 44 / 88 x 1.9%
    assert b.floor(3.0) == 0.7 and b.raised == 1


def test_above_the_floor_keeps_what_is_at_or_above_it_or_gives_the_floor():
    b = QualityBudget(LLADA_GSM8K, LADDER, budget=0.01)
    assert b.above_floor((0.8, 0.7), 0.0) == (0.8, 0.7)  # within the budget: all of them
    for _ in range(10):
        b.finished_at(0.7, now=1.0)
    assert b.above_floor(LADDER, 1.0) == (0.9,)  # over it: the top only
    assert b.above_floor((0.8, 0.7), 1.0) == (0.9,)  # none at or above it: the floor


def test_a_budget_must_be_a_relative_loss():
    with pytest.raises(ValueError, match="budget"):
        QualityBudget(LLADA_GSM8K, LADDER, budget=1.0)


def test_the_default_keeps_a_quality_budget_and_the_papers_reading_does_not():
    assert POLICIES["dilaserve"].quality_budget == 0.01
    assert POLICIES["no-load-control"].quality_budget == 0.01
    assert POLICIES["dilaserve-paper"].quality_budget is None
    with pytest.raises(ValueError, match="quality_budget"):
        get_policy("dilaserve", quality_budget=-0.1)


def squeezed_request_threshold(budget, lost_quality: bool, now=10.0):
    """The threshold a request gets whose budget fits only 0.5 (tests/test_scheduler_thresholds:
    0.9 takes 33 ms, 0.5 21 ms; 25 ms left), after a request finished at 0.5 (3.8% lost), or
    at 0.9."""
    cfg = SchedulerConfig(block_len=BLOCK, slo=0.025)
    policy = get_policy("dilaserve", candidates=(0.5, 0.9), quality_budget=budget)
    s = Scheduler(policy, PROFILE, FakePredictor(), cfg)
    s.add_instance("b", 2, 10_000)
    if s.quality is not None:
        s.quality.finished_at(0.5 if lost_quality else 0.9, now)
    req = make_request("r", gen_len=2 * BLOCK, arrival_time=now)
    return only_launch(s.on_arrival(req, now)).batch.items[0].threshold


def test_alg1_gives_no_threshold_below_the_floor_while_over_budget():
    assert squeezed_request_threshold(0.01, lost_quality=False) == 0.5  # within budget
    assert squeezed_request_threshold(0.01, lost_quality=True) == 0.9  # over: 0.5 closed
    assert squeezed_request_threshold(None, lost_quality=True) == 0.5  # no budget


@pytest.mark.parametrize("over_budget, allowed", [(False, (0.5,)), (True, (0.9, 0.5))])
def test_load_control_caps_no_lower_than_the_floor(over_budget, allowed):
    # a 1 ms SLO: the work in flight fits at no threshold, so Alg. 2/4 leaves each request only
    # the lowest; over budget the floor (0.9) is Alg. 2/4's lowest, so it caps nobody below it
    cfg = SchedulerConfig(block_len=BLOCK, slo=0.001)
    policy = get_policy("dilaserve", candidates=(0.5, 0.9), lost_work=Lost.NEVER)
    s = Scheduler(policy, PROFILE, FakePredictor(), cfg)
    s.add_instance("a", 1, 10_000)
    if over_budget:
        s.quality.finished_at(0.5, 0.0)
    for rid in ("r1", "r2"):  # (one block each: caps reach a request in its last block)
        s.on_arrival(make_request(rid, gen_len=BLOCK), 0.0)
    assert s.requests["r2"].allowed == allowed
    assert s._selection.above_floor(s.requests["r2"].allowed, 0.0) == allowed[:1]


def test_simulated_quality_stays_within_the_budget_where_it_fell_beyond_it():
    # Fig. 10's GSM8K shape at 1.25x the training pressure (docs/control/thresholds.md): without
    # the budget the default lost 1.2% of the fixed-0.9 quality; with it, within 1%. (At the
    # training pressure it lost 1.3% while load control capped every request, 0.98% since its
    # caps reach only the requests in their last block.)
    spec = SimulationSpec(
        trace="fixed:2:300:1020:256", rate_scale=8.0, planner_period=100.0, startup_delay=10.0
    )
    top = LLADA_GSM8K(0.9)
    without = simulate(dataclasses.replace(spec, quality_budget=1.0)).summary
    within = simulate(spec).summary
    assert 1 - without["quality"] / top > 0.01
    assert 1 - within["quality"] / top <= 0.01
    assert within["quality_budget"] == 0.01 and within["quality_floor_raised"] > 0


def test_a_request_its_client_held_below_the_top_spends_none_of_the_budget():
    policy = get_policy("dilaserve", candidates=(0.5, 0.9))
    s = Scheduler(policy, PROFILE, FakePredictor(), SchedulerConfig(block_len=BLOCK, slo=1.0))
    pinned = make_request("pinned", threshold=0.5)
    pinned.threshold_bounds = (1e-9, 0.5)  # the client's `max_threshold`
    s._selection.finished(pinned, 0.0)
    assert s.quality.finished == 0 and s.quality.floor(0.0) == 0.5
    chosen = make_request("chosen", threshold=0.5)  # at 0.5 by the controller's choice
    s._selection.finished(chosen, 0.0)
    assert s.quality.finished == 1 and s.quality.floor(0.0) == 0.9
