"""Regression tests of issue 22 in the cluster: no single request, fault or overload stops the
controller or leaves capacity lost. Each test names the bug it guards against; the HTTP front's
are in tests/test_reliability.py."""

import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
from live_cluster import QUESTIONS, WORKER, config

from dilaserve.cluster.backends import LocalBackend
from dilaserve.cluster.config import HUNG_STEP_FACTOR, MIN_STEP_TIMEOUT
from dilaserve.cluster.runtime import Closed, Cluster, Overloaded
from dilaserve.cluster.worker import MAX_NICE, WORKER_NICE, WorkerConfig
from dilaserve.control.admission import LOWEST_PRIORITY
from dilaserve.control.build import ControlSpec
from dilaserve.control.decisions import InstanceSpec, SchedulerConfig
from dilaserve.control.monitor import WorkloadMonitor
from dilaserve.control.speed import batch_seconds
from dilaserve.protocol import StepBatch, StepItem, StepKind

from conftest import HANG_GUARD_S, LOOPBACK, listening_addresses, make_request, wait_until

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


@pytest.mark.slow  # in part by test_the_monitor_takes_an_slo_of_zero_or_less, above
def test_no_extension_value_at_its_bounds_stops_the_controller():
    # (deprioritize: a request that cannot meet its SLO is still admitted, and recorded)
    with Cluster(config(control=PLANNER, overload="deprioritize")) as cluster:
        handles = [cluster.submit(QUESTIONS[0], **kw) for kw in BOUNDARY_SUBMISSIONS]
        for handle in handles:
            handle.result(HANG_GUARD_S)  # each is served (late or not)
        time.sleep(0.5)  # a planner round with every one of them in its window
        wait_until(lambda: cluster.scheduler.reconfigurer._rounds >= 1)
        assert cluster.accepting and cluster._thread.is_alive()
        assert cluster.submit(QUESTIONS[1], slo=30).result(HANG_GUARD_S).met_slo


def test_an_error_handling_one_request_fails_it_alone():
    with Cluster(config()) as cluster:
        arrive = cluster.scheduler.on_arrival

        def poisoned(request, now):
            if request.request_id == "bad":
                raise ZeroDivisionError("a controller bug")
            return arrive(request, now)

        cluster.scheduler.on_arrival = poisoned
        with pytest.raises(RuntimeError, match="bad"):
            cluster.submit(QUESTIONS[0], request_id="bad").result(HANG_GUARD_S)
        assert cluster.accepting
        assert cluster.submit(QUESTIONS[1]).result(HANG_GUARD_S).num_steps > 0
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
        assert cluster.submit(QUESTIONS[1]).result(HANG_GUARD_S).num_steps > 0
        assert cluster.controller.stats["controller_errors"] == 1


# -- latency counts from the request's arrival, not its admission ---------------------------


def test_latency_counts_from_when_the_request_reached_the_server():
    with Cluster(config()) as cluster:
        handle = cluster.submit(QUESTIONS[0], slo=HANG_GUARD_S, received=time.perf_counter() - 5.0)
        assert handle.result(HANG_GUARD_S).latency >= 5.0
        late = cluster.submit(QUESTIONS[0], slo=1.0, received=time.perf_counter() - 5.0)
        with pytest.raises(Overloaded, match="s are left"):  # it cannot meet its SLO: refused
            late.result(HANG_GUARD_S)
        assert not cluster.is_full(0)  # (not for capacity: the next one is asked again)


# -- bug 3: lost capacity was never restored ------------------------------------------------


class LoadFailsOnce(LocalBackend):
    """The first replacement dies while loading (its checkpoint is missing)."""

    def __init__(self, worker):
        super().__init__(worker)
        self.broken = False

    def start(self, spec):
        if "." in spec.instance_id and not self.broken:
            self.broken = True
            good, self.worker = self.worker, WorkerConfig(model="/nonexistent/model")
            try:
                return super().start(spec)
            finally:
                self.worker = good
        return super().start(spec)


class SpawnFailsOnce(LocalBackend):
    """Spawning the first replacement fails, as when file descriptors run out."""

    def __init__(self, worker):
        super().__init__(worker)
        self.refused = False

    def start(self, spec):
        if "." in spec.instance_id and not self.refused:
            self.refused = True
            raise OSError(24, "Too many open files")
        return super().start(spec)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [LoadFailsOnce, SpawnFailsOnce])
