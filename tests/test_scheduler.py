"""Scheduler tests: hand-made StepOutputs in, decisions out."""

from dataclasses import replace

import numpy as np
import pytest

from dilaserve.control.instance import InstanceState
from dilaserve.control.policy import get_policy
from dilaserve.control.profile import Curve, LatencyProfile
from dilaserve.control.scheduler import Scheduler, SchedulerConfig
from dilaserve.control.speed import batch_bin, batch_seconds
from dilaserve.control.thresholds import instance_capacity
from dilaserve.protocol import RequestStepResult, StepBatch, StepKind, StepOutput

from conftest import make_request

BLOCK = 8
# TP-2 steps take 60% of TP-1's; latency grows with batch tokens
PROFILE = LatencyProfile.from_dict(
    {
        "entries": [
            {"tp": tp, "kind": kind, "batch_tokens": n, "ms": ms * (0.6 if tp == 2 else 1.0)}
            for tp in (1, 2)
            for kind, pts in (
                ("recompute", ((8, 10), (1000, 200))),
                ("cache", ((8, 5), (800, 100))),
            )
            for n, ms in pts
        ]
    }
)


class FakePredictor:
    thresholds = (0.5, 0.9)

    def __init__(self, steps=None):
        self.steps = steps or {0.5: 4.0, 0.9: 8.0}
        self.calls = 0
        self.batches = []

    def predict(self, request_ids, states):
        self.calls += 1
        self.batches.append(list(request_ids))
        return np.array([[self.steps[t] for t in self.thresholds] for _ in request_ids])


def scheduler(
    policy="dilaserve", instances=(("a", 1), ("b", 2)), max_tokens=10_000, predictor=None, **config
):
    cfg = SchedulerConfig(block_len=BLOCK, **{"slo": 100.0, "slo_headroom": 1.0, **config})
    pol = get_policy(policy, candidates=(0.5, 0.9))
    s = Scheduler(pol, PROFILE, predictor or FakePredictor(), cfg)
    for name, tp in instances:
        s.add_instance(name, tp, max_tokens)
    return s


def result(req, positions, block_done=False, finished=False, kind=StepKind.RECOMPUTE):
    positions = np.array(positions, dtype=np.int32)
    return RequestStepResult(
        req.request_id,
        kind,
        positions,
        np.full(len(positions), 3, np.int32),
        np.full(req.gen_len, 0.5, np.float32),
        req.current_block,
        block_done,
        finished,
    )


def done(s, instance, *results, now=1.0):
    return s.on_step_done(instance, StepOutput(tuple(results), 0), now=now)


def only_launch(decisions):
    [launch] = decisions.launches
    return launch


def test_arrival_goes_to_the_fastest_instance_with_its_sequence():
    s = scheduler()
    req = make_request("r", gen_len=2 * BLOCK)
    launch = only_launch(s.on_arrival(req, now=0.0))
    assert launch.instance_id == "b"  # TP-2
    [item] = launch.batch.items
    assert item.kind is StepKind.RECOMPUTE and item.spec is not None
    assert item.spec.prompt_ids == req.prompt_ids


def test_cache_steps_stay_with_the_cache_even_when_another_instance_is_faster():
    s = scheduler(instances=(("a", 1), ("b", 1)))
    req = make_request("r", gen_len=2 * BLOCK)
    s.on_arrival(req, 0.0)  # on a
    s.on_arrival(make_request("x", gen_len=BLOCK, arrival_time=0.0), 0.0)  # on b, fewer tokens
    # b's batch is the cheaper one to join, but r's next step, without a block end, is a cache step
    launch = only_launch(done(s, "a", result(req, [0])))
    assert launch.instance_id == "a"
    [item] = launch.batch.items
    assert item.kind is StepKind.CACHE and item.spec is None


def test_alg3_prices_the_step_with_the_whole_batch_not_when_the_instance_is_free():
    s = scheduler()  # a: TP-1, b: TP-2 (0.6x the latency)
    r = make_request("r", gen_len=2 * BLOCK)
    assert only_launch(s.on_arrival(r, 0.0)).instance_id == "b"
    # a step of 42 tokens on TP-2 (9.9 ms) beats 21 alone on TP-1 (12.5 ms): x waits for b's
    # running step rather than starting on idle a (the paper's argmin over the latency profile)
    x = make_request("x", gen_len=2 * BLOCK, arrival_time=0.0)
    assert s.on_arrival(x, 0.0).launches == ()
    assert s.instances["b"].pending == ["x"]


