"""Scheduler tests, thresholds and load control: which threshold a request's step gets, priced
at the profile or at the measured speed, and what load control allows each request."""

from dataclasses import replace

import pytest
from scheduler_helpers import BLOCK, PROFILE, FakePredictor, done, only_launch, result, scheduler

from dilaserve.control.scheduler import SchedulerConfig
from dilaserve.control.speed import batch_bin, batch_seconds
from dilaserve.protocol import StepBatch, StepKind

from conftest import make_request


@pytest.mark.parametrize("slo, expected", [(0.05, 0.9), (0.025, 0.5)])
def test_threshold_is_the_highest_that_fits_the_budget(slo, expected):
    # TP-2, 21 tokens: recompute ~7.5 ms, cache 3 ms; two blocks -> two recompute steps.
    # 0.9: 8 steps = 2 x 7.5 + 6 x 3 = 33 ms; 0.5: 4 steps = 2 x 7.5 + 2 x 3 = 21 ms
    s = scheduler(instances=(("b", 2),), slo=slo)
    launch = only_launch(s.on_arrival(make_request("r", gen_len=2 * BLOCK), 0.0))
    assert launch.batch.items[0].threshold == expected


def test_headroom_sizes_the_threshold_for_a_share_of_the_budget():
    # the 50 ms budget of the case above, of which half counts: 0.9 (33 ms) no longer fits
    s = scheduler(instances=(("b", 2),), slo=0.05, slo_headroom=0.5)
    launch = only_launch(s.on_arrival(make_request("r", gen_len=2 * BLOCK), 0.0))
    assert launch.batch.items[0].threshold == 0.5


def test_the_headroom_extension_policy_overrides_the_papers_rule():
    # the paper's rule is the config's default (1.0): 0.9 fits the 50 ms budget; the named
    # extension `dilaserve-headroom` fits half of it, whatever the config says
    assert SchedulerConfig().slo_headroom == 1.0
    paper = scheduler(instances=(("b", 2),), slo=0.05)
    tuned = scheduler("dilaserve-headroom", instances=(("b", 2),), slo=0.05)
    for s, expected in ((paper, 0.9), (tuned, 0.5)):
        launch = only_launch(s.on_arrival(make_request("r", gen_len=2 * BLOCK), 0.0))
        assert launch.batch.items[0].threshold == expected


def learned_lateness(s, ratio, now, n=16):
    """`n` finished requests that each took `ratio` times their estimate, by `now`."""
    for i in range(n):
        s.deadline.admitted(f"past{i}", 1.0, now - ratio)
        s.deadline.finished_at(f"past{i}", now)


def test_the_default_prices_the_time_left_at_how_late_requests_turned_out():
    # the 50 ms budget fits 0.9 (33 ms) while nothing has finished; once requests took twice
    # their estimate, 0.9 prices at 66 ms and 0.5 (42 ms) is chosen. The paper's reading
    # (`dilaserve-paper`) keeps the point estimate.
    picked = {}
    for policy, lateness in (("dilaserve", None), ("dilaserve", 2.0), ("dilaserve-paper", 2.0)):
        s = scheduler(policy, instances=(("b", 2),), slo=0.05)
        if lateness is not None and s.deadline is not None:
            learned_lateness(s, lateness, now=10.0)
        req = make_request("r", gen_len=2 * BLOCK, arrival_time=10.0)
        launch = only_launch(s.on_arrival(req, 10.0))
        picked[policy, lateness] = launch.batch.items[0].threshold
    assert picked == {
        ("dilaserve", None): 0.9,
        ("dilaserve", 2.0): 0.5,
        ("dilaserve-paper", 2.0): 0.9,
    }


def test_a_requests_first_estimate_is_measured_when_it_finishes_and_dropped_if_not():
    s = scheduler(instances=(("a", 1),))
    kept, cancelled = make_request("r"), make_request("c")
    s.on_arrival(kept, 0.0)
    s.on_arrival(cancelled, 0.0)
    assert "r" in s.deadline and "c" in s.deadline
    s.cancel("c")
    done(s, "a", result(kept, list(range(kept.gen_len)), block_done=True, finished=True), now=3.0)
    assert s.deadline.finished == 1 and s.deadline.pending == 0


