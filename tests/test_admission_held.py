"""Admission and the requests a fault holds (`BatchedTime.in_flight`): a newcomer is refused if
it would make late a request in flight that would be on time without it (`batched_time.late`),
but not for a request in the step of a stopped worker. No refusal brings that step's end
nearer; protected, such a request reached the edge of its deadline still priced as on time,
and every newcomer was refused while it crossed it (SIGSTOP in the reliability suite: the
429s 1 s after the stop, docs/serving/reliability.md). Nor for a request in its last step,
which a newcomer cannot join; and the lost requests that wait for an instance of their own
(those the stopped worker held, once it is replaced) are not priced as sharing the batches.

On the virtual clock of `test_admission_recovery`; asserted at points of that clock."""

import numpy as np
import pytest
from test_admission_recovery import outcome, run_to, run_until, submit, virtual_cluster

from dilaserve.control.batched_time import InFlight, scale_at
from dilaserve.control.instance import STALL_SECONDS
from dilaserve.control.room import MIN_RECENT

SLO = 2.0
MS = 1e-3


def warm(cluster) -> None:
    """Requests served two at a time (the second priced, not a probe), until the front
    prices by the batched model (`Room.scales`)."""
    for k in range(MIN_RECENT + 1):
        pair = [submit(cluster, f"w{k}.{j}", slo=SLO) for j in range(2)]
        assert [outcome(cluster, h) for h in pair] == ["admitted"] * 2
        run_until(cluster, lambda pair=pair: all(h.future.done() for h in pair))
    assert cluster.controller.admission.prices.least_alone is not None


def batch_of(clock, least: int) -> str | None:
    """An instance running a step of at least `least` requests."""
    return next((i for i, (_, b) in clock._running.items() if len(b.items) >= least), None)


