"""The front's room (`admission.Room`, `Cluster.is_full`) against admission in full, on the
virtual clock of `test_admission_recovery`: counts of who refused what, never times.

A refusal made by admission in full costs the client its tokenizing and its queue wait for the
controller (the tail of the refusals' latency at 3x capacity,
docs/serving/reliability.md); one the room makes is answered at once. Requests that come in a
burst between two controller events all found the room left for one before the room counted the
requests queued ahead of them."""

from collections import Counter
from dataclasses import replace

import pytest
from test_admission_recovery import QUESTION, run_to, run_until, virtual_cluster
from test_stalls import stall_next_tick

from dilaserve.cluster.gate import PACE_EVIDENCE, ROOM_MAX_AGE, Pace
from dilaserve.cluster.requests import Overloaded
from dilaserve.control.admission import Room
from dilaserve.control.batched_time import AHEAD, UNLIMITED

SLO = 0.5


def would_admit(cluster, rid: str) -> bool:
    """Would admission, asked now, admit a request like the burst's? (A dry run: nothing is
    queued or admitted.)"""
    now = cluster.now()
    checked = cluster.intake.check(QUESTION, 32, SLO, 0, True, None, None, None, None, None)
    request = checked.request(
        rid, now, cluster.block_len, cluster.tokenizer.special.mask, cluster.aligned_blocks
    )
    return cluster.controller.admission.refusal(request, now, now) is None


def bursts(count: int = 300, size: int = 3, model: str = "queue") -> Counter:
    """`count` bursts of `size` requests, one every 15 ms of the virtual clock (over the
    capacity of two instances), each burst submitted before the controller's next event. Each
    request the room refuses is asked of admission once those queued ahead were priced.
    `model`: admission's time model (`ClusterConfig.admission_time`)."""
    # no quality budget: its floor, moving between the room's event and a newcomer's pricing,
    # would be counted here as the room's misjudgement (`control/quality_budget.py`)
    cluster, clock = virtual_cluster(
        instances=(1, 1), slo=SLO, quality_budget=1.0, admission_time=model
    )
    seen = Counter()
    for k in range(count):
        run_to(cluster, clock, clock.t + 0.015)
        handles, refused = [], []
        for i in range(size):
            try:
                handles.append(
                    cluster.submit(QUESTION, max_tokens=32, slo=SLO, request_id=f"r{k}.{i}")
                )
            except Overloaded:
                refused.append(f"p{k}.{i}")
        run_until(cluster, lambda: not cluster.controller.arrivals)
        seen["room"] += len(refused)
        seen["room, admission would admit"] += sum(would_admit(cluster, r) for r in refused)
        for handle in handles:
            seen["admitted" if handle.admission.exception() is None else "admission"] += 1
    return seen


def test_the_room_counts_the_requests_queued_ahead_of_a_burst(monkeypatch):
    """(The queue's time model: the batched one's room, below.)"""
    counted = bursts()
    refuses = Room.refuses

    def ignoring_the_queue(room, priority, slo=None, max_tokens=None, ahead=0):
        return refuses(room, priority, slo, max_tokens)  # as before

    monkeypatch.setattr(Room, "refuses", ignoring_the_queue)
    ignored = bursts()
    # ignoring the queue, admission made a quarter of the refusals, after each request's queue
    # wait (before events were handled ahead of arrivals, most: 254 of 359)
    assert ignored["room"] > ignored["admission"] > 0
    # counted, the room makes most of them; admission's in full fall by 40% or more (102: 0)
    assert counted["room"] > counted["admission"]
    assert counted["admission"] <= 0.6 * ignored["admission"]
    # rarely refusing what admission would admit: at most 5 in 100 of the room's refusals
    # (2 of 269 before the default served lost work last; 5 of 405 since; 17 of 383 since load
    # control binds, pricing thresholds at Alg. 1's factor, which the room reads as of the
    # controller's last event)
    assert counted["room, admission would admit"] <= 0.05 * counted["room"]
    assert counted["admitted"] >= 0.97 * ignored["admitted"]


def test_with_the_batched_time_the_room_makes_most_refusals():
    """The batched time model (`batched_time.py`, the default) refuses a newcomer that would
    make a request in flight late; the room counts how many newcomers those take
    (`Room.fits`), so that admission in full refuses fewer than the room. What it cannot
    see: requests that finish between the room's event and the newcomer's pricing (10 of its
    419 refusals here were admission's to make by then; 70 of 351 before an instance's events
    were handled ahead of arrivals)."""
    counted = bursts(model="batched")
    assert counted["room"] > 2 * counted["admission"] > 0
    assert counted["room, admission would admit"] <= 0.25 * counted["room"]


