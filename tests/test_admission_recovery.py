"""Admission recovers by itself: after a storm, a fault or a CPU-hungry neighbour made steps
slow, an idle server admits again (`control/admission.py`, `control/speed.py`).

The cluster's controller runs here on a virtual clock over `VirtualInstances`, a backend
whose steps take `factor` times the latency profile's price (a storm, or a neighbour, is a
factor above 1 while it lasts) and commit as the simulator's behaviour model says. Everything
is asserted in events and steps of that clock, never in wall-clock seconds.
"""

import contextlib
import heapq
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from dilaserve.cluster.backends import WorkerEvent
from dilaserve.cluster.gate import ROOM_MAX_AGE
from dilaserve.cluster.hangs import LAST_INSTANCE_GRACE
from dilaserve.cluster.requests import FULL, InvalidRequest, Overloaded
from dilaserve.cluster.runtime import Cluster, ClusterConfig
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.control.admission import LOWEST_PRIORITY, Admission, Room
from dilaserve.control.build import ControlSpec, build_scheduler
from dilaserve.control.decisions import SchedulerConfig
from dilaserve.control.speed import HALF_LIFE, STALE_STEPS, MeasuredSpeed, batch_seconds
from dilaserve.protocol import StepBatch, StepItem, StepKind, StepOutput
from dilaserve.server.app import ServerSettings, create_app
from dilaserve.server.metrics import ServerMetrics
from dilaserve.sim.behaviour import ParametricBehaviour

from conftest import AnyIntake, make_request, refused_handle

QUESTION = "What is 12 + 30?"
MODEL = "tiny-llada"