def test_measured_slowdown_prices_the_remaining_steps_at_the_speed_steps_run():
    # the 50 ms budget fits 0.9 (33 ms at the profile's speed), not at 1.6x (53 ms); a faster
    # machine than profiled (0.5x) leaves the profile's prices
    picked = {}
    for ratio in (1.0, 1.6, 0.5):
        s = scheduler(instances=(("b", 2),), slo=0.05)
        s.speed.ratio = ratio
        launch = only_launch(s.on_arrival(make_request("r", gen_len=2 * BLOCK), 0.0))
        picked[ratio] = launch.batch.items[0].threshold
    assert picked == {1.0: 0.9, 1.6: 0.5, 0.5: 0.9}


def test_a_runs_slowdown_is_its_measured_time_over_the_profiles():
    # what a prediction of the host takes (`SimConfig.step_slowdown`): every step counts, where
    # the running ratio forgets, and the steps' seconds add up as the prediction's will
    s = scheduler(instances=(("a", 1),), slo=10.0)
    launch = only_launch(s.on_arrival(make_request("r"), 0.0))
    price = batch_seconds(PROFILE, 1, launch.batch, s.config.costs, s.requests)
    assert s.speed.run_ratio == 1.0  # nothing observed yet
    for ratio in (0.5, 2.0, 4.0):
        s.speed.observe(1, launch.batch, ratio * price)
    assert s.speed.steps == 3 and s.speed.run_ratio == pytest.approx((0.5 + 2.0 + 4.0) / 3)


def test_a_runs_slowdown_per_batch_size_keeps_each_sizes_steps_apart():
    s = scheduler(instances=(("a", 1),), slo=10.0)
    first = only_launch(s.on_arrival(make_request("r"), 0.0)).batch  # a step of one request
    for rid in ("x", "y"):
        s.on_arrival(make_request(rid), 0.0)
    three = StepBatch(tuple(replace(first.items[0], request_id=rid) for rid in ("r", "x", "y")))
    one, many = (batch_seconds(PROFILE, 1, b, s.config.costs, s.requests) for b in (first, three))
    s.speed.observe(1, first, 0.5 * one)
    s.speed.observe(1, three, 2.0 * many)
    s.speed.observe(1, three, 4.0 * many)
    assert [batch_bin(n) for n in (1, 2, 3, 4, 7, 8, 100)] == [1, 2, 2, 4, 4, 8, 64]
    assert s.speed.run_ratio_by_batch() == pytest.approx({1: 0.5, 2: 3.0})


@pytest.mark.parametrize(
    "policy, setting, by_speed",
    [
        ("dilaserve", None, True),  # DiLaServe's default
        ("dilaserve-paper", None, False),  # Alg. 3 as written: the profile alone
        ("dilaserve", False, False),  # --no-instance-speed
        ("dilaserve-paper", True, True),  # --instance-speed
    ],
)
def test_placement_prices_a_straggler_at_its_measured_speed_where_the_policy_says(
    policy, setting, by_speed
):
    # b (TP-2) is the profile's faster instance; measured 3x slower than its profile, it is the
    # slower one, and only pricing each instance at its own speed takes that into Alg. 3's price
    s = scheduler(policy, instance_speed=setting)
    first = only_launch(s.on_arrival(make_request("r", gen_len=2 * BLOCK), 0.0))
    price = batch_seconds(PROFILE, 2, first.batch, s.config.costs, s.requests)
    s.speed.observe(2, first.batch, 3 * price, "b")
    assert s.speed.instance_ratio("b") == pytest.approx(1.1) and s.speed.instance_ratio("a") == 1
    for _ in range(100):  # as after many steps, the latest at the next arrival's time
        s.speed.observe(2, first.batch, 3 * price, "b", now=1.0)
    assert s.speed.instance_ratio("b") == pytest.approx(3.0, rel=0.01)
    done(s, "b", result(s.requests["r"].request, [0], kind=StepKind.RECOMPUTE))
    x = make_request("x", gen_len=2 * BLOCK, arrival_time=0.0)
    s.on_arrival(x, 1.0)
    assert s.requests["x"].instance == ("a" if by_speed else "b")


def test_measured_slowdown_shrinks_load_controls_capacity():
    # two requests fit at 0.9 in a 100 ms window (2 x 168 of 500 token-steps); at 1.9x slower
    # steps it holds 263: the early one at 0.9 and the later at 0.5 (84) only (Alg. 2/4's window)
    s = scheduler("dilaserve-slo-load", instances=(("a", 1),), slo=0.1, kv_cache="none")
    s.speed.ratio = 1.9
    s.on_arrival(make_request("early", arrival_time=0.0), 0.0)
    s.on_arrival(make_request("late", arrival_time=0.01), 0.01)
    assert (s.requests["early"].allowed, s.requests["late"].allowed) == ((0.9, 0.5), (0.5,))