def test_request_migrates_only_before_a_recompute_step():
    s = scheduler(instances=(("a", 1), ("b", 1)))
    first = make_request("r1", gen_len=2 * BLOCK)
    second = make_request("r2", gen_len=2 * BLOCK, arrival_time=0.5)
    assert only_launch(s.on_arrival(first, 0.0)).instance_id == "a"
    assert only_launch(s.on_arrival(second, 0.5)).instance_id == "b"
    # r2's step on b ends its block; a is idle again too -> both are candidates; r1 pending on a
    d = done(s, "a", result(first, list(range(BLOCK)), block_done=True))
    assert only_launch(d).instance_id == "a"  # a is idle and empty: r1 recomputes there
    d = done(s, "b", result(second, list(range(BLOCK)), block_done=True))
    # b is idle, a is busy with r1; r2's next step is a recompute, b (its home) is cheapest
    assert only_launch(d).instance_id == "b"


def test_migration_sends_the_sequence_and_releases_the_old_copy():
    s = scheduler(instances=(("a", 1), ("b", 1)))
    r1, r2 = (make_request(f"r{i}", gen_len=2 * BLOCK, arrival_time=i) for i in (1, 2))
    r3 = make_request("r3", gen_len=8 * BLOCK, arrival_time=3)
    assert only_launch(s.on_arrival(r1, 1.0)).instance_id == "a"
    assert only_launch(s.on_arrival(r2, 2.0)).instance_id == "b"
    assert s.on_arrival(r3, 3.0).launches == ()  # both busy: r3 waits in a's next batch
    d = done(s, "a", result(r1, list(range(BLOCK)), block_done=True), now=4.0)
    # r1 ends its block; joining the long r3 on a costs more than joining r2, which comes back
    # to b when its running step ends (Alg. 3 counts the instance's whole batch) -> r1 moves
    assert d.releases == (("a", "r1"),)
    assert [i.request_id for i in only_launch(d).batch.items] == ["r3"]
    launch = only_launch(done(s, "b", result(r2, [0]), now=4.1))
    moved = {i.request_id: i for i in launch.batch.items}
    assert launch.instance_id == "b" and moved["r1"].spec is not None
    assert moved["r1"].kind is StepKind.RECOMPUTE and moved["r2"].spec is None


@pytest.mark.parametrize(
    "now, price, moves",
    [(4.0, 0.0, True), (4.0, 1.0, False), (2.0, 0.0, False)],
)
def test_a_request_moves_only_when_its_step_ends_first_there_by_more_than_the_price(
    now, price, moves
):
    # the case above: r1's recompute ends sooner with r2 on b than with the long r3 on a, but b
    # starts it only when its running step (r2's, launched at 2.0) ends. At 4.0 that step is
    # long over and the move pays, unless a move costs a second; at 2.0 waiting for it takes
    # longer than b saves
    s = scheduler(instances=(("a", 1), ("b", 1)), migration_price=price)
    r1, r2 = (make_request(f"r{i}", gen_len=2 * BLOCK, arrival_time=i) for i in (1, 2))
    r3 = make_request("r3", gen_len=8 * BLOCK, arrival_time=2)
    s.on_arrival(r1, 1.0)
    s.on_arrival(r2, 2.0)
    s.on_arrival(r3, 2.0)
    a, b = s.instances["a"], s.instances["b"]
    wait = b.busy_until - 2.0
    saving = a.full_curve.at(r1.num_tokens + r3.num_tokens) - b.full_curve.at(
        r1.num_tokens + r2.num_tokens
    )
    assert 0 < saving < wait  # what makes the move lose at 2.0
    d = done(s, "a", result(r1, list(range(BLOCK)), block_done=True), now=now)
    assert (d.releases == (("a", "r1"),)) is moves
    assert s.requests["r1"].instance == ("b" if moves else "a")


def test_no_migration_keeps_a_request_on_its_first_instance():
    s = scheduler("no-migration", instances=(("a", 1), ("b", 1)))
    req = make_request("r", gen_len=2 * BLOCK)
    home = only_launch(s.on_arrival(req, 0.0)).instance_id
    other = make_request("x", gen_len=2 * BLOCK)
    s.on_arrival(other, 0.0)
    launch = only_launch(done(s, home, result(req, list(range(BLOCK)), block_done=True)))
    assert launch.instance_id == home


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


