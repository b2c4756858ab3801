"""Stalled instances (`InstanceState.overdue`, `Scheduler._stall_overdue`): a step far past its
predicted time stops its instance taking new work, and its gathered batch goes elsewhere,
long before the step timeout would kill it (a worker stopped, or starved of CPU)."""

import pytest
from fastapi.testclient import TestClient
from test_admission_recovery import MODEL, outcome, run_until, submit, virtual_cluster
from test_scheduler import done, only_launch, result, scheduler

from dilaserve.cluster.backends import WorkerEvent
from dilaserve.control.instance import STALL_FACTOR, STALL_SECONDS, InstanceState
from dilaserve.server.app import ServerSettings, create_app
from dilaserve.server.metrics import ServerMetrics
from dilaserve.sim.replay import ParityError, replay

from conftest import make_request


def running(predicted: float) -> InstanceState:
    inst = InstanceState("i", 1, 1000, full_curve=None)
    inst.busy, inst.launched_at, inst.busy_until = True, 10.0, 10.0 + predicted
    return inst


def test_a_step_is_overdue_past_ten_times_its_prediction_and_a_second():
    short, long = running(0.01), running(0.5)
    assert not short.overdue(10.0 + STALL_SECONDS * 0.9)  # the floor: not before a second
    assert short.overdue(10.0 + STALL_SECONDS * 1.1)
    assert not long.overdue(10.0 + STALL_FACTOR * 0.5 * 0.9)
    assert long.overdue(10.0 + STALL_FACTOR * 0.5 * 1.1)
    assert not long.overdue(10.0 + STALL_FACTOR * 0.5 * 1.1, slowdown=2.0)  # a slow machine
    idle = running(0.01)
    idle.busy = False
    assert not idle.overdue(1e6)


def test_a_stalled_instances_gathered_batch_goes_elsewhere_until_its_step_ends():
    s = scheduler()  # a: TP-1, b: TP-2
    first = make_request("first", gen_len=16)
    assert only_launch(s.on_arrival(first, 0.0)).instance_id == "b"
    assert s.on_arrival(make_request("x", gen_len=16), 0.0).launches == ()
    assert s.instances["b"].pending == ["x"]  # waits for b's step, the cheaper batch
    assert s.on_tick(0.5).launches == ()  # (not yet overdue)
    moved = only_launch(s.on_tick(5.0))
    assert moved.instance_id == "a" and [i.request_id for i in moved.batch.items] == ["x"]
    assert s.instances["b"].stalled and s.num_stalled == 1
    s.on_arrival(make_request("y", gen_len=16, arrival_time=5.0), 5.0)
    assert s.instances["a"].pending == ["y"] and not s.instances["b"].pending  # none joins b
    done(s, "b", result(first, [0]), now=6.0)
    assert not s.instances["b"].stalled and s.num_stalled == 0


def test_requests_behind_a_stopped_worker_finish_before_it_is_killed():
    cluster, clock = virtual_cluster(instances=(1, 1), slo=60.0)
    stopped = submit(cluster, "first", slo=600.0)
    assert outcome(cluster, stopped) == "admitted"
    run_until(cluster, lambda: clock._running)
    [(iid, (_, batch))] = clock._running.items()
    clock._running[iid] = (float("inf"), batch)  # its worker stops (SIGSTOP): no step ends
    handles = [submit(cluster, f"r{k}", slo=600.0) for k in range(6)]
    assert [outcome(cluster, h) for h in handles] == ["admitted"] * 6
    moved = list(cluster.scheduler.instances[iid].pending)  # gathered behind the stopped step
    assert moved
    run_until(cluster, lambda: cluster.scheduler.instances[iid].stalled)
    on_time = cluster.controller.admission.on_time  # a stall is a fault: they teach it nothing
    assert not any(rid in on_time for rid in [*moved, "first"])
    run_until(cluster, lambda: all(h.future.done() for h in handles))
    assert iid in cluster.scheduler.instances  # not killed: the others went around it
    assert all(h.future.exception() is None for h in handles)
    assert cluster.scheduler.num_stalled == 1
    app = create_app(cluster, ServerSettings(MODEL), ServerMetrics(), manage=False)
    with TestClient(app) as client:
        assert "dilaserve_instances_stalled 1.0" in client.get("/metrics").text


