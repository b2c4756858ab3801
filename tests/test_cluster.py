"""The cluster runtime serves real instances of the bundled model: right answers, streamed text,
parity with the simulator, surviving a killed worker, live reconfiguration, tensor parallelism."""

import asyncio
import concurrent.futures
import json
import os
import time

import pytest

from dilaserve.cluster.backends import LocalBackend, WorkerEvent
from dilaserve.cluster.config import MIN_STEP_TIMEOUT
from dilaserve.cluster.runtime import Closed, Cluster, ClusterConfig, Overloaded
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.config import BUNDLED_MODEL, BUNDLED_PROFILE, SamplingParams
from dilaserve.control.build import ControlSpec
from dilaserve.control.decisions import InstanceSpec, Reconfiguration, RolloutStep
from dilaserve.engine.llm import LLM
from dilaserve.protocol import StepBatch
from dilaserve.sim.replay import replay
from dilaserve.tasks import arith

from conftest import HANG_GUARD_S, wait_until

WORKER = WorkerConfig(threads=1)
QUESTIONS = [p.question for p in arith.generate(10, seed=3, split="test")]


def config(**kw) -> ClusterConfig:
    kw.setdefault("worker", WORKER)
    kw.setdefault("tick", 0.2)
    kw.setdefault("start_timeout", HANG_GUARD_S)
    return ClusterConfig(**kw)


def submit_all(cluster, questions, gap=0.02, **kw):
    handles = []
    for q in questions:
        handles.append(cluster.submit(q, **kw))
        time.sleep(gap)
    return handles


def test_a_fixed_threshold_cluster_answers_as_the_offline_engine_does_and_streams_it():
    expected = [c.text for c in LLM().generate(QUESTIONS[:6], SamplingParams(0.9, 64))]

    async def stream_async(cluster, question):
        return [delta async for delta in cluster.submit(question)]

    with Cluster(config(control=ControlSpec(policy="fcfs"))) as cluster:
        handles = submit_all(cluster, QUESTIONS[:6])
        results = [h.result(HANG_GUARD_S) for h in handles]
        streamed = ["".join(h) for h in handles]
        deltas = asyncio.run(stream_async(cluster, QUESTIONS[0]))
    assert [r.text for r in results] == expected
    assert streamed == expected  # deltas are committed text only, in order
    assert "".join(deltas) == expected[0] and len(deltas) >= 2  # a block at a time, or finer
    assert all(r.num_steps >= 2 and r.mean_threshold == pytest.approx(0.9) for r in results)


def test_a_stop_string_ends_a_request_as_soon_as_it_is_committed():
    expected = LLM().generate(QUESTIONS[:1], SamplingParams(0.9, 64))[0]
    with Cluster(config(control=ControlSpec(policy="fcfs"))) as cluster:
        stopped = cluster.submit(QUESTIONS[0], stop=[" "])
        whole = cluster.submit(QUESTIONS[0])
        stopped, whole = stopped.result(HANG_GUARD_S), whole.result(HANG_GUARD_S)
    assert (stopped.text, stopped.finish_reason) == (expected.text.split(" ")[0], "stop")
    assert stopped.num_steps < whole.num_steps  # not worked on past the stop string
    assert (whole.text, whole.finish_reason) == (expected.text, "stop")


class OneAtATime(LocalBackend):
    """Every step of more than one request fails, as a batch too big for memory would."""

    def __init__(self, worker):
        super().__init__(worker)
        self.refused: list[WorkerEvent] = []

    def step(self, instance_id, batch):
        if len(batch.items) == 1:
            return super().step(instance_id, batch)
        self.refused.append(WorkerEvent("failed", instance_id, error="OutOfMemoryError"))

    def poll(self, timeout):
        refused, self.refused = self.refused, []
        return refused or super().poll(timeout)


def test_requests_of_a_failed_batch_retry_alone_and_finish():
    cfg = config(control=ControlSpec(policy="fcfs"), instances=(1,))
    with Cluster(cfg, backend=OneAtATime(WORKER)) as cluster:
        results = [h.result(HANG_GUARD_S) for h in submit_all(cluster, QUESTIONS[:4], gap=0.0)]
        failed_steps = cluster.controller.stats["failed_steps"]
    # each finishes its answer (one restarted mid-block recomputes what a cache step would
    # have approximated, so its words may differ from an uninterrupted run's)
    assert all("####" in r.text and r.finish_reason == "stop" for r in results)
    assert failed_steps >= 1  # they were batched, failed together, then ran alone


class HangsOnce(LocalBackend):
    """The first step sent is swallowed: its instance never answers, as a hung GPU would."""

    def __init__(self, worker):
        super().__init__(worker)
        self.swallowed = False

    def step(self, instance_id, batch):
        if self.swallowed:
            return super().step(instance_id, batch)
        self.swallowed = True