def stop_a_loaded_worker(cluster, clock, requests: int = 12):
    """`requests` arrive at once; once an instance runs a step of several of them, its worker
    stops (SIGSTOP: that step never ends). Returns (its id, the ids its step holds)."""
    handles = [submit(cluster, f"r{k}", slo=SLO) for k in range(requests)]
    assert [outcome(cluster, h) for h in handles] == ["admitted"] * requests
    run_until(cluster, lambda: batch_of(clock, requests // 3) is not None)
    iid = batch_of(clock, requests // 3)
    _, batch = clock._running[iid]
    clock._running[iid] = (float("inf"), batch)
    return iid, [item.request_id for item in batch.items]


def room_refusals(cluster, start: float, end: float) -> list[float]:
    """The points of the clock, every millisecond from `start` to `end`, at which the room the
    controller would publish then refuses a one-block request at the server's SLO."""
    admission = cluster.controller.admission
    points = np.arange(start, end, MS)
    return [t for t in points if admission.room(float(t)).refuses(0, None, 32)]


def test_a_request_held_by_a_stopped_worker_does_not_close_admission():
    cluster, clock = virtual_cluster(instances=(1, 1), slo=SLO)
    warm(cluster)
    iid, held = stop_a_loaded_worker(cluster, clock)
    stopped = clock.t
    others = lambda: set(cluster.scheduler.requests) == set(held)  # noqa: E731
    run_until(cluster, lambda: clock.t >= stopped + STALL_SECONDS and others())
    deadlines = [cluster.scheduler.requests[rid].request.deadline for rid in held]
    assert cluster.controller.admission.room(clock.t).scales  # priced as batched
    # a newcomer would go to the other instance, idle, and finish long before the SLO: the
    # held requests' deadlines pass while the room is asked every millisecond
    assert room_refusals(cluster, clock.t, max(deadlines) + 0.1) == []
    newcomer = submit(cluster, "new", slo=SLO)
    assert outcome(cluster, newcomer) == "admitted"


def test_the_held_requests_are_protected_until_their_step_is_overdue():
    """Before its step is overdue (`InstanceState.overdue`, the test that stalls the
    instance) a stopped worker looks like a slow one, and its requests keep their protection;
    after, they have none (a newcomer cannot make them later)."""
    cluster, clock = virtual_cluster(instances=(1, 1), slo=SLO)
    warm(cluster)
    _, held = stop_a_loaded_worker(cluster, clock)
    admission = cluster.controller.admission
    assert np.all(np.isfinite(admission._in_flight(clock.t, 1.0).left))
    stopped = clock.t
    run_until(cluster, lambda: clock.t >= stopped + STALL_SECONDS)
    assert np.count_nonzero(admission._in_flight(clock.t, 1.0).left == -np.inf) == len(held)


def test_lost_requests_waiting_for_an_instance_do_not_close_admission():
    """The stopped worker is killed once its requests are past their deadlines, and its
    replacement is not up yet: those requests are lost and wait for an instance that holds
    no request still on time (`lost_work.py`), so a newcomer shares the one instance left
    with the few on time only. Priced as sharing it with the 45 waiting too, it was refused
    (in the suite, 14-30 requests 429 after a SIGSTOP)."""
    cluster, clock = virtual_cluster(instances=(1, 1), slo=SLO)
    warm(cluster)
    clock.start = lambda spec: None  # the replacement never comes up
    iid, held = stop_a_loaded_worker(cluster, clock, requests=90)
    deadlines = [cluster.scheduler.requests[rid].request.deadline for rid in held]
    run_to(cluster, clock, max(deadlines) + MS)  # (the virtual clock's seconds)
    on_time = [submit(cluster, f"o{k}", slo=SLO) for k in range(4)]
    assert [outcome(cluster, h) for h in on_time] == ["admitted"] * 4
    clock.kill(iid)
    run_until(cluster, lambda: cluster.controller.stats["failures"] == 1)
    waiting = [t for t in cluster.scheduler.requests.values() if t.lost and t.instance is None]
    assert len(waiting) >= 40 and list(cluster.scheduler.instances) != [iid]
    assert not cluster.controller.admission.room(clock.t).refuses(0, None, 32)
    assert outcome(cluster, submit(cluster, "new", slo=SLO)) == "admitted"


def test_a_request_in_its_last_step_is_not_made_later_by_a_newcomer():
    """A newcomer joins the steps after the running one: a request whose last step runs,
    at the edge of its deadline, does not close admission; one with a step still to come
    does."""
    cluster, _ = virtual_cluster(instances=(1,), slo=SLO)
    batched = cluster.controller.admission._batched
    tokens = 64.0
    inner, _ = batched.step_seconds(1, tokens)

    def edge(steps: float, running: float) -> InFlight:
        one = np.array([steps])
        return InFlight(one, np.zeros(1), tokens, one * inner, np.array([running]))

    assert batched.late(edge(1.0, running=1.0), 1, tokens) == 0
    assert batched.late(edge(2.0, running=1.0), 1, tokens) == 1
    assert batched.late(edge(1.0, running=0.0), 1, tokens) == 1


def test_the_room_prices_the_measured_slowdown_once():
    """As admission in full does (`BatchedTime.seconds`): steps measured 3x slower than the
    profile make a newcomer's price 3x, not 9x (the room refused what admission would take)."""
    cluster, clock = virtual_cluster(instances=(1, 1), slo=SLO)
    warm(cluster)
    handles = [submit(cluster, f"r{k}", slo=SLO) for k in range(8)]
    assert [outcome(cluster, h) for h in handles] == ["admitted"] * 8
    admission, speed = cluster.controller.admission, cluster.scheduler.speed
    speed.ratio = 1.0
    profile = admission.room(clock.t)
    speed.ratio = 3.0
    slower = admission.room(clock.t)
    assert speed.slowdown == 3.0
    assert scale_at(slower.scales, 0) == pytest.approx(3 * scale_at(profile.scales, 0))