def test_a_replacement_that_fails_is_retried_until_capacity_is_back(backend):
    with Cluster(config(), backend=backend(WORKER)) as cluster:
        assert cluster.health() == "ok"
        cluster.backend.kill("i0")
        wait_until(lambda: "i0" not in cluster.scheduler.instances)
        assert cluster.health() == "unavailable"  # no instance serves: /health 503
        with pytest.raises(Closed):
            cluster.submit(QUESTIONS[0])
        wait_until(lambda: cluster.scheduler.instances)
        assert set(cluster.scheduler.instances) == {"i0.2"}  # the second try
        assert cluster.health() == "ok" and cluster._thread.is_alive()
        assert cluster.submit(QUESTIONS[0]).result(HANG_GUARD_S).num_steps > 0


def test_health_says_degraded_while_a_lost_instance_is_replaced():
    with Cluster(config(instances=(1, 1))) as cluster:
        cluster.backend.kill("i0")
        wait_until(lambda: "i0" not in cluster.scheduler.instances)
        assert cluster.health() == "degraded"
        assert cluster.submit(QUESTIONS[0]).result(HANG_GUARD_S).num_steps > 0  # i1 serves on
        wait_until(lambda: "i0.1" in cluster.scheduler.instances)
        assert cluster.health() == "ok"


# -- security: what listens, and where ------------------------------------------------------


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="reads Linux /proc")
def test_a_tensor_parallel_gang_listens_on_no_network_interface():
    backend = LocalBackend(WORKER)
    try:
        backend.start(InstanceSpec("tp2", 0, 2, (0, 1)))
        wait_until(lambda: any(e.kind == "up" for e in backend.poll(0.5)))
        for process in backend._gangs["tp2"].processes:
            assert listening_addresses(process.pid) <= LOOPBACK
    finally:
        backend.shutdown()


# -- bug 7: a hung worker went unseen for the default 120 s ---------------------------------


def test_the_default_step_timeout_comes_from_the_latency_profile():
    cfg = config(max_batch_tokens=4096)
    cluster = Cluster(cfg)  # (not started: nothing loads)
    slowest = cluster.scheduler.profile.step_latency(1, 4096, StepKind.RECOMPUTE)
    timeout = cluster.controller.hangs.step_timeout
    assert timeout == max(slowest * HUNG_STEP_FACTOR, MIN_STEP_TIMEOUT)
    assert timeout < 120
    overridden = Cluster(config(step_timeout=3.0)).controller.hangs.step_timeout
    assert overridden == 3.0  # --step-timeout overrides


# -- bug 5: overload was never refused ------------------------------------------------------


def answered(handles) -> list[str]:
    outcomes = []
    for handle in handles:
        try:
            if handle is None:  # refused at submission: the cluster was already full
                raise Overloaded("refused at submission")
            handle.result(HANG_GUARD_S)
            outcomes.append("served")
        except Overloaded:
            outcomes.append("refused")
    return outcomes


def submit_all(cluster, questions, **kw) -> list:
    """Each question's handle, or None where `submit` itself refused it: once admission has
    refused a request, further ones are refused at once until room is made (how soon the
    controller refuses the first depends on how busy the machine is)."""
    handles = []
    for question in questions:
        try:
            handles.append(cluster.submit(question, **kw))
        except Overloaded:
            handles.append(None)
    return handles


TIGHT = ControlSpec(scheduler=SchedulerConfig(slo=0.3))  # capacity: one 0.3 s window


def test_requests_over_capacity_are_refused_and_the_rest_served():
    with Cluster(config(control=TIGHT)) as cluster:
        handles = submit_all(cluster, QUESTIONS * 10, max_tokens=128)
        outcomes = answered(handles)
        assert outcomes[0] == "served"  # an idle cluster takes anything
        assert "refused" in outcomes
        assert cluster.controller.stats["refused"] == outcomes.count("refused") - handles.count(
            None
        )
        assert cluster.in_flight == 0
        assert not cluster.is_full(0)  # requests finished since the last refusal
        assert cluster.submit(QUESTIONS[0]).result(HANG_GUARD_S).num_steps > 0  # room again


