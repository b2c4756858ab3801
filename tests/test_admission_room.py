"""The front's room (`admission.Room`, `Cluster.is_full`) against admission in full, on the
virtual clock of `test_admission_recovery`: counts of who refused what, never times.

A refusal made by admission in full costs the client its tokenizing and its queue wait for the
controller (the tail of the refusals' latency at 3x capacity,
docs/serving/reliability.md); one the room makes is answered at once. Requests that come in a
burst between two controller events all found the room left for one before the room counted the
requests queued ahead of them."""

from collections import Counter

import pytest
from test_admission_recovery import QUESTION, run_until, virtual_cluster

from dilaserve.cluster.requests import Overloaded
from dilaserve.control.admission import Room

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
    cluster, clock = virtual_cluster(instances=(1, 1), slo=SLO, admission_time=model)
    seen = Counter()
    for k in range(count):
        arrival = clock.t + 0.015
        run_until(cluster, lambda arrival=arrival: clock.t >= arrival)
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
    # ignoring the queue, admission made most refusals, after each request's queue wait
    assert ignored["admission"] > ignored["room"] > 0
    # counted, the room makes most of them; admission's in full fall by 40% or more (262: 135)
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
    see: requests that finish between the room's event and the newcomer's pricing (70 of its
    351 refusals here were admission's to make by then)."""
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


@pytest.mark.parametrize("queued", [0, 3])
def test_is_full_asks_the_room_with_the_queued_arrivals(queued):
    cluster, _ = virtual_cluster(instances=(1,), slo=SLO)
    asked = []

    class Recording(Room):
        def refuses(self, priority, slo=None, max_tokens=None, ahead=0):
            asked.append(ahead)
            return False

    cluster.controller.room = Recording(0, 100.0, 0.0, 1.0, SLO, 1.0, 32)
    cluster.controller.arrivals.extend([object()] * queued)
    assert not cluster.is_full(0, SLO, 32)
    assert asked == [queued]