def test_the_instance_speed_extension_prices_a_straggler_at_its_measured_speed():
    # b (TP-2) is the profile's faster instance; measured 3x slower than its profile, it is the
    # slower one, and only the extension takes that into Alg. 3's price
    placed = {}
    for extension in (False, True):
        s = scheduler(instance_speed=extension)
        first = only_launch(s.on_arrival(make_request("r", gen_len=2 * BLOCK), 0.0))
        price = batch_seconds(PROFILE, 2, first.batch, s.config.costs, s.requests)
        s.speed.observe(2, first.batch, 3 * price, "b")
        assert (
            s.speed.instance_ratio("b") == pytest.approx(1.1) and s.speed.instance_ratio("a") == 1
        )
        for _ in range(100):  # as after many steps, the latest at the next arrival's time
            s.speed.observe(2, first.batch, 3 * price, "b", now=1.0)
        assert s.speed.instance_ratio("b") == pytest.approx(3.0, rel=0.01)
        done(s, "b", result(s.requests["r"].request, [0], kind=StepKind.RECOMPUTE))
        x = make_request("x", gen_len=2 * BLOCK, arrival_time=0.0)
        s.on_arrival(x, 1.0)
        placed[extension] = s.requests["x"].instance
    assert placed == {False: "b", True: "a"}


def test_measured_slowdown_shrinks_load_controls_capacity():
    # two requests fit at 0.9 in a 100 ms window (2 x 168 of 500 token-steps); at 1.9x slower
    # steps it holds 263: the early one at 0.9 and the later at 0.5 (84) only
    s = scheduler(instances=(("a", 1),), slo=0.1, kv_cache="none")
    s.speed.ratio = 1.9
    s.on_arrival(make_request("early", arrival_time=0.0), 0.0)
    s.on_arrival(make_request("late", arrival_time=0.01), 0.01)
    assert (s.requests["early"].allowed, s.requests["late"].allowed) == ((0.9, 0.5), (0.5,))


def test_nothing_fits_falls_through_to_the_lowest_threshold():
    s = scheduler(instances=(("b", 2),), slo=1e-6)
    launch = only_launch(s.on_arrival(make_request("r", gen_len=2 * BLOCK), 0.0))
    assert launch.batch.items[0].threshold == 0.5


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


def test_a_cancelled_request_leaves_its_instance_and_its_running_step_is_ignored():
    s = scheduler(instances=(("a", 1),))
    running, waiting = make_request("r1"), make_request("r2")
    assert only_launch(s.on_arrival(running, 0.0)).batch.items[0].request_id == "r1"
    assert not s.on_arrival(waiting, 0.0).launches  # gathered for a's next step
    assert s.cancel("r2").releases == ()  # never ran anywhere
    assert s.cancel("r1").releases == (("a", "r1"),)
    done = s.on_step_done("a", StepOutput((result(running, [0, 1, 2]),), 0), 0.01)
    assert not done.launches and not done.finished and not s.requests

    predictor = FakePredictor()
    s = scheduler("fcfs", predictor=predictor, slo=1e-6)
    launch = only_launch(s.on_arrival(make_request("r"), 0.0))
    assert launch.batch.items[0].threshold == 0.9 and predictor.calls == 0


def test_fcfs_is_a_queue_that_only_a_free_instance_takes_from():
    # infaas gathers a new request into its instance's next batch at once; fcfs keeps it in the
    # queue until an instance is between steps, then the free one takes it
    for policy, gathered in (("infaas", ["r3"]), ("fcfs", [])):
        s = scheduler(policy, instances=(("a", 1), ("b", 1)))
        r1, r2, r3 = (make_request(f"r{i}") for i in (1, 2, 3))
        assert only_launch(s.on_arrival(r1, 0.0)).instance_id == "a"
        assert only_launch(s.on_arrival(r2, 0.0)).instance_id == "b"
        assert not s.on_arrival(r3, 0.0).launches
        assert s.instances["a"].pending + s.instances["b"].pending == gathered
    launch = only_launch(done(s, "b", result(r2, [0, 1]), now=0.1))
    assert [i.request_id for i in launch.batch.items] == ["r2", "r3"]