@pytest.mark.parametrize("policy, expected", [("no-lost-work", 0.5), ("dilaserve", 0.9)])
def test_nothing_fits_falls_through_to_the_lowest_threshold(policy, expected):
    # served like the others, a request nothing fits gets the lowest threshold; found lost (the
    # default), its deadline is gone and it runs at the top (`quality_budget.py`)
    s = scheduler(policy, instances=(("b", 2),), slo=1e-6)
    launch = only_launch(s.on_arrival(make_request("r", gen_len=2 * BLOCK), 0.0))
    assert launch.batch.items[0].threshold == expected


@pytest.mark.parametrize(
    "policy, bounds, expected",
    [
        ("dilaserve", (0.85, 0.85), 0.85),  # a pinned threshold outside the ladder
        ("dilaserve", (0.6, 0.95), 0.9),  # the budget fits 0.9 and the request accepts it
        ("dilaserve", (0.95, 1.0), 0.95),  # nothing allowed is accepted: the nearest accepted
        ("fcfs", (0.5, 0.7), 0.7),  # a fixed-threshold policy still honours the request
    ],
)
def test_a_request_gets_a_threshold_within_its_own_bounds(policy, bounds, expected):
    s = scheduler(policy, instances=(("b", 2),), slo=0.05)
    request = make_request("r", gen_len=2 * BLOCK, threshold_bounds=bounds)
    launch = only_launch(s.on_arrival(request, 0.0))
    assert launch.batch.items[0].threshold == expected


def test_bounds_that_are_not_thresholds_are_refused():
    with pytest.raises(ValueError, match="min_threshold <= max_threshold"):
        make_request("r", threshold_bounds=(0.9, 0.5))


# 21-token requests without a cache: load 8 x 21 = 168 token-steps at 0.9, 84 at 0.5. TP-1's best
# throughput is 5,000 tokens/s, so a 60 ms window holds 300: one request at 0.9 plus one at 0.5
# (Alg. 2/4's one SLO window: `dilaserve-slo-load`).
SHORT_SLO = 0.06


def test_load_control_caps_late_arrivals_when_capacity_is_short():
    s = scheduler("dilaserve-slo-load", instances=(("a", 1),), slo=SHORT_SLO, kv_cache="none")
    early, late = make_request("early", arrival_time=0.0), make_request("late", arrival_time=1.0)
    s.on_arrival(early, 0.0)
    s.on_arrival(late, 1.0)
    assert s.requests["early"].allowed == (0.9, 0.5)
    assert s.requests["late"].allowed == (0.5,)


def test_the_budget_window_binds_where_a_whole_slo_window_does_not():
    # a 100 ms SLO holds 500 token-steps: both requests at 0.9 (336) fit. At 80 ms the two have
    # 20 and 100 ms left, 60 ms on average: 300 token-steps, so the late one gets 0.5 only.
    # `dilaserve-slo-load` is Alg. 2/4's window as written; the default takes the budget left
    # (every request capped here, two blocks to go or not: the window alone)
    allowed = {}
    for policy in ("dilaserve-slo-load", "dilaserve-budget", "dilaserve"):
        s = scheduler(policy, instances=(("a", 1),), slo=0.1, kv_cache="none")
        s.load_control.last_block_caps = False
        s.on_arrival(make_request("early", arrival_time=0.0), 0.0)
        s.on_arrival(make_request("late", arrival_time=0.08), 0.08)
        allowed[policy] = (s.requests["early"].allowed, s.requests["late"].allowed)
    assert allowed["dilaserve-slo-load"] == ((0.9, 0.5), (0.9, 0.5))
    assert allowed["dilaserve-budget"] == ((0.9, 0.5), (0.5,))
    assert allowed["dilaserve"] == ((0.9, 0.5), (0.5,))