def test_the_room_counts_each_request_queued_ahead_at_the_least_one_block_adds():
    room = Room(0, throughput=100.0, load=100.0, least=32.0, slo=2.0, least_per_block=40.0,
                block_len=32)  # fmt: skip
    assert room.spare == 100.0
    assert not room.refuses(0, max_tokens=32, ahead=1)  # 40 + 40 fit in 100
    assert room.refuses(0, max_tokens=32, ahead=2)  # 40 + 80 do not
    assert not room.refuses(1, max_tokens=32, ahead=5)  # served before everything in flight
    assert not Room().refuses(0, ahead=100)  # nothing in flight: asked in full (a probe)


def test_a_request_longer_than_any_priced_is_left_to_admission():
    """The room prices by the least per block of the latest requests priced: a request longer
    than those may be one no idle cluster serves, admission's 400 (a bad `max_tokens` among
    good requests was refused 429 by the room: `test_server`)."""
    room = Room(0, throughput=100.0, load=100.0, least=32.0, slo=2.0, least_per_block=40.0,
                block_len=32, most_blocks=2)  # fmt: skip
    assert room.refuses(0, max_tokens=64, ahead=2)
    assert not room.refuses(0, max_tokens=96, ahead=2)


def test_the_room_takes_the_wait_for_those_ahead_from_a_newcomers_slo():
    """A newcomer's SLO counts from its arrival, and admission in full prices it only after
    every request ahead of it (`Pace`): the 250th of a burst waited 0.42 s for it, and the room
    let through a wave for a batch the cluster did not take by then."""
    linear = tuple(1.0 + ahead for ahead in AHEAD)  # (time alone times 1 + those ahead)
    room = Room(0, slo=2.0, block_len=32, alone_per_block=0.01, scales=linear, fits=UNLIMITED)
    assert not room.refuses(0, max_tokens=32, ahead=150)  # 1.51 s of 2
    assert room.refuses(0, max_tokens=32, ahead=200)  # 2.01 s
    paced = replace(room, pace=0.005)
    assert paced.refuses(0, max_tokens=32, ahead=150)  # 1.51 s of 2 - 0.75
    assert not paced.refuses(0, max_tokens=32, ahead=130)  # 1.31 s of 2 - 0.65
    assert not paced.refuses(0, max_tokens=32, ahead=0)  # (none ahead: none of its SLO)


def test_the_room_refuses_a_newcomer_that_would_wait_too_long_for_an_answer():
    # traced, 400 closed-loop clients: of the refusals admission in full made, 280 of 1,063
    # came over 50 ms after their request was read, behind up to 150 let through before them
    room = Room(0, slo=2.0, block_len=32, alone_per_block=0.01, scales=(1.0,) * len(AHEAD),
                fits=UNLIMITED, pace=0.002)  # fmt: skip
    assert not room.refuses(0, max_tokens=32, ahead=150)  # 0.3 s of its 2 s: room enough
    bounded = replace(room, most_wait=0.05)
    assert not bounded.refuses(0, max_tokens=32, ahead=25)  # 50 ms
    assert bounded.refuses(0, max_tokens=32, ahead=26)
    assert not bounded.refuses(1, max_tokens=32, ahead=150)  # above those in flight: in full
    assert not replace(bounded, pace=0.0).refuses(0, max_tokens=32, ahead=150)  # (no pace yet)


def test_the_room_a_controller_prices_bounds_the_wait_its_cluster_was_set_for():
    cluster, clock = virtual_cluster(instances=(1, 1), slo=SLO, admission_wait=0.02)
    controller = cluster.controller
    run_until(cluster, lambda: len(cluster.scheduler.instances) == 2 and not controller._queued())
    for k in range(30):
        cluster.submit(QUESTION, max_tokens=32, slo=SLO, request_id=f"b{k}")
    while controller.arrivals:
        controller.run_once()
        clock.t += 0.001
    run_to(cluster, clock, clock.t + ROOM_MAX_AGE)
    room = controller.admitting.room
    assert room.most_wait == 0.02 and room.pace == pytest.approx(0.001, rel=0.05)
    assert room.refuses(0, 60.0, 32, ahead=21)  # 21 ms
    assert not replace(room, most_wait=float("inf")).refuses(0, 60.0, 32, ahead=21)


def burst(pace: Pace, count: int, at: float, apart: float) -> float:
    """`count` requests received together at `at`, asked `apart` seconds apart: when the last
    was asked."""
    for k in range(count):
        pace.asked(received=at, now=at + apart * (k + 1))
    return at + apart * count