@pytest.mark.slow  # in part by test_admission_recovery.py's hung last instance (virtual clock)
def test_an_instance_whose_step_hangs_is_killed_and_its_request_served_elsewhere():
    expected = LLM().generate(QUESTIONS[:1], SamplingParams(0.9, 64))[0].text
    # two instances: the hung one is not the last serving, so it is killed at its step timeout
    # (the last one's longer grace is tests/test_admission_recovery.py's; a replacement's start,
    # tests/test_reliability_cluster.py's)
    cfg = config(
        control=ControlSpec(policy="fcfs"), instances=(1, 1), step_timeout=MIN_STEP_TIMEOUT
    )
    with Cluster(cfg, backend=HangsOnce(WORKER)) as cluster:
        result = cluster.submit(QUESTIONS[0]).result(HANG_GUARD_S)
        failures = cluster.controller.stats["failures"]
    assert result.text == expected  # nothing was committed before the hang: a clean restart
    assert failures == 1  # the hung instance was killed; the other served the request


def test_a_recorded_run_replays_in_the_simulator_to_the_same_decisions():
    cfg = config(record=True)
    with Cluster(cfg) as cluster:
        results = [h.result(HANG_GUARD_S) for h in submit_all(cluster, QUESTIONS, slo=2.0)]
        lines, recording = cluster.controller.log.lines, cluster.controller.recording
    assert len(results) == len(QUESTIONS)
    sim, sim_lines = replay(
        recording.requests,
        recording.launches,
        cfg.control,
        cfg.initial_specs(),
        cfg.tick,
        cfg.max_batch_tokens,
        unmeasured=recording.unmeasured,  # (steps a stall of the controller held up)
        voided=recording.voided,  # (requests a stall or a fault delayed)
    )
    assert len(sim.requests) == len(QUESTIONS) and not sim.unfinished
    # an arrival line per request, and step launches beyond them (how many depends on how the
    # requests batched, which the machine's speed decides: a busy machine batches more)
    assert len(lines) > len(QUESTIONS)
    assert sim_lines == lines


def test_pinned_thresholds_cancellation_and_admission_control():
    with Cluster(config(max_in_flight=3)) as cluster:
        pinned = cluster.submit(QUESTIONS[0], threshold=0.85)
        bounded = cluster.submit(QUESTIONS[1], min_threshold=0.6, max_threshold=0.7)
        cancelled = cluster.submit(QUESTIONS[2], max_tokens=256)
        with pytest.raises(Overloaded):
            cluster.submit(QUESTIONS[3])
        cluster.cancel(cancelled.request_id)
        with pytest.raises(concurrent.futures.CancelledError):
            cancelled.result(HANG_GUARD_S)
        assert pinned.result(HANG_GUARD_S).mean_threshold == pytest.approx(0.85)
        assert 0.6 <= bounded.result(HANG_GUARD_S).mean_threshold <= 0.7
        assert cluster.submit(QUESTIONS[3]).result(HANG_GUARD_S).num_steps > 0  # room again
        assert cluster.in_flight == 0


@pytest.mark.slow
def test_every_request_completes_when_a_worker_is_killed_mid_trace():
    with Cluster(config()) as cluster:
        handles = submit_all(cluster, QUESTIONS, gap=0.0)
        while not cluster.controller.step_times:
            time.sleep(0.005)
        cluster.backend.kill("i0")
        results = [h.result(HANG_GUARD_S) for h in handles]
        assert cluster.controller.stats["failures"] == 1
        wait_until(lambda: "i0.1" in cluster.scheduler.instances)  # the replacement loads
        assert set(cluster.scheduler.instances) == {"i1", "i0.1"}
    answers = [arith.extract_answer(r.text) for r in results]
    assert sum(a is not None for a in answers) >= len(QUESTIONS) - 1  # whole, sensible outputs


class _Once:
    """A planner stand-in: asks for one TP-2 instance in place of two TP-1s, once."""

    def __init__(self):
        self.asked = False

    def record(self, request, now):
        pass

    def on_tick(self, now, running):
        if self.asked or now < 0.3:
            return None
        self.asked = True
        start = InstanceSpec("tp2", 0, 2, (0, 1), 8192)
        return Reconfiguration((RolloutStep(("i0", "i1"), start),), (), {2: 1})


@pytest.mark.slow
def test_the_cluster_reconfigures_live_without_losing_requests(tmp_path):
    profile = json.loads(BUNDLED_PROFILE.read_text())
    tp2 = [{**e, "tp": 2, "ms": e["ms"] * 0.8} for e in profile["entries"]]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**profile, "entries": profile["entries"] + tp2}))
    with Cluster(config(control=ControlSpec(profile=str(path)))) as cluster:
        cluster.scheduler.reconfigurer = _Once()
        handles = submit_all(cluster, QUESTIONS + QUESTIONS, gap=0.1)
        results = [h.result(HANG_GUARD_S) for h in handles]
        assert cluster.controller.stats["reconfigurations"] == 1
        assert set(cluster.scheduler.instances) == {"tp2"}
        shapes = [counts for _, counts in cluster.controller.instance_log]
    assert shapes[-1] == {2: 1} and {1: 2} in shapes
    assert len(results) == 2 * len(QUESTIONS) and all(r.num_steps > 0 for r in results)