def test_the_default_prices_the_work_in_flight_at_how_late_requests_turned_out():
    # a 200 ms SLO; at 10.01 s the two requests have 190 and 200 ms left, 195 ms on average:
    # 975 token-steps. Both at 0.9 (336) fit at the point estimate; once requests took three
    # times their estimate, 336 x 3 = 1,008 does not, and 0.9 then 0.5 (252 x 3 = 756) does
    allowed = {}
    for policy in ("dilaserve-budget", "dilaserve"):
        s = scheduler(policy, instances=(("a", 1),), slo=0.2, kv_cache="none")
        s.load_control.last_block_caps = False  # (every request capped: the pricing alone)
        learned_lateness(s, 3.0, now=10.0)
        s.on_arrival(make_request("early", arrival_time=10.0), 10.0)
        s.on_arrival(make_request("late", arrival_time=10.01), 10.01)
        allowed[policy] = (s.requests["early"].allowed, s.requests["late"].allowed)
    assert allowed["dilaserve-budget"] == ((0.9, 0.5), (0.9, 0.5))
    assert allowed["dilaserve"] == ((0.9, 0.5), (0.5,))


@pytest.mark.parametrize(
    "policy, blocks, arrival, late_allowed",
    [
        ("dilaserve-all-caps", 2, 0.08, (0.5,)),  # as written: every request capped
        ("dilaserve", 2, 0.08, (0.9, 0.5)),  # blocks to go: left to Alg. 1's next choice
        ("dilaserve", 1, 0.095, (0.5,)),  # its last block: capped
    ],
)
def test_caps_reach_only_a_request_in_its_last_block(policy, blocks, arrival, late_allowed):
    s = scheduler(policy, instances=(("a", 1),), slo=0.1, kv_cache="none")
    s.on_arrival(make_request("early", arrival_time=0.0), 0.0)
    late = make_request("late", arrival_time=arrival, gen_len=blocks * BLOCK)
    s.on_arrival(late, arrival)
    assert s.requests["late"].allowed == late_allowed


def test_load_control_serves_a_later_high_priority_request_first():
    s = scheduler("dilaserve-slo-load", instances=(("a", 1),), slo=SHORT_SLO, kv_cache="none")
    s.on_arrival(make_request("early", arrival_time=0.0), 0.0)
    s.on_arrival(make_request("urgent", arrival_time=1.0, priority=1), 1.0)
    assert s.requests["urgent"].allowed == (0.9, 0.5)
    assert s.requests["early"].allowed == (0.5,)


@pytest.mark.parametrize("deadline, expected", [(0.025, 0.5), (0.05, 0.9)])
def test_each_request_is_held_to_its_own_deadline(deadline, expected):
    # the same work as above, under the request's own deadline instead of the default SLO
    s = scheduler(instances=(("b", 2),), slo=100.0)
    req = make_request("r", gen_len=2 * BLOCK, deadline=deadline)
    assert only_launch(s.on_arrival(req, 0.0)).batch.items[0].threshold == expected


def test_refresh_interval_batches_later_refreshes_of_running_requests_but_not_first_ones():
    predictor = FakePredictor()
    s = scheduler(instances=(("a", 1), ("b", 1)), predictor=predictor, refresh_interval=1.0)
    home = {}
    for name, now in (("r1", 0.0), ("r2", 0.1)):
        req = make_request(name, gen_len=4 * BLOCK)
        home[name] = (req, only_launch(s.on_arrival(req, now)).instance_id)
    assert predictor.batches == [["r1"], ["r2"]]  # a new request is predicted at once

    def step(name, positions, now):
        req, instance = home[name]
        done(s, instance, result(req, positions, block_done=len(positions) == BLOCK), now=now)

    step("r1", list(range(BLOCK)), now=0.5)  # 32 tokens: due, and no refresh has run yet
    assert predictor.batches[-1] == ["r1"]
    step("r2", list(range(BLOCK)), now=0.6)  # due, within the interval: waits
    assert predictor.calls == 3
    step("r1", list(range(BLOCK, BLOCK + 8)), now=1.6)  # due again: one call for both,
    assert predictor.batches[-1] == ["r2", "r1"]  # though r2's next step is running


def test_a_dws_prior_replaces_the_step_predictor_before_the_first_step():
    # the predictor says 0.9 fits (8 steps); the prior says 0.9 takes 1000 steps: 0.5 is chosen
    s = scheduler(instances=(("b", 2),), slo=0.05)
    request = make_request("r", gen_len=2 * BLOCK, prior_steps={0.5: 4.0, 0.9: 1000.0})
    assert only_launch(s.on_arrival(request, 0.0)).batch.items[0].threshold == 0.5
    plain = scheduler(instances=(("b", 2),), slo=0.05)
    assert (
        only_launch(plain.on_arrival(make_request("r", gen_len=2 * BLOCK), 0.0))
        .batch.items[0]
        .threshold
        == 0.9
    )