def test_requests_of_a_failed_step_resume_alone_and_no_one_joins_them():
    s = scheduler("infaas", instances=(("a", 1),))
    r1, r2, r3 = (make_request(f"r{i}") for i in (1, 2, 3))
    s.on_arrival(r1, 0.0)
    s.on_arrival(r2, 0.0)  # gathered for a's next step
    together = only_launch(done(s, "a", result(r1, [0, 1]), now=0.1))
    assert [i.request_id for i in together.batch.items] == ["r2", "r1"]
    retry = s.retry_alone("a", ["r2", "r1"], 0.2)  # that step failed
    assert retry.releases == (("a", "r2"), ("a", "r1"))  # their state there is dropped
    [item] = only_launch(retry).batch.items  # r1 first (service order), alone
    assert item.request_id == "r1" and item.kind is StepKind.RECOMPUTE
    assert list(item.spec.output_ids[:2] != r1.mask_id) == [True, True]  # its 2 commits kept
    assert not s.on_arrival(r3, 0.3).launches
    assert s.instances["a"].pending == ["r2"]  # alone: r3, arriving later, waits
    [item] = only_launch(
        done(s, "a", result(r1, [2], kind=StepKind.RECOMPUTE), now=0.4)
    ).batch.items
    assert item.request_id == "r2"


def test_full_instance_defers_the_request_until_its_step_ends():
    s = scheduler(instances=(("a", 1),), max_tokens=30)
    r1, r2 = make_request("r1", prompt_len=8), make_request("r2", prompt_len=8)  # 24 each
    s.on_arrival(r1, 0.0)
    assert s.on_arrival(r2, 0.1).launches == ()  # a is busy; r2 waits in a's next batch
    launch = only_launch(done(s, "a", result(r1, [0])))
    # r2 (24 tokens) fills a's next batch; r1's cache step (8 more) would exceed 30: it waits
    assert [i.request_id for i in launch.batch.items] == ["r2"]
    assert "r1" in s._ready


def test_finished_requests_are_reported_and_forgotten():
    s = scheduler(instances=(("a", 1),))
    req = make_request("r")
    s.on_arrival(req, 0.0)
    d = done(s, "a", result(req, list(range(req.gen_len)), block_done=True, finished=True))
    assert d.finished == ("r",) and d.launches == () and "r" not in s.requests


# 21-token requests without a cache: load 8 x 21 = 168 token-steps at 0.9, 84 at 0.5. TP-1's best
# throughput is 5,000 tokens/s, so a 60 ms window holds 300: one request at 0.9 plus one at 0.5.
SHORT_SLO = 0.06


def test_load_control_caps_late_arrivals_when_capacity_is_short():
    s = scheduler(instances=(("a", 1),), slo=SHORT_SLO, kv_cache="none")
    early, late = make_request("early", arrival_time=0.0), make_request("late", arrival_time=1.0)
    s.on_arrival(early, 0.0)
    s.on_arrival(late, 1.0)
    assert s.requests["early"].allowed == (0.9, 0.5)
    assert s.requests["late"].allowed == (0.5,)


def test_the_budget_window_extension_binds_where_a_whole_slo_window_does_not():
    # a 100 ms SLO holds 500 token-steps: both requests at 0.9 (336) fit. At 80 ms the two have
    # 20 and 100 ms left, 60 ms on average: 300 token-steps, so the late one gets 0.5 only
    allowed = {}
    for policy in ("dilaserve", "dilaserve-budget"):
        s = scheduler(policy, instances=(("a", 1),), slo=0.1, kv_cache="none")
        s.on_arrival(make_request("early", arrival_time=0.0), 0.0)
        s.on_arrival(make_request("late", arrival_time=0.08), 0.08)
        allowed[policy] = (s.requests["early"].allowed, s.requests["late"].allowed)
    assert allowed["dilaserve"] == ((0.9, 0.5), (0.9, 0.5))
    assert allowed["dilaserve-budget"] == ((0.9, 0.5), (0.5,))


def test_infaas_binds_each_request_at_arrival_to_the_least_loaded_instance():
    s = scheduler("infaas", instances=(("a", 1), ("b", 1)))
    s.on_arrival(make_request("r1"), 0.0)
    s.on_arrival(make_request("r2"), 0.0)
    assert {s.requests["r1"].bound, s.requests["r2"].bound} == {"a", "b"}


