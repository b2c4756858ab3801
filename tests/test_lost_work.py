"""Lost work (`control/lost_work.py`): a request that can no longer meet its deadline is served
after the requests that still can, on an instance that holds only lost ones."""

import pytest
from scheduler_helpers import BLOCK, PROFILE, FakePredictor, done, only_launch, result

from dilaserve.control.lost_work import Lost
from dilaserve.control.on_time import OnTimeCalibration
from dilaserve.control.policy import get_policy
from dilaserve.control.scheduler import Scheduler, SchedulerConfig

from conftest import make_request


def scheduler(rule: Lost, instances=("a",), name="dilaserve") -> Scheduler:
    policy = get_policy(name, candidates=(0.5, 0.9), lost_work=rule)
    s = Scheduler(policy, PROFILE, FakePredictor(), SchedulerConfig(block_len=BLOCK, slo=100.0))
    for name in instances:
        s.add_instance(name, 1, 10_000)
    return s


def arrive_on_time_then_late(s: Scheduler):
    on_time = make_request("on-time", gen_len=2 * BLOCK, arrival_time=0.0)
    assert only_launch(s.on_arrival(on_time, 0.0)).instance_id == "a"
    late = make_request("late", gen_len=2 * BLOCK, arrival_time=0.0)
    late.deadline = 0.5  # passed when it arrives at 1.0
    return on_time, late, s.on_arrival(late, 1.0)


def test_without_the_rule_a_lost_request_joins_the_batch_of_one_on_time():
    s = scheduler(Lost.NEVER)
    _, _, decisions = arrive_on_time_then_late(s)
    assert decisions.launches == ()  # a is busy; "late" waits in its next batch
    assert s.instances["a"].pending == ["late"]


def test_a_lost_request_waits_until_no_request_on_time_is_there():
    s = scheduler(Lost.LATE)
    on_time, late, decisions = arrive_on_time_then_late(s)
    assert decisions.launches == () and s.instances["a"].pending == []
    assert s.requests["late"].lost and s.requests["late"].instance is None
    # on-time's block ends and it goes on: "late" still waits
    d = done(s, "a", result(on_time, list(range(BLOCK)), block_done=True), now=2.0)
    assert [i.request_id for i in only_launch(d).batch.items] == ["on-time"]
    # on-time finishes: a holds no request on time, and "late" runs there
    d = done(s, "a", result(on_time, list(range(BLOCK, 2 * BLOCK)), finished=True), now=3.0)
    assert d.finished == ("on-time",)
    [item] = only_launch(d).batch.items
    assert item.request_id == "late" and item.spec is not None
    assert s.instances["a"].lost_residents == 1 and s.instances["a"].residents == 1


def test_a_lost_request_goes_to_an_instance_that_serves_no_request_on_time():
    s = scheduler(Lost.LATE, instances=("a", "b"))
    _, _, decisions = arrive_on_time_then_late(s)
    assert only_launch(decisions).instance_id == "b"
    assert s.instances["b"].lost_residents == 1 and s.instances["a"].lost_residents == 0


@pytest.mark.parametrize("rule", [Lost.POINT, Lost.LIKELY])
def test_a_request_whose_estimate_misses_at_the_lowest_threshold_is_lost(rule):
    s = scheduler(rule)
    on_time, _, _ = arrive_on_time_then_late(s)
    tight = make_request("tight", gen_len=2 * BLOCK, arrival_time=1.0)
    tight.deadline = 1.001  # 4 steps at 0.5 need more than 1 ms on any batch
    roomy = make_request("roomy", gen_len=2 * BLOCK, arrival_time=1.0)
    s.on_arrival(tight, 1.0)
    s.on_arrival(roomy, 1.0)
    assert s.requests["tight"].lost and not s.requests["roomy"].lost
    assert s.instances["a"].pending == ["roomy"]


def test_a_lost_request_teaches_the_calibration_once_at_the_time_it_was_found_lost():
    s = scheduler(Lost.LATE)
    on_time = make_request("on-time", gen_len=2 * BLOCK, arrival_time=0.0)
    s.on_arrival(on_time, 0.0)
    assert "on-time" in s.deadline
    on_time.deadline = 0.5  # squeezed after its threshold was chosen
    done(s, "a", result(on_time, list(range(BLOCK)), block_done=True), now=2.0)
    assert s.requests["on-time"].lost and "on-time" not in s.deadline
    assert s.deadline.finished == 1  # measured when it was found lost
    done(s, "a", result(on_time, list(range(BLOCK, 2 * BLOCK)), finished=True), now=3.0)
    assert s.deadline.finished == 1  # its late finish, by choice, teaches nothing