@pytest.mark.slow
def test_over_capacity_may_be_served_last_instead():
    with Cluster(config(control=TIGHT, overload="deprioritize")) as cluster:
        handles = [cluster.submit(q, max_tokens=128) for q in QUESTIONS * 10]
        assert answered(handles) == ["served"] * len(handles)
        assert cluster.controller.stats["deprioritized"] > 0
        last = [h for h in handles if h.request.priority == LOWEST_PRIORITY]
        assert len(last) == cluster.controller.stats["deprioritized"]


# -- bug 6, the workers' side: terminal signals, and their CPU priority ------------------------


def test_workers_ignore_terminal_signals_and_run_at_the_niceness_asked():
    backend = LocalBackend(replace(WORKER, nice=7))
    try:
        backend.start(InstanceSpec("w", 0, 1, (0,)))
        wait_until(lambda: any(e.kind == "up" for e in backend.poll(0.5)))
        (worker,) = backend._gangs["w"].processes
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, worker.pid) == min(ours + 7, MAX_NICE)
        for terminal in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            worker.send_signal(terminal)
        time.sleep(1.0)
        assert worker.poll() is None and backend.poll(0.1) == []
    finally:
        backend.shutdown()


def test_worker_niceness_is_an_option_of_every_cluster_command():
    from dilaserve.cli import build_parser
    from dilaserve.cli_args import resolve_model
    from dilaserve.cli_cluster import cluster_config

    for command in ("serve", "run-trace"):
        args = build_parser().parse_args([command, "--worker-nice", "3", "--no-measured-speed"])
        resolve_model(args)
        config, _ = cluster_config(args)
        assert config.worker.nice == 3 and config.measured_speed is False
    assert build_parser().parse_args(["serve"]).worker_nice == WORKER_NICE
    assert build_parser().parse_args(["serve"]).measured_speed is True
    with pytest.raises(SystemExit):  # a rank cannot raise its priority, nor go past 19
        build_parser().parse_args(["serve", "--worker-nice", "-1"])
    with pytest.raises(ValueError, match="nice=20"):
        WorkerConfig(nice=20)


# -- bug 5, what admission prices at: the measured speed, the room between events --------------


def test_the_runtime_measures_how_much_slower_steps_run_than_profiled():
    cluster = Cluster(config())  # (not started: its scheduler is all this needs)
    scheduler = cluster.scheduler
    scheduler.add_instance("i0", 1, 8192)
    for i in range(4):
        scheduler.on_arrival(make_request(f"r{i}", gen_len=32), 0.0)
    batch = StepBatch(tuple(StepItem(f"r{i}", 0.9, StepKind.CACHE) for i in range(4)))
    predicted = batch_seconds(
        scheduler.profile, 1, batch, scheduler.config.costs, scheduler.requests
    )
    assert predicted == scheduler.profile.step_latency(1, 4 * 32, StepKind.CACHE)
    for _ in range(200):
        scheduler.speed.observe(1, batch, 3 * predicted)
    assert scheduler.speed.slowdown == pytest.approx(3.0, rel=1e-3)
    for _ in range(200):  # faster than profiled: the profile stands
        scheduler.speed.observe(1, batch, 0.5 * predicted)
    assert scheduler.speed.ratio < 0.6 and scheduler.speed.slowdown == 1.0


def test_the_room_between_events_refuses_only_what_admission_would():
    cluster = Cluster(config(control=TIGHT))  # (not started: its control plane is all this needs)
    scheduler, admission = cluster.scheduler, cluster.controller.admission
    scheduler.add_instance("i0", 1, 8192)
    assert not admission.room(0.0).refuses(0)  # nothing in flight
    requests = [make_request(f"r{i}", gen_len=256) for i in range(40)]
    for r in requests:  # taken in whatever admission says: far over capacity
        scheduler.on_arrival(r, 0.0)
    room = admission.room(0.0)
    assert room.spare < 0 and room.refuses(0)
    assert not room.refuses(1)  # served before everything in flight: asked in full
    assert admission.refusal(make_request("new", gen_len=8), 0.0) is not None
    for r in requests:  # capacity frees (cancelled, as finished or failed)
        scheduler.cancel(r.request_id)
    assert not admission.room(0.0).refuses(0)


def test_a_failing_admission_check_admits_the_request():
    with Cluster(config()) as cluster:
        cluster.controller.admission.refusal = lambda request, now: 1 / 0  # a bug in the check
        assert cluster.submit(QUESTIONS[0]).result(HANG_GUARD_S).num_steps > 0
        assert cluster.controller.stats["controller_errors"] == 1