def test_removed_instance_hands_its_requests_to_the_others():
    s = scheduler(instances=(("a", 1), ("b", 1)))
    req = make_request("r")
    home = only_launch(s.on_arrival(req, 0.0)).instance_id
    other = "b" if home == "a" else "a"
    launch = only_launch(s.remove_instance(home, 1.0))
    assert launch.instance_id == other and launch.batch.items[0].spec is not None


def test_load_control_serves_a_later_high_priority_request_first():
    s = scheduler(instances=(("a", 1),), slo=SHORT_SLO, kv_cache="none")
    s.on_arrival(make_request("early", arrival_time=0.0), 0.0)
    s.on_arrival(make_request("urgent", arrival_time=1.0, priority=1), 1.0)
    assert s.requests["urgent"].allowed == (0.9, 0.5)
    assert s.requests["early"].allowed == (0.5,)


def test_when_room_is_short_the_higher_priority_request_is_placed_first():
    s = scheduler(instances=(("a", 1),), max_tokens=40)  # recompute step 24 tokens, cache 8
    low, high = make_request("low", prompt_len=8), make_request("high", prompt_len=8, priority=2)
    s.on_arrival(low, 0.0)
    s.on_arrival(high, 0.1)  # waits for a's next batch
    launch = only_launch(done(s, "a", result(low, [0])))
    assert [i.request_id for i in launch.batch.items] == ["high", "low"]  # 24 + 8 tokens
    both_blocks_done = (
        result(high, list(range(BLOCK)), block_done=True),
        result(low, list(range(1, BLOCK)), block_done=True, kind=StepKind.CACHE),
    )
    # both now need a 24-token recompute step; only one fits in 40 tokens
    launch = only_launch(done(s, "a", *both_blocks_done, now=2.0))
    assert [i.request_id for i in launch.batch.items] == ["high"]


@pytest.mark.parametrize("deadline, expected", [(0.025, 0.5), (0.05, 0.9)])
def test_each_request_is_held_to_its_own_deadline(deadline, expected):
    # the same work as above, under the request's own deadline instead of the default SLO
    s = scheduler(instances=(("b", 2),), slo=100.0)
    req = make_request("r", gen_len=2 * BLOCK, deadline=deadline)
    assert only_launch(s.on_arrival(req, 0.0)).batch.items[0].threshold == expected


def test_a_draining_instance_finishes_its_step_then_hands_its_requests_on():
    s = scheduler(instances=(("a", 1),))
    running, waiting = make_request("running"), make_request("waiting")
    s.on_arrival(running, 0.0)
    s.on_arrival(waiting, 0.1)  # waits for a's next batch
    s.add_instance("b", 1, 10_000)
    d = s.drain_instance("a", 0.2)
    assert [(launch.instance_id, launch.batch.items[0].request_id) for launch in d.launches] == [
        ("b", "waiting")
    ]
    assert not s.is_idle("a")
    # mid-block, the next step is a cache step: it stays with its cache on the draining a
    launch = only_launch(done(s, "a", result(running, [0]), now=0.3))
    assert launch.instance_id == "a" and launch.batch.items[0].kind is StepKind.CACHE
    assert not s.is_idle("a")
    # the block is done: the next step is a recompute step, taken elsewhere; a is then idle
    d = done(s, "a", result(running, list(range(1, BLOCK)), block_done=True), now=0.4)
    assert s.is_idle("a") and d.launches == ()  # b is busy: running waits for b's next batch
    assert s.requests["running"].instance == "b"
    launch = only_launch(done(s, "b", result(waiting, [0]), now=0.5))
    item = {i.request_id: i for i in launch.batch.items}["running"]
    assert item.kind is StepKind.RECOMPUTE and item.spec is not None


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