def test_the_low_factor_is_the_calibrations_low_quantile_and_decays_to_one():
    calibration = OnTimeCalibration(0.95, half_life=10.0, min_evidence=4)
    for k, taken in enumerate((0.5, 0.6, 1.0, 1.0, 1.2)):
        calibration.admitted(f"r{k}", 1.0, 0.0)
        calibration.finished_at(f"r{k}", taken)
    assert calibration.low_factor(1.2) == pytest.approx(0.52)  # 5% of the way from 0.5 to 0.6
    assert calibration.low_factor(11.2) == pytest.approx(0.76)  # halved toward 1 in 10 s idle
    assert calibration.factor(1.2) == pytest.approx(1.16)


def test_likely_lost_takes_the_estimate_at_the_low_quantile():
    s = scheduler(Lost.LIKELY)
    cal = s.deadline
    for k in range(16):  # requests ran in a tenth of their estimate
        cal.admitted(f"old{k}", 10.0, 0.0)
        cal.finished_at(f"old{k}", 1.0)
    tight = make_request("tight", gen_len=2 * BLOCK, arrival_time=1.0)
    tight.deadline = 1.02  # 4 steps at 0.5 on the empty instance: 30 ms; 3 at a tenth
    s.on_arrival(tight, 1.0)
    assert not s.requests["tight"].lost
    s = scheduler(Lost.POINT)
    s.on_arrival(make_request("tight", gen_len=2 * BLOCK, arrival_time=1.0, deadline=1.02), 1.0)
    assert s.requests["tight"].lost


def test_a_lost_request_bound_to_an_instance_that_goes_away_runs_elsewhere():
    # no-migration binds a request to its first instance; found lost there beside a request on
    # time it waits, its state released. Its instance then drains: it must not wait for it
    s = scheduler(Lost.LATE, name="no-migration")
    soon = make_request("soon", gen_len=2 * BLOCK, arrival_time=0.0)
    soon.deadline = 2.0
    later = make_request("later", gen_len=2 * BLOCK, arrival_time=0.0)
    s.on_arrival(soon, 0.0)
    s.on_arrival(later, 0.0)
    done(s, "a", result(soon, [0]), now=1.0)  # both in a's next batch
    outputs = [result(r, list(range(1, BLOCK)), block_done=r is soon) for r in (soon, later)]
    done(s, "a", *outputs, now=3.0)  # soon's block ends, late: found lost beside later
    assert s.requests["soon"].lost and s.requests["soon"].instance is None
    assert s.requests["soon"].bound == "a"
    s.add_instance("b", 1, 10_000)
    launch = only_launch(s.drain_instance("a", 3.5))
    assert launch.instance_id == "b" and launch.batch.items[0].request_id == "soon"
    assert s.requests["soon"].instance == "b"


def test_a_lost_request_leaves_load_controls_budget_window():
    # the default's window is the mean budget left to the requests Alg. 2/4 counts: on-time's
    # 99 s at 1.0, not the mean with the lost request's deadline, long passed (49.25 s)
    s = scheduler(Lost.LATE)
    arrive_on_time_then_late(s)
    assert s.requests["late"].lost
    assert s.load_control.window_seconds(1.0) == pytest.approx(99.0)


def test_a_far_deadline_that_leaves_leaves_the_budget_window_as_it_was():
    # a running sum of the deadlines lost "near"'s once the far one (an SLO of 1e300 ms, as a
    # client may send) came and went: the window read 0 s and Alg. 2/4 held every request
    # at the lowest threshold from then on (the reliability suite's fuzz did it to the server)
    s = scheduler(Lost.NEVER)
    s.on_arrival(make_request("near", gen_len=2 * BLOCK, arrival_time=0.0, deadline=100.0), 0.0)
    far = make_request("far", gen_len=2 * BLOCK, arrival_time=0.0, deadline=1e297)
    s.on_arrival(far, 0.0)
    assert s.load_control.window_seconds(1.0) > 1e296
    s.cancel("far")
    assert s.load_control.window_seconds(1.0) == pytest.approx(99.0)


def test_lost_requests_waiting_keep_their_turn_and_count_as_waiting():
    s = scheduler(Lost.LATE)
    on_time = make_request("on-time", gen_len=BLOCK, arrival_time=0.0)
    only_launch(s.on_arrival(on_time, 0.0))
    for k, name in enumerate(["late-1", "late-2", "late-3", "late-4"]):
        late = make_request(name, gen_len=BLOCK, arrival_time=0.0)
        late.deadline = 0.5  # on the scheduler's event clock: passed at its arrival (1.0 + k)
        assert s.on_arrival(late, 1.0 + k).launches == ()
    assert all(s.requests[f"late-{k}"].lost for k in range(1, 5))
    assert s.num_waiting == 4  # parked, each counted
    s.cancel("late-2")
    assert s.num_waiting == 3
    # on-time finishes: a holds no request on time, and the lost run there in arrival order
    d = done(s, "a", result(on_time, list(range(BLOCK)), finished=True), now=9.0)
    assert [i.request_id for i in only_launch(d).batch.items] == ["late-1", "late-3", "late-4"]
    assert s.num_waiting == 0