def both_instances_stepping():
    """A virtual two-instance cluster with 8 requests admitted and both instances running a
    step: (cluster, clock, the handles, the ids in flight, each priced to be learnt from)."""
    cluster, clock = virtual_cluster(instances=(1, 1), slo=60.0)
    handles = [submit(cluster, f"r{k}", slo=600.0) for k in range(8)]
    assert [outcome(cluster, h) for h in handles] == ["admitted"] * 8
    run_until(cluster, lambda: len(clock._running) == 2)
    in_flight = [h.request_id for h in handles if not h.future.done()]
    assert in_flight and all(rid in cluster.controller.admission.on_time for rid in in_flight)
    return cluster, clock, handles, in_flight


def test_requests_in_flight_when_an_instance_dies_teach_admission_nothing():
    # priced for the capacity the fault took away, and then served behind the dead instance's
    # requests: their lateness is the fault's (after SIGSTOP, admission refused for it)
    cluster, clock, handles, in_flight = both_instances_stepping()
    on_time = cluster.controller.admission.on_time
    clock.kill("i0")
    run_until(cluster, lambda: cluster.controller.stats["failures"] == 1)
    assert not any(rid in on_time for rid in in_flight)
    late = submit(cluster, "after", slo=600.0)  # admitted after the fault: priced as usual
    assert outcome(cluster, late) == "admitted" and "after" in on_time
    run_until(cluster, lambda: all(h.future.done() for h in [*handles, late]))
    assert all(h.future.exception() is None for h in [*handles, late])


def test_while_lost_capacity_is_restored_finished_requests_teach_admission_nothing():
    # beside a replacement loading, the instance left ran far slower than priced
    cluster, clock = virtual_cluster(instances=(1, 1), slo=60.0)
    loading = []
    clock.start = loading.append  # a replacement loads until the test says it is up
    clock.kill("i0")
    run_until(cluster, lambda: loading)
    assert not cluster.controller.is_whole
    admission = cluster.controller.admission
    admission._ran_as_priced = lambda request: True  # (each would teach, whatever it ran at)
    on_time = admission.on_time
    during = submit(cluster, "during", slo=600.0)
    assert outcome(cluster, during) == "admitted"
    run_until(cluster, during.future.done)
    assert on_time.finished == 0  # finished while the cluster was not whole: not learnt
    straddles = submit(cluster, "straddles", slo=600.0)
    assert outcome(cluster, straddles) == "admitted" and "straddles" in on_time
    clock._events.append(WorkerEvent("up", loading[0].instance_id))
    run_until(cluster, lambda: cluster.controller.is_whole)
    assert "straddles" not in on_time  # priced before the cluster was whole again
    after = submit(cluster, "after", slo=600.0)
    assert outcome(cluster, after) == "admitted"
    run_until(cluster, lambda: straddles.future.done() and after.future.done())
    assert on_time.finished == 1  # "after" alone


def stall_next_tick(cluster, clock, seconds: float) -> None:
    """The controller's next event is a tick that takes `seconds` of the clock (a planner
    round on a busy machine), and it comes now."""
    tick = cluster.scheduler.on_tick

    def slow_round(now):
        clock.t += seconds
        cluster.scheduler.on_tick = tick
        return tick(now)

    cluster.scheduler.on_tick = slow_round
    cluster.controller._next_tick = clock.t


def test_a_stall_of_the_controller_teaches_neither_speed_nor_admission():
    # a planner round's solves held the controller up 1.3 s on a busy machine: the steps and
    # requests then in flight read as 10x and 12x slow, and admission refused
    # (docs/serving/reliability.md)
    cluster, clock, handles, in_flight = both_instances_stepping()
    on_time = cluster.controller.admission.on_time
    steps = cluster.controller.steps_run
    stall_next_tick(cluster, clock, seconds=1.5)
    run_until(cluster, lambda: cluster.controller.steps_run >= steps + 2)
    assert cluster.controller.stalls.count == 1
    assert cluster.step_slowdown < 1.5  # the two steps it held up were not measured
    assert not any(rid in on_time for rid in in_flight)
    after = submit(cluster, "after", slo=600.0)  # admitted after it: priced as usual
    assert outcome(cluster, after) == "admitted" and "after" in on_time
    run_until(cluster, lambda: all(h.future.done() for h in [*handles, after]))
    assert all(h.future.exception() is None for h in [*handles, after])
    assert cluster.controller.stalls.count == 1  # no event since took over a tick


