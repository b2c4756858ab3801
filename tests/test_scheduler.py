"""Scheduler tests, placement and lifecycle: hand-made StepOutputs in, decisions out (where a
request runs, when it migrates, what a failure, a cancel or a drain does, how a batch fills).
Thresholds and load control are in tests/test_scheduler_thresholds.py."""

import pytest
from scheduler_helpers import BLOCK, PROFILE, FakePredictor, done, only_launch, result, scheduler

from dilaserve.control.instance import InstanceState
from dilaserve.control.profile import Curve
from dilaserve.control.thresholds import instance_capacity
from dilaserve.protocol import StepKind, StepOutput

from conftest import make_request


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


def test_a_request_whose_cache_the_engine_dropped_recomputes_and_may_move():
    s = scheduler(instances=(("a", 1), ("b", 1)))
    req = make_request("r", gen_len=2 * BLOCK)
    assert only_launch(s.on_arrival(req, 0.0)).instance_id == "a"
    # mid-block, its next step would be a cache step at home; the engine dropped the cache
    output = StepOutput((result(req, [0]),), 0, kv_dropped=("r",))
    launch = only_launch(s.on_step_done("a", output, now=1.0))
    [item] = launch.batch.items
    assert item.kind is StepKind.RECOMPUTE and item.spec is not None
    assert "r" in s.instances[launch.instance_id].holds  # its new cache, once stored


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
    "r3_blocks, now, price, moves",
    [(3, 4.0, 0.0, True), (3, 4.0, 1.0, False), (3, 2.0, 0.0, False), (8, 2.0, 0.0, True)],
)
def test_a_request_moves_only_when_its_block_ends_first_there_by_more_than_the_price(
    r3_blocks, now, price, moves
):
    # the case above: r1's steps end sooner with r2 on b than with r3 on a, but b starts the
    # first only when its running step (r2's, launched at 2.0) ends. At 4.0 that step is long
    # over and the move pays, unless a move costs a second. At 2.0 the wait is paid once and
    # the saving at every step of r1's block: beside a short r3 that saving is too small; beside
    # the long one it pays, though one step's saving alone would not
    s = scheduler(instances=(("a", 1), ("b", 1)), migration_price=price)
    r1, r2 = (make_request(f"r{i}", gen_len=2 * BLOCK, arrival_time=i) for i in (1, 2))
    r3 = make_request("r3", gen_len=r3_blocks * BLOCK, arrival_time=2)
    s.on_arrival(r1, 1.0)
    s.on_arrival(r2, 2.0)
    s.on_arrival(r3, 2.0)
    a, b = s.instances["a"], s.instances["b"]
    wait = b.busy_until - 2.0
    saving = a.full_curve.at(r1.num_tokens + r3.num_tokens) - b.full_curve.at(
        r1.num_tokens + r2.num_tokens
    )
    d = done(s, "a", result(r1, list(range(BLOCK)), block_done=True), now=now)
    steps = s.load_control.steps_per_block(r1)
    assert 0 < saving < wait and steps > 1
    assert (saving * steps > wait) is (r3_blocks == 8)
    assert (d.releases == (("a", "r1"),)) is moves
    assert s.requests["r1"].instance == ("b" if moves else "a")


@pytest.mark.parametrize("waiting_there, moves", [(0, True), (10, False)])
def test_a_move_pays_only_net_of_the_steps_it_lengthens_where_it_goes(waiting_there, moves):
    # r's recompute ends sooner on the idle TP-2 b (0.6x) than alone at home on a; but joining
    # b's batch of ten cache steps lengthens each of theirs by most of its own step
    from types import SimpleNamespace

    from dilaserve.control.placement import Placer

    s = scheduler(instances=(("a", 1), ("b", 2)))
    a, b = s.instances["a"], s.instances["b"]
    for i in range(waiting_there):
        b.gather(f"x{i}", StepKind.CACHE, BLOCK)
    placer = Placer(s.policy, s.config, s.instances, s.requests)
    t = SimpleNamespace(request=make_request("r", prompt_len=400, gen_len=2 * BLOCK))
    kind = StepKind.RECOMPUTE
    own_saving = a.latency(t.request.num_tokens, 0) - b.latency(
        t.request.num_tokens, BLOCK * waiting_there
    )
    assert own_saving > 0  # the mover alone would always go
    assert placer._move_pays(t, b, kind, a, kind, now=0.0) is moves


def test_no_migration_keeps_a_request_on_its_first_instance():
    s = scheduler("no-migration", instances=(("a", 1), ("b", 1)))
    req = make_request("r", gen_len=2 * BLOCK)
    home = only_launch(s.on_arrival(req, 0.0)).instance_id
    other = make_request("x", gen_len=2 * BLOCK)
    s.on_arrival(other, 0.0)
    launch = only_launch(done(s, home, result(req, list(range(BLOCK)), block_done=True)))
    assert launch.instance_id == home


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