def run_alone(backend, instance_id, requests):
    """Step requests to completion on one instance; their output tokens."""
    on_instance, active = set(), list(requests)
    while active:
        items = tuple(r.step_item("dual", r.request_id in on_instance) for r in active)
        on_instance.update(r.request_id for r in active)
        backend.step(instance_id, StepBatch(items))
        event = wait_for(backend, "done")
        for r, result in zip(active, event.output.results):
            r.apply(result)
        active = [r for r in active if not r.is_finished]
    return [r.output_ids.tolist() for r in requests]


def wait_for(backend, kind, timeout=HANG_GUARD_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in backend.poll(0.5):
            assert event.kind == kind, event
            return event
    raise TimeoutError(kind)


@pytest.fixture(scope="module")
def local_backend():
    backend = LocalBackend(WORKER)
    yield backend
    backend.shutdown()


def pid_of(backend, instance_id):
    return backend._gangs[instance_id].processes[0].pid


def test_a_spare_rank_starts_once_all_are_up_and_is_the_next_started_when_ready():
    backend = LocalBackend(WORKER, spare=True)
    try:
        backend.start(InstanceSpec("a", 0, 1, (0,)))

        def up_after_a_poll() -> bool:
            if any(e.kind == "up" for e in backend.poll(0.2)):
                return True
            assert backend.spare_pid is None  # never beside a load
            return False

        wait_until(up_after_a_poll)
        spare = backend.spare_pid
        assert spare is not None and not backend.spare_ready  # importing (over a second)
        backend.start(InstanceSpec("b", 0, 1, (0,)))
        assert pid_of(backend, "b") != spare and backend.spare_pid == spare  # not taken yet
        assert wait_for(backend, "up").instance_id == "b"
        wait_until(lambda: backend.spare_ready)
        backend.start(InstanceSpec("c", 0, 1, (0,)))
        assert pid_of(backend, "c") == spare and backend.spare_pid is None
        assert wait_for(backend, "up").instance_id == "c"
        assert backend.spare_pid not in (None, spare)  # the next one
        assert os.getpriority(os.PRIO_PROCESS, pid_of(backend, "c")) == 0  # (imports at 19)
        waiting = backend._spare.process
    finally:
        backend.shutdown()
    assert waiting.poll() is not None and backend.spare_pid is None


def test_a_spare_that_died_is_passed_over_and_not_replaced():
    backend = LocalBackend(WORKER, spare=True)
    try:
        backend.start(InstanceSpec("a", 0, 1, (0,)))
        wait_for(backend, "up")
        dead = backend._spare.process
        dead.kill()
        dead.wait()
        backend.start(InstanceSpec("b", 0, 1, (0,)))
        assert pid_of(backend, "b") != dead.pid
        assert wait_for(backend, "up").instance_id == "b"
        assert backend.spare_pid == dead.pid and not backend.spare_ready
    finally:
        backend.shutdown()


def test_tensor_parallel_two_ranks_commit_the_same_tokens_as_one(local_backend):
    llm = LLM(BUNDLED_MODEL)
    outputs = {}
    for tp in (1, 2):
        iid = f"tp{tp}"
        local_backend.start(InstanceSpec(iid, 0, tp, tuple(range(tp))))
        wait_for(local_backend, "up")
        requests = llm.make_requests(QUESTIONS[:4], SamplingParams(0.7, 64))
        outputs[tp] = run_alone(local_backend, iid, requests)
        local_backend.stop(iid)
    assert outputs[2] == outputs[1]


def test_a_bad_batch_fails_alone_and_the_instance_serves_on(local_backend):
    local_backend.start(InstanceSpec("solo", 0, 1, (0,)))
    wait_for(local_backend, "up")
    requests = LLM(BUNDLED_MODEL).make_requests(QUESTIONS[:1], SamplingParams(0.9, 32))
    bad = requests[0].step_item("dual", False)
    local_backend.step("solo", StepBatch((bad, bad)))  # the same request twice
    assert "twice" in wait_for(local_backend, "failed").error
    run_alone(local_backend, "solo", requests)
    assert requests[0].is_finished and requests[0].num_steps >= 1
    local_backend.stop("solo")


def test_submit_rejects_bad_requests_naming_what_is_wrong():
    with pytest.raises(ValueError, match="tensor-parallel size 3 does not divide"):
        Cluster(config(instances=(1, 3)))  # refused before any worker starts
    cluster = Cluster(config())
    with pytest.raises(ValueError, match="context of 512 tokens"):
        cluster.submit("x " * 600)
    with pytest.raises(ValueError, match="max_tokens"):
        cluster.submit("hi", max_tokens=0)
    with pytest.raises(ValueError, match="slo"):
        cluster.submit("hi", slo=-1.0)
    with pytest.raises(ValueError, match="min_threshold"):
        cluster.submit("hi", min_threshold=0.9, max_threshold=0.5)
    with pytest.raises(ValueError, match="threshold=1.5"):
        cluster.submit("hi", threshold=1.5)
    with pytest.raises(Closed):
        cluster.submit("hi")  # valid, but the cluster has not started
    with pytest.raises(ValueError, match="policy"):
        ControlSpec(policy="nope")
    cluster.backend.shutdown()