def test_a_run_with_a_stall_replays_to_the_same_decisions():
    # the steps a stall held up are recorded unmeasured; a replay that measured them would
    # price the requests after it 11x slower (the test above) and decide otherwise
    cluster, clock = virtual_cluster(instances=(1, 1), slo=60.0, record=True)
    handles = [submit(cluster, f"r{k}", slo=600.0) for k in range(8)]
    assert [outcome(cluster, h) for h in handles] == ["admitted"] * 8
    run_until(cluster, lambda: len(clock._running) == 2)
    stall_next_tick(cluster, clock, seconds=1.5)
    run_until(cluster, lambda: all(h.future.done() for h in handles))
    after = [submit(cluster, f"a{k}", slo=0.3) for k in range(10)]  # tight: speed matters
    assert [outcome(cluster, h) for h in after] == ["admitted"] * 10
    run_until(cluster, lambda: all(h.future.done() for h in after))
    recording, config = cluster.controller.recording, cluster.config
    assert len(recording.unmeasured) == 2
    args = (config.control, config.initial_specs(), config.tick, config.max_batch_tokens)
    voided, unmeasured = recording.voided, recording.unmeasured
    _, lines = replay(recording.requests, recording.launches, *args, True, unmeasured, voided)
    assert lines == cluster.controller.log.lines
    try:  # measuring them, it decides otherwise: other lines, or launches the run did not
        _, measured = replay(recording.requests, recording.launches, *args, True)
    except ParityError:
        return
    assert measured != cluster.controller.log.lines


def test_a_stall_of_the_controller_teaches_alg_1_nothing_either():
    # Alg. 1's own on-time factor (threshold selection) learnt from the requests a stall
    # delayed, so those after it ran at the lowest threshold and taught admission's in turn
    cluster, clock = virtual_cluster(instances=(1, 1), slo=60.0)
    handles = [submit(cluster, f"r{k}", slo=600.0) for k in range(32)]
    assert [outcome(cluster, h) for h in handles] == ["admitted"] * 32
    run_until(cluster, lambda: len(clock._running) == 2)
    alg_1 = cluster.scheduler.deadline
    in_flight = [h.request_id for h in handles if not h.future.done()]
    assert len(in_flight) > 16 and all(rid in alg_1 for rid in in_flight)
    learnt, factor = alg_1.finished, alg_1.factor(clock.t)
    stall_next_tick(cluster, clock, seconds=1.5)
    run_until(cluster, lambda: all(h.future.done() for h in handles))
    assert cluster.controller.stalls.count == 1
    assert alg_1.finished == learnt  # none of those the stall delayed was measured
    assert alg_1.factor(clock.t) == factor
    assert not alg_1._void  # (each void request forgotten once it ended)


def test_metrics_show_each_instances_measured_speed_and_placement_avoids_the_slow_one():
    cluster, clock = virtual_cluster(instances=(1, 1), slo=60.0)
    slow, fast = sorted(cluster.scheduler.instances)
    clock.slow[slow] = 3.0  # a throttled GPU the profile does not know
    for k in range(8):  # one at a time: each goes where its step is priced lowest
        handle = submit(cluster, f"r{k}", slo=600.0)
        run_until(cluster, handle.future.done)
    ratio = cluster.scheduler.speed.instance_ratio
    assert ratio(slow) > 1.5 and ratio(fast) == pytest.approx(1.0)  # (running: the first blend)
    app = create_app(cluster, ServerSettings(MODEL), ServerMetrics(), manage=False)
    with TestClient(app) as client:
        text = client.get("/metrics").text
    shown = f'dilaserve_instance_step_slowdown{{instance="{slow}"}} {ratio(slow)}'
    assert shown in text
    handle = submit(cluster, "next", slo=600.0)  # DiLaServe prices each instance at its speed
    run_until(cluster, lambda: cluster.scheduler.requests.get("next") is not None)
    assert cluster.scheduler.requests["next"].instance == fast