def test_dws_sjf_serves_the_cheapest_waiting_request_first_and_never_preempts():
    s = scheduler("dws-sjf", instances=(("a", 1),), max_batch_requests=1)
    running = make_request("first", cost=50.0)
    assert only_launch(s.on_arrival(running, 0.0)).batch.items[0].request_id == "first"
    for rid, cost in (("dear", 30.0), ("cheap", 10.0), ("mid", 20.0)):
        assert not s.on_arrival(make_request(rid, cost=cost), 0.0).launches
    # "first" has started: its next step goes ahead of every cheaper waiting request
    launch = only_launch(done(s, "a", result(running, [0]), now=0.1))
    assert launch.batch.items[0].request_id == "first"
    served = []
    for step in range(4):
        finished = result(running, [1], block_done=True, finished=True)
        launches = done(s, "a", finished, now=0.2 + step).launches
        if not launches:
            break
        [launch] = launches
        rid = launch.batch.items[0].request_id
        served.append(rid)
        running = s.requests[rid].request
    assert served == ["cheap", "mid", "dear"]


def test_dws_sjf_ages_a_long_wait_ahead_of_a_cheaper_newcomer():
    s = scheduler("dws-sjf", instances=(("a", 1),), max_batch_requests=1)
    s.on_arrival(make_request("busy", cost=1.0), 0.0)
    s.on_arrival(make_request("old", cost=100.0), 0.0)
    s.on_arrival(make_request("new", cost=80.0, arrival_time=90.0), 90.0)
    s.on_arrival(make_request("newer", cost=80.0, arrival_time=80.0), 80.0)
    # at 91 s "old" has waited 3 periods (100 x 0.9^3 = 72.9): ahead of "new" (80, no wait);
    # "newer" has waited none either, but "old" waited only 2 periods more ... (81 > 80)
    key = s._placer.service_key(91.0)
    assert sorted(["new", "old"], key=key) == ["old", "new"]
    assert sorted(["newer", "old"], key=s._placer.service_key(81.0)) == ["newer", "old"]


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


def test_an_instance_batch_counts_its_tokens_and_hands_them_over_at_launch():
    inst = InstanceState("i", 1, 100, Curve((10, 100), (0.1, 1.0)), Curve((10,), (0.05,)))
    assert inst.has_room(500, 8)  # an empty batch takes anything
    inst.gather("a", StepKind.RECOMPUTE, 60)
    inst.gather("b", StepKind.CACHE, 10)
    assert (inst.pending_full, inst.pending_cache) == (60, 10)
    assert inst.has_room(30, 8) and not inst.has_room(31, 8) and not inst.has_room(1, 2)
    inst.ungather("a")
    inst.ungather("gone")  # not there: nothing happens
    assert inst.pending == ["b"] and (inst.pending_full, inst.pending_cache) == (0, 10)
    inst.gather("c", StepKind.RECOMPUTE, 55)
    inst.launch(now=2.0)
    assert inst.busy and inst.busy_until == pytest.approx(2.0 + 0.55 + 0.05)
    assert inst.holds == {"b", "c"} and inst.pending == [] and inst.pending_full == 0


def test_a_planned_batch_bounds_full_sequence_and_cache_step_tokens_apart():
    # Alg. 3's maxBatchSize from the plan: (full-sequence, cache-step) tokens, each family alone
    inst = InstanceState("i", 1, 1000, Curve((10, 100), (0.1, 1.0)), Curve((10,), (0.05,)))
    inst.planned_batch = (100, 64)
    assert inst.has_room(500, 8)  # an empty batch still takes anything
    inst.gather("a", StepKind.RECOMPUTE, 60)
    inst.gather("b", StepKind.CACHE, 32)
    assert inst.has_room(40, 8) and not inst.has_room(41, 8)  # full: 60 of 100
    assert inst.has_room(32, 8, cached=True) and not inst.has_room(33, 8, cached=True)
    inst.planned_batch = None  # the instance's own limit over the mixed batch
    assert inst.has_room(908, 8) and not inst.has_room(909, 8)


def test_a_planned_cache_batch_sets_alg4s_sequences_per_batch():
    # Alg. 4's capacity runs cache steps of maxNumSeqPerBatch sequences: with the plan's batch
    # limits, as many as the planned cache-step batch holds blocks (4), not 64
    s = scheduler(instances=(("a", 1),))
    before = s.load_control.throughput(s.instances.values(), mean_tokens=200.0)
    s.set_batch_limits({1: (1000, 4 * BLOCK)})
    after = s.load_control.throughput(s.instances.values(), mean_tokens=200.0)
    expected = instance_capacity(PROFILE, 1, 1.0, s.config.costs, 200.0, 4)
    assert after == pytest.approx(expected) and after < before