class VirtualInstances:
    """A backend on a virtual clock (`t`): a step of a batch takes `factor` (times the
    instance's `slow`) times what the latency profile prices it at; `poll` moves the clock to
    the next step's end, or by its timeout when none ends sooner."""

    def __init__(self):
        self.t = 0.0
        self.factor = 1.0
        self.slow: dict[str, float] = {}  # instance id -> a further factor on its steps
        self.cluster = None  # set once the cluster is built (its scheduler prices the steps)
        self._running: dict[str, tuple[float, object]] = {}
        self._events: list[WorkerEvent] = []
        self._behaviour = ParametricBehaviour(seed=0)

    def __call__(self) -> float:  # the clock the cluster and its controller read
        return self.t

    def start(self, spec) -> None:
        self._events.append(WorkerEvent("up", spec.instance_id))

    def step(self, instance_id, batch) -> None:
        s = self.cluster.scheduler
        tp = s.instances[instance_id].tp
        price = batch_seconds(s.profile, tp, batch, s.config.costs, s.requests)
        factor = self.factor * self.slow.get(instance_id, 1.0)
        self._running[instance_id] = (self.t + factor * price, batch)

    def kill(self, instance_id) -> None:
        self._running.pop(instance_id, None)
        self._events.append(WorkerEvent("died", instance_id, error="killed (-9)"))

    def poll(self, timeout: float) -> list[WorkerEvent]:
        if self._events:
            events, self._events = self._events, []
            return events
        ends = [(end, iid) for iid, (end, _) in self._running.items()]
        if not ends or heapq.nsmallest(1, ends)[0][0] > self.t + timeout:
            self.t += max(timeout, 1e-6)
            return []
        end, iid = min(ends)
        self.t = max(self.t, end)
        _, batch = self._running.pop(iid)
        requests = self.cluster.scheduler.requests
        results = tuple(
            self._behaviour.step(requests[i.request_id].request, i.threshold, i.kind)
            for i in batch.items
            if i.request_id in requests
        )
        return [WorkerEvent("done", iid, StepOutput(results, 0), 0.0)]

    def release(self, instance_id, request_ids) -> None:
        pass

    def stop(self, instance_id) -> None:
        self._running.pop(instance_id, None)

    def wake(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def virtual_cluster(
    instances=(1,), slo=0.5, quality_budget=None, nodes=(), **kw
) -> tuple[Cluster, VirtualInstances]:
    """A cluster serving on `VirtualInstances`, its controller driven by `run_until`;
    `nodes`: the planner's GPUs per node (none: no planner)."""
    clock = VirtualInstances()
    control = ControlSpec(
        scheduler=SchedulerConfig(slo=slo), quality_budget=quality_budget, nodes=nodes
    )
    config = ClusterConfig(WorkerConfig(threads=1), control, instances=instances, **kw)
    cluster = Cluster(config, backend=clock)
    clock.cluster = cluster
    cluster.now = cluster.controller.now = clock
    cluster.controller.start(config.initial_specs())
    cluster._accepting = True
    return cluster, clock


def run_until(cluster: Cluster, done, limit: int = 200_000) -> int:
    """Run the controller's events (as its thread does) until `done()`; returns how many."""
    for events in range(limit):
        if done():
            return events
        cluster.controller.run_once()
    raise AssertionError(f"not done after {limit} events")


def run_to(cluster: Cluster, clock: VirtualInstances, t: float) -> int:
    """Run the controller until its clock reaches `t` and every instance's event read by then
    is handled (as its thread handles one as soon as it is read): a request submitted next
    finds the room priced after them."""
    controller = cluster.controller
    return run_until(cluster, lambda: clock.t >= t and not controller._events)


def submit(cluster: Cluster, rid: str, **kw):
    """A request's handle, or the `Overloaded` that refused it at once."""
    try:
        return cluster.submit(QUESTION, max_tokens=32, request_id=rid, **kw)
    except Overloaded as refused:
        return refused


def outcome(cluster: Cluster, handle) -> str:
    """'refused' (429), 'invalid' (400) or 'admitted', once the controller has decided."""
    if isinstance(handle, Overloaded):
        return "refused"
    run_until(cluster, handle.admission.done)
    error = handle.admission.exception()
    if error is None:
        return "admitted"
    return "invalid" if isinstance(error, InvalidRequest) else "refused"


def slow_phase(cluster, clock, factor: float, requests: int, prefix: str, gap=0.0) -> list:
    """`requests` arrive `gap` seconds apart while every step runs `factor` times the
    profile's time; returns their outcomes once every admitted one is done."""
    clock.factor = factor
    outcomes = []
    for k in range(requests):
        run_to(cluster, clock, clock.t + gap)
        outcomes.append(outcome(cluster, submit(cluster, f"{prefix}{k}")))
    run_until(cluster, lambda: not cluster.controller.handles)
    return outcomes


def idle_then_admits(cluster, clock, idle_ticks: int = 2) -> None:
    """The slow phase is over: the server idles a few ticks, then takes a request and serves
    it at the profile's speed, and the measured slowdown comes back toward 1."""
    clock.factor = 1.0
    until = clock.t + idle_ticks * cluster.config.tick
    run_until(cluster, lambda: clock.t >= until)
    assert cluster.in_flight == 0 and not cluster.is_full(0)
    handle = submit(cluster, "after")
    assert outcome(cluster, handle) == "admitted"
    steps = cluster.controller.steps_run
    run_until(cluster, handle.future.done)
    assert handle.result().num_steps == cluster.controller.steps_run - steps > 0
    assert cluster.health() == "ok"


@pytest.mark.parametrize("factor", [40.0, 400.0])
def test_after_a_storm_an_idle_server_admits(factor):
    cluster, clock = virtual_cluster()
    outcomes = slow_phase(cluster, clock, factor, requests=200, prefix="storm", gap=0.05)
    assert "admitted" in outcomes and "refused" in outcomes
    assert cluster.step_slowdown > 10  # what the storm left behind
    idle_then_admits(cluster, clock)


def test_after_a_cpu_hungry_neighbour_leaves_an_idle_server_admits():
    """A neighbour makes a light load's steps 40x slower; once it leaves, the slowdown
    decays with event time alone (no step runs meanwhile), and the next request is served."""
    cluster, clock = virtual_cluster()
    assert "admitted" in slow_phase(cluster, clock, 40.0, requests=8, prefix="n", gap=1.0)
    learnt = cluster.step_slowdown
    assert learnt > 20
    ticks = round(3 * HALF_LIFE / cluster.config.tick) + 20
    idle_then_admits(cluster, clock, idle_ticks=ticks)
    assert cluster.step_slowdown < 1 + (learnt - 1) / 8  # 3 half-lives, then steps at 1x


def test_after_a_worker_is_killed_under_load_an_idle_server_admits():
    cluster, clock = virtual_cluster(instances=(1, 1))
    clock.factor = 40.0
    handles = [submit(cluster, f"f{k}") for k in range(30)]
    run_until(cluster, lambda: cluster.controller.steps_run >= 20)
    assert cluster.controller.restored_after is None
    clock.kill("i0")  # kill -9 under load: its requests resume on i1; a replacement starts
    run_until(cluster, lambda: not cluster.controller.handles)
    assert cluster.controller.stats["failures"] == 1
    restored = cluster.controller.restored_after  # (this backend's replacement is up at once)
    assert restored is not None and 0 <= restored < cluster.config.tick
    app = create_app(cluster, ServerSettings(MODEL), ServerMetrics(), manage=False)
    with TestClient(app) as client:
        assert f"dilaserve_capacity_restored_seconds {restored}" in client.get("/metrics").text
    assert any(not isinstance(h, Overloaded) and h.future.exception() is None for h in handles)
    idle_then_admits(cluster, clock)


def test_a_replacements_start_up_prices_the_planners_next_move():
    cluster, clock = virtual_cluster(instances=(1, 1), nodes=(2,))
    planner = cluster.controller.scheduler.reconfigurer
    assert planner.startup_delay == planner.config.startup_delay  # nothing started yet
    handles = [submit(cluster, f"p{k}") for k in range(10)]
    run_until(cluster, lambda: cluster.controller.steps_run >= 5)
    clock.kill("i0")
    run_until(cluster, lambda: not cluster.controller.handles)
    restored = cluster.controller.restored_after  # (started at once, up at once)
    assert restored is not None and planner.startup_delay == restored
    app = create_app(cluster, ServerSettings(MODEL), ServerMetrics(), manage=False)
    with TestClient(app) as client:
        assert f"dilaserve_planner_startup_seconds {restored}" in client.get("/metrics").text
    assert all(h.future.exception() is None for h in handles if not isinstance(h, Overloaded))


def test_slowness_alone_never_kills_the_last_instance_and_the_timeout_scales(caplog):
    """`--step-timeout 3` (profile seconds) on a machine whose steps run 400x slower than the
    profile: the timeout grows with the measured slowdown, and the one instance is not killed
    for being slow (its first slow step, before any was measured, is spared and logged); a
    dead one is still replaced."""
    cluster, clock = virtual_cluster(instances=(1,), slo=1000.0, step_timeout=3.0)
    outcomes = slow_phase(cluster, clock, 400.0, requests=4, prefix="s")
    assert "admitted" in outcomes and cluster.controller.stats["failures"] == 0
    assert cluster.controller.hangs.timeout_of("i0") > 3.0 * 10
    spared = [r for r in caplog.records if "the last instance serving" in r.getMessage()]
    assert len(spared) == 1
    clock.kill("i0")
    run_until(cluster, lambda: cluster.controller.stats["failures"] == 1)


def test_a_hung_last_instance_is_still_killed_past_the_grace():
    cluster, clock = virtual_cluster(instances=(1,), slo=1000.0, step_timeout=3.0)
    clock.factor = 1e9  # its step never ends: hung, not slow
    outcome(cluster, submit(cluster, "h"))
    run_until(cluster, lambda: cluster.controller.stats["failures"] == 1)
    assert clock.t > LAST_INSTANCE_GRACE * 3.0  # spared while it could have been slow


def test_an_slo_no_idle_cluster_meets_is_invalid_not_overloaded():
    cluster, clock = virtual_cluster()
    assert outcome(cluster, submit(cluster, "tiny", slo=1e-4)) == "invalid"
    handle = submit(cluster, "tiny2", slo=1e-4)
    run_until(cluster, handle.admission.done)
    error = handle.admission.exception()
    assert isinstance(error, InvalidRequest) and error.param == "slo_ms"
    assert cluster.controller.stats["refused_invalid"] == 2
    assert outcome(cluster, submit(cluster, "fine")) == "admitted"


def test_an_slo_no_idle_cluster_meets_is_invalid_even_when_the_room_is_full():
    """The front's room check leaves an SLO shorter than the server's to admission, which
    alone tells the impossible (a 400) from the overloaded (a 429)."""
    cluster, clock = virtual_cluster(slo=0.05)
    for k in range(8):
        outcome(cluster, submit(cluster, f"busy{k}", slo=60.0))
    assert cluster.is_full(0) and not cluster.is_full(0, 1e-4)
    assert outcome(cluster, submit(cluster, "tiny", slo=1e-4)) == "invalid"


def test_over_capacity_is_served_last_instead_when_deprioritized():
    """`--overload deprioritize`: what admission would refuse is served, after everything else
    (tests/test_reliability_cluster.py does it with real workers, slow)."""
    cluster, clock = virtual_cluster(slo=0.3, overload="deprioritize")
    handles = [submit(cluster, f"d{k}") for k in range(30)]
    run_until(cluster, lambda: not cluster.controller.handles)
    assert all(h.result().num_steps > 0 for h in handles)  # none refused
    last = [h.request_id for h in handles if h.request.priority == LOWEST_PRIORITY]
    assert 0 < len(last) == cluster.controller.stats["deprioritized"]
    assert cluster.controller.stats["refused"] == 0


def test_when_deprioritizing_the_front_refuses_nothing_for_capacity():
    # the room is admission's answer ahead of time: where admission serves last what it would
    # refuse, the room must not answer it 429 (it did a burst behind others, before this)
    cluster, clock = virtual_cluster(instances=(1, 1), slo=0.3, overload="deprioritize")
    warm = [submit(cluster, f"w{k}") for k in range(20)]  # (the room learns their prices)
    run_until(cluster, lambda: all(h.future.done() for h in warm))
    run_to(cluster, clock, clock.t + 0.05)
    assert not cluster.gate.refuses(0, 0.3, 32, ahead=500)
    burst = [submit(cluster, f"b{k}") for k in range(60)]
    run_until(cluster, lambda: not cluster.controller.arrivals)
    assert not cluster.gate.refuses(0, 0.3, 32, ahead=500)
    run_until(cluster, lambda: all(h.future.done() for h in burst))
    assert cluster.controller.stats["refused"] == 0


class _InvalidAtAdmission:
    """Just enough of a Cluster for the API: admission fails each request as invalid."""

    accepting = True

    def __init__(self):
        self.config = ClusterConfig()
        self.intake = AnyIntake()

    def submit(self, prompt, **kw):
        return refused_handle(InvalidRequest("slo_ms", "slo_ms: no cluster meets it"), **kw)

    @contextlib.contextmanager
    def entering(self, entry=None):
        yield self.submit

    def is_full(self, priority, slo=None, max_tokens=None, entry=None):
        return False


def test_an_slo_no_idle_cluster_meets_is_a_400_naming_it():
    app = create_app(_InvalidAtAdmission(), ServerSettings(MODEL), ServerMetrics(), manage=False)
    with TestClient(app) as client:
        body = {"model": MODEL, "prompt": "hi", "slo_ms": 0.1}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "slo_ms"


def test_a_request_is_priced_against_its_own_slo():
    """Load in flight that a 0.05 s window cannot hold, but a minute can: a request that
    gives itself a minute is admitted; one with the server's SLO is not."""
    cluster, clock = virtual_cluster(slo=0.05)
    handles = [submit(cluster, f"busy{k}", slo=60.0) for k in range(8)]
    assert [outcome(cluster, h) for h in handles] == ["admitted"] * 8
    assert outcome(cluster, submit(cluster, "long", slo=60.0)) == "admitted"
    assert outcome(cluster, submit(cluster, "short")) == "refused"


def test_health_is_degraded_while_admission_refuses_everything():
    cluster, clock = virtual_cluster(slo=0.05)
    for k in range(8):
        outcome(cluster, submit(cluster, f"busy{k}", slo=60.0))
    refused = [outcome(cluster, submit(cluster, f"r{k}")) for k in range(3)]
    assert refused == ["refused"] * 3
    assert cluster.health() == "degraded" and "refused the last 3" in cluster.health_reason()
    app = create_app(cluster, ServerSettings(MODEL), ServerMetrics(), manage=False)
    with TestClient(app) as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "refused the last 3" in health.json()["reason"]
        assert "dilaserve_degraded 1.0" in client.get("/metrics").text
    run_until(cluster, lambda: not cluster.controller.handles)
    assert outcome(cluster, submit(cluster, "next")) == "admitted"
    assert cluster.health() == "ok" and cluster.health_reason() is None


# -- the estimate and the room, alone -------------------------------------------------------


def observed_speed(ratio: float, steps: int, now: float) -> tuple[MeasuredSpeed, float]:
    """A `MeasuredSpeed` after `steps` steps on instance "a", each `ratio` times its price,
    the last at `now`; and that step's seconds."""
    s = build_scheduler(ControlSpec())
    s.add_instance("a", 1, 8192)
    s.on_arrival(make_request("r", gen_len=32), 0.0)
    step = StepBatch((StepItem("r", 0.9, StepKind.FULL),))
    price = batch_seconds(s.profile, 1, step, s.config.costs, s.requests)
    for _ in range(steps):
        s.speed.observe(1, step, ratio * price, "a", now=now)
    return s.speed, ratio * price


def test_a_stale_slowdown_decays_toward_the_profile_with_event_time():
    speed, seconds = observed_speed(40.0, 200, now=5.0)
    learnt = speed.slowdown
    assert learnt == pytest.approx(40.0, rel=0.01)
    fresh_until = 5.0 + STALE_STEPS * seconds
    speed.advance(fresh_until)  # evidence is current for a few steps' time: no decay
    assert speed.slowdown == pytest.approx(learnt) and speed.stale_seconds() < 1e-9
    speed.advance(fresh_until + HALF_LIFE)
    assert speed.slowdown == pytest.approx(1 + (learnt - 1) / 2)
    assert speed.instance_ratio("a") == pytest.approx(1 + (learnt - 1) / 2)
    assert speed.stale_seconds() == pytest.approx(HALF_LIFE)
    speed.advance(fresh_until + HALF_LIFE)  # the same time again: no further decay
    assert speed.slowdown == pytest.approx(1 + (learnt - 1) / 2)
    speed.advance(fresh_until + 10 * HALF_LIFE)
    assert speed.slowdown < 1.05


def test_the_room_refuses_nothing_while_nothing_is_in_flight():
    s = build_scheduler(ControlSpec())
    s.add_instance("a", 1, 8192)
    s.speed.ratio = 1e6  # whatever the estimate says
    admission = Admission(s)
    room = admission.room(0.0)
    assert not room.refuses(0) and not room.refuses(0, ahead=100)  # (no request priced yet)
    assert admission.refusal(make_request("r", gen_len=32, deadline=10.0), 0.0) is None


def test_the_room_prices_a_request_by_its_blocks_at_the_least_load_seen_per_block():
    room = Room(0, throughput=100.0, load=150.0, least=32.0, slo=2.0, least_per_block=40.0,
                block_len=32)  # fmt: skip
    assert room.spare == 50.0
    assert not room.refuses(0) and not room.refuses(0, max_tokens=32)  # one block: 40 fit
    assert room.refuses(0, max_tokens=33) and room.refuses(0, max_tokens=64)  # two: 80 do not
    assert not room.refuses(1, max_tokens=64)  # served before everything in flight


@pytest.mark.parametrize("model", ["queue", "batched"])
def test_over_capacity_the_room_refuses_at_once_what_admission_would(model):
    # the room counted a newcomer as one step: at 3x capacity 60% of the refusals waited for
    # the controller's next event instead (docs/serving/reliability.md); with the batched
    # time model (`Room.fits`) a request in flight the newcomer would make late may finish
    # between the room's event and the newcomer's pricing: most, not all, by the room. No
    # quality budget: its floor, moving between the room's event and a newcomer's pricing,
    # would be counted as the room's misjudgement (4 of 44 refusals, as `test_admission_room`)
    cluster, clock = virtual_cluster(
        instances=(1, 1), slo=0.5, admission_time=model, quality_budget=1.0
    )
    seen = {"room": 0, "admission": 0, "admitted": 0}
    for k in range(400):  # every 5 ms of the virtual clock: over its capacity
        run_to(cluster, clock, clock.t + 0.005)
        handle = submit(cluster, f"r{k}")
        kind = "room" if isinstance(handle, Overloaded) else outcome(cluster, handle)
        seen[{"refused": "admission"}.get(kind, kind)] += 1
    assert seen["admitted"] > 0
    if model == "queue":
        assert seen["room"] > 0 and seen["admission"] == 0
    else:
        assert seen["room"] > 2 * seen["admission"]


def test_a_burst_of_arrivals_is_priced_into_the_room_once_it_is_handled(monkeypatch):
    """Pricing the room walks every request in flight: after a burst it is priced once no
    event waits, not after each arrival (at 400 clients that was a quarter of the controller's
    time, and the refusals waited behind it), and it then counts the whole burst."""
    cluster, clock = virtual_cluster(instances=(1, 1), slo=5.0)
    controller = cluster.controller
    run_until(cluster, lambda: len(cluster.scheduler.instances) == 2 and not controller._queued())
    priced = []
    room = controller.admission.room
    monkeypatch.setattr(controller.admission, "room", lambda now: priced.append(now) or room(now))
    handles = [submit(cluster, f"b{k}") for k in range(20)]
    run_until(cluster, lambda: not controller.arrivals)
    assert all(outcome(cluster, h) == "admitted" for h in handles)
    assert len(priced) == 1
    latest = replace(controller.admitting.room, pace=0.0, most_wait=float("inf"))  # (the gate's)
    assert latest == room(controller._last)  # (the latest, with all 20 in flight)
    assert controller.admitting.room.lowest_priority == 0
    run_until(cluster, lambda: not controller.handles)  # each event alone: priced after each
    assert len(priced) > 20


def test_an_instance_whose_step_ended_does_not_wait_for_a_burst_to_be_admitted():
    """While arrivals queue, the instances' events are read every `READ_EVENTS_EVERY` and
    handled first: the instance whose step ended runs its next one with the burst admitted
    so far, not after the last of it (each admission costs the controller about a
    millisecond: 300 of them held both instances idle for 0.3 s, and the step that had ended
    was measured that long)."""
    # (a wait for admission's answer of a second: the burst, priced a millisecond apart, is
    # all admitted, not refused from the back as it queues past the default's 50 ms)
    cluster, clock = virtual_cluster(instances=(1,), slo=5.0, admission_wait=1.0)
    controller = cluster.controller
    first = submit(cluster, "first")
    run_until(cluster, lambda: controller._inflight)
    ((end, _),) = controller.backend._running.values()
    burst = [submit(cluster, f"b{k}") for k in range(50)]
    clock.t = end  # the step has ended; each admission takes the clock a millisecond on
    admitted_when_stepped = []
    while controller.arrivals:
        steps = controller.steps_run
        controller.run_once()
        clock.t += 0.001
        if controller.steps_run > steps:
            admitted_when_stepped.append(50 - len(controller.arrivals))
    assert admitted_when_stepped and admitted_when_stepped[0] < 5
    assert all(outcome(cluster, h) == "admitted" for h in [first, *burst])
    run_until(cluster, lambda: not controller.handles)


def test_a_failed_read_of_the_instances_between_arrivals_fails_no_request(monkeypatch):
    """The read between a burst's arrivals is the controller's own: if it raises, the error
    is survived as a failed wait, not blamed on the arrival handled before it."""
    cluster, clock = virtual_cluster(instances=(1,), slo=5.0)
    controller = cluster.controller
    poll = clock.poll

    def failing_once(timeout):
        if timeout == 0.0 and not failing_once.failed:
            failing_once.failed = True
            raise OSError("a socket went bad")
        return poll(timeout)

    failing_once.failed = False
    monkeypatch.setattr(clock, "poll", failing_once)
    handles = [submit(cluster, f"b{k}") for k in range(3)]
    while controller.arrivals:
        controller.run_once()
        clock.t += 0.001
    run_until(cluster, lambda: not controller.handles)
    assert failing_once.failed and controller.stats["controller_errors"] == 1
    assert all(h.future.exception() is None for h in handles)


def test_a_bursts_refusals_are_answered_from_the_back_of_the_queue(monkeypatch):
    """A burst the front let through (here: its room refused nothing) queues for admission;
    once the room is priced again with the first of it in flight, what it refuses behind
    those ahead is refused at once from the back of the queue, not after each admission
    ahead of it; the rest is asked in full, in order, and every request gets its answer."""
    cluster, clock = virtual_cluster(instances=(1, 1), slo=0.5)
    controller = cluster.controller
    warm = [submit(cluster, f"w{k}") for k in range(20)]  # (the room prices by what it saw)
    run_until(cluster, lambda: not controller.handles)
    assert all(outcome(cluster, h) == "admitted" for h in warm)
    asked = []
    refusal = controller.admission.refusal
    monkeypatch.setattr(controller.admission, "refusal", lambda r, *a: asked.append(r) or
                        refusal(r, *a))  # fmt: skip
    controller.admitting.room = Room()  # the front lets the whole burst through
    burst = [submit(cluster, f"b{k}") for k in range(200)]
    for _ in range(1000):  # each event takes ROOM_MAX_AGE: the room is priced after each
        if not controller.arrivals:
            break
        clock.t += ROOM_MAX_AGE
        controller.run_once()
    assert not controller.arrivals
    outcomes = [outcome(cluster, h) for h in burst]
    by_room = [k for k, h in enumerate(burst) if FULL in str(h.admission.exception() or "")]
    assert by_room and by_room == list(range(by_room[0], 200))  # the back of the queue
    assert len(asked) == by_room[0] < 200 and "admitted" in outcomes[: by_room[0]]
    run_until(cluster, lambda: not controller.handles)  # the admitted ones finish