def test_the_pace_is_the_wait_per_request_ahead_and_a_lone_request_teaches_none():
    pace = Pace()
    assert pace.at(0.0) == 0.0
    last = burst(pace, PACE_EVIDENCE + 1, at=0.0, apart=0.003)  # 0.006 / 2, 0.009 / 3, ...
    assert pace.at(last) == pytest.approx(0.003, rel=0.1)
    pace.asked(received=last, now=last + 0.05)  # alone: its wait is its own path's, no pace
    assert pace.at(last) == pytest.approx(0.003, rel=0.1)


def test_a_few_waits_set_no_pace():
    # a cold server priced its first burst of 16 streams tens of milliseconds apart, and
    # the room's wait bound then refused 9 of them
    pace = Pace()
    last = burst(pace, PACE_EVIDENCE, at=0.0, apart=0.05)  # its first is asked behind none
    assert pace.at(last) == 0.0
    pace.asked(received=0.0, now=last + 0.05)
    assert pace.at(last + 0.05) > 0.0


def test_between_bursts_the_pace_decays_toward_none():
    pace = Pace(half_life=10.0)
    last = burst(pace, 2 * PACE_EVIDENCE, at=0.0, apart=0.003)
    learnt = pace.at(last)
    assert pace.at(last + 10.0) == pytest.approx(learnt / 2)  # a half-life later, half
    assert pace.at(last + 100.0) < learnt / 1000
    last = burst(pace, 2 * PACE_EVIDENCE, at=200.0, apart=0.002)  # the next burst measures it
    assert pace.at(last) == pytest.approx(0.002, rel=0.3)


def test_a_stall_of_the_controller_teaches_the_pace_nothing():
    # a burst queued as the controller is held up 1.5 s (a planner round on a busy machine):
    # learnt, its waits read 95 ms per request ahead, and the room then took 95 ms of each
    # later newcomer's SLO for every request ahead of it
    cluster, clock = virtual_cluster(instances=(1, 1), slo=SLO)
    controller = cluster.controller
    run_until(cluster, lambda: len(cluster.scheduler.instances) == 2 and not controller._queued())
    for k in range(30):
        cluster.submit(QUESTION, max_tokens=32, slo=60.0, request_id=f"b{k}")
    stall_next_tick(cluster, clock, seconds=1.5)
    while controller.arrivals:
        controller.run_once()
        clock.t += 0.001
    assert controller.stalls.count == 1
    assert cluster.admission_pace == 0.0
    for k in range(30):  # a burst after it teaches it
        cluster.submit(QUESTION, max_tokens=32, slo=60.0, request_id=f"a{k}")
    while controller.arrivals:
        controller.run_once()
        clock.t += 0.001
    assert cluster.admission_pace == pytest.approx(0.001, rel=0.05)


def test_a_burst_the_controller_prices_a_millisecond_apart_sets_the_rooms_pace():
    cluster, clock = virtual_cluster(instances=(1, 1), slo=SLO)
    controller = cluster.controller
    run_until(cluster, lambda: len(cluster.scheduler.instances) == 2 and not controller._queued())
    assert controller.admitting.room.pace == 0.0
    for k in range(30):
        cluster.submit(QUESTION, max_tokens=32, slo=SLO, request_id=f"b{k}")
    while controller.arrivals:
        controller.run_once()
        clock.t += 0.001  # (each admission takes the controller's clock a millisecond on)
    run_to(cluster, clock, clock.t + ROOM_MAX_AGE)
    assert controller.admitting.room.pace == pytest.approx(0.001, rel=0.05)
    assert cluster.admission_pace == controller.admitting.room.pace


def idle_burst(size: int, model: str, one_at_a_time: bool = False) -> Counter:
    """`size` requests submitted at once to an idle cluster that served 20 before, together
    or `one_at_a_time` (admission priced enough of them to know the least time per block
    alone), before the controller's next event: who refused them."""
    cluster, clock = virtual_cluster(instances=(1, 1), slo=SLO, admission_time=model)
    warm = []
    for k in range(20):
        warm.append(cluster.submit(QUESTION, max_tokens=32, request_id=f"w{k}"))
        if one_at_a_time:  # (each a probe: nothing in flight when admission asks)
            run_until(cluster, lambda: warm[-1].future.done())
    run_until(cluster, lambda: all(handle.future.done() for handle in warm))
    assert cluster.in_flight == 0
    seen, handles = Counter(), []
    for i in range(size):
        try:
            handles.append(cluster.submit(QUESTION, max_tokens=32, slo=SLO, request_id=f"b{i}"))
        except Overloaded:
            seen["room"] += 1
    run_until(cluster, lambda: not cluster.controller.arrivals)
    for handle in handles:
        seen["admitted" if handle.admission.exception() is None else "admission"] += 1
    seen["first admitted"] = handles[0].admission.exception() is None
    return seen


