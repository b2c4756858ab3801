"""Regression tests of issue 22: no single request, fault or overload stops the controller, takes
the service down or lets anyone in. Each test names the bug it guards against."""

import time

import pytest

from dilaserve.cluster.runtime import Cluster, ClusterConfig
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.control.build import ControlSpec
from dilaserve.control.monitor import WorkloadMonitor
from dilaserve.tasks import arith

WORKER = WorkerConfig(threads=1)
QUESTIONS = [p.question for p in arith.generate(4, seed=5, split="test")]


def config(**kw) -> ClusterConfig:
    kw.setdefault("worker", WORKER)
    kw.setdefault("tick", 0.1)
    kw.setdefault("instances", (1,))
    return ClusterConfig(**kw)


def wait_until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# -- bug 1: a tiny or late SLO killed the controller at the next planner round ---------------


@pytest.mark.parametrize("slo", [1e-4, 0.0, -2.0])
def test_the_monitor_takes_an_slo_of_zero_or_less(slo):
    monitor = WorkloadMonitor(window=10)
    monitor.record(1.0, 20, 64, slo)  # a request admitted at (or after) its own deadline
    (cls,) = monitor.classes(2.0)
    assert cls.slo > 0


PLANNER = ControlSpec(nodes=(2,), planner_period=0.3)
BOUNDARY_SUBMISSIONS = [
    {"slo": 1e-9},
    {"slo": 1e-4},
    {"slo": 1e9},
    {"priority": 2**31 - 1},
    {"priority": -(2**31)},
    {"threshold": 1e-9},
    {"threshold": 1.0},
    {"min_threshold": 1.0, "max_threshold": 1.0},
    {"min_threshold": 1e-9, "max_threshold": 1e-9},
    {"max_tokens": 1},
    {"stop": ["x" * 256] * 4},
]


def test_no_extension_value_at_its_bounds_stops_the_controller():
    with Cluster(config(control=PLANNER)) as cluster:
        handles = [cluster.submit(QUESTIONS[0], **kw) for kw in BOUNDARY_SUBMISSIONS]
        for handle in handles:
            handle.result(60)  # each is served (late or not)
        time.sleep(0.5)  # a planner round with every one of them in its window
        wait_until(lambda: cluster.scheduler.reconfigurer._rounds >= 1)
        assert cluster.accepting and cluster._thread.is_alive()
        assert cluster.submit(QUESTIONS[1], slo=30).result(60).met_slo


def test_an_error_handling_one_request_fails_it_alone():
    with Cluster(config()) as cluster:
        arrive = cluster.scheduler.on_arrival

        def poisoned(request, now):
            if request.request_id == "bad":
                raise ZeroDivisionError("a controller bug")
            return arrive(request, now)

        cluster.scheduler.on_arrival = poisoned
        with pytest.raises(RuntimeError, match="bad"):
            cluster.submit(QUESTIONS[0], request_id="bad").result(60)
        assert cluster.accepting
        assert cluster.submit(QUESTIONS[1]).result(60).num_steps > 0
        assert cluster.in_flight == 0


def test_an_error_in_a_tick_is_survived():
    with Cluster(config()) as cluster:
        tick, calls = cluster.scheduler.on_tick, []

        def failing(now):
            calls.append(now)
            if len(calls) == 1:
                raise ValueError("a planner bug")
            return tick(now)

        cluster.scheduler.on_tick = failing
        wait_until(lambda: len(calls) >= 2)
        assert cluster.accepting
        assert cluster.submit(QUESTIONS[1]).result(60).num_steps > 0
        assert cluster.stats["controller_errors"] == 1