def test_a_burst_at_an_idle_server_is_refused_at_once_beyond_what_it_takes():
    """With nothing in flight the room refused nothing, so a burst at an idle server (the 400
    closed-loop clients' first wave) went to admission in full, each request tokenized and
    queued for the controller first: the refusals' tail (docs/serving/reliability.md). With
    the batched model the room prices each request of the burst behind those ahead of it."""
    seen = idle_burst(300, "batched")
    assert seen["first admitted"] and seen["admitted"] > 0  # a probe, and more
    assert seen["room"] > 2 * seen["admission"]
    queue = idle_burst(300, "queue")  # (no model of a burst: asked in full, as before)
    assert queue["room"] == 0 and queue["first admitted"]


def test_requests_served_one_at_a_time_teach_the_room_a_burst():
    """Admission learnt the least time per block alone only from requests priced beside
    others, not from probes: after requests one at a time the room had no model of a burst,
    and the 400 clients' first wave went through it to admission in full, each request
    tokenized and queued first (docs/serving/reliability.md)."""
    seen = idle_burst(300, "batched", one_at_a_time=True)
    assert seen["first admitted"] and seen["admitted"] > 0
    assert seen["room"] > 2 * seen["admission"]


def recording_room(cluster) -> list[int]:
    """Install a room that refuses nothing and records the `ahead` it is asked with."""
    asked = []

    class Recording(Room):
        def refuses(self, priority, slo=None, max_tokens=None, ahead=0):
            asked.append(ahead)
            return False

    cluster.controller.admitting.room = Recording(0, 100.0, 0.0, 1.0, SLO, 1.0, 32)
    return asked


@pytest.mark.parametrize("queued", [0, 3])
def test_is_full_asks_the_room_with_the_queued_arrivals(queued):
    cluster, _ = virtual_cluster(instances=(1,), slo=SLO)
    asked = recording_room(cluster)
    cluster.controller.arrivals.extend([object()] * queued)
    assert not cluster.is_full(0, SLO, 32)
    assert asked == [queued]


def test_is_full_counts_the_requests_entering_ahead_until_they_are_queued():
    cluster, _ = virtual_cluster(instances=(1,), slo=SLO)
    asked = recording_room(cluster)
    with cluster.entering() as submit, cluster.entering():
        assert not cluster.is_full(0, SLO, 32)  # two let through, tokenizing
        submit(QUESTION, max_tokens=32, slo=SLO)  # (asks with those queued: none yet)
        assert not cluster.is_full(0, SLO, 32)  # one queued, one still entering
    assert not cluster.is_full(0, SLO, 32)
    assert asked == [2, 0, 2, 1]


def test_a_request_the_front_counted_is_counted_once_and_not_ahead_of_itself():
    cluster, _ = virtual_cluster(instances=(1,), slo=SLO)
    asked = recording_room(cluster)
    entry = cluster.enter()  # (the HTTP protocol let it through)
    assert not cluster.is_full(0, SLO, 32)  # a later request: behind it
    assert not cluster.is_full(0, SLO, 32, entry)  # its own check: behind none
    with cluster.entering(entry) as submit:
        assert not cluster.is_full(0, SLO, 32)  # still one entering, not two
        submit(QUESTION, max_tokens=32, slo=SLO)
    entry.leave()  # (`Guards`, when it ends: counted once)
    assert not cluster.is_full(0, SLO, 32)
    assert asked == [1, 0, 1, 0, 1]


def test_the_fronts_probe_is_not_a_refusal_that_health_counts():
    """The HTTP protocol asks the room before it reads a body (`probe`), then again with what
    the body asks for: one request refused is one refusal, not two (three in a row make the
    cluster `degraded`)."""
    cluster, _ = virtual_cluster(instances=(1,), slo=SLO)
    cluster.controller.admitting.room = Room(0, 0.0, 0.0, 1.0, SLO, 1.0, 32)  # refuses all
    assert cluster.is_full(0, probe=True)
    assert cluster.controller.admitting.refused_in_a_row == 0
    for refused in (1, 2):
        assert cluster.is_full(0, probe=True) and cluster.is_full(0, SLO, 32)
        assert cluster.controller.admitting.refused_in_a_row == refused
    assert cluster.health_reason() is None
