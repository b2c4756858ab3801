"""The Ray backend on a local, offline Ray cluster on the loopback interface only.

One cluster and one backend serve the whole file; its instances load in parallel once (loading
starts a Python process per rank, the slow part): `solo` (TP 1), `pair` (TP 2, gloo) and
`victim` (TP 1, killed by one test). Two more CPUs are left: for an instance that fails to
load, and for a whole cluster.
"""

import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dilaserve.cluster.worker import WorkerConfig
from dilaserve.config import BUNDLED_MODEL, EngineConfig
from dilaserve.control.decisions import InstanceSpec
from dilaserve.engine.engine import Engine
from dilaserve.models.tokenizer import Tokenizer
from dilaserve.protocol import StepBatch
from dilaserve.request import Request
from dilaserve.tasks import arith

# Read when ray is imported: no `uv run` runtime env, no usage stats, no token file written.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from dilaserve.cluster.ray_backend import RayBackend, keep_token_private, start_local_ray  # noqa: E402

from conftest import HANG_GUARD_S, LOOPBACK, listening_addresses  # noqa: E402

CONFIG = EngineConfig()  # dual cache, 32-token blocks
GEN_LEN = 64
INSTANCES = {"solo": 1, "pair": 2, "victim": 1}  # instance id -> TP degree


@pytest.fixture(scope="module")
def backend():
    start_local_ray(  # what RayBackend starts without an address
        num_cpus=sum(INSTANCES.values()) + 2,  # + a failing load, + a whole cluster
        log_to_driver=False,
        configure_logging=False,
    )
    backend = RayBackend(WorkerConfig(engine=CONFIG, threads=1))
    try:
        for instance_id, tp in INSTANCES.items():
            backend.start(InstanceSpec(instance_id, node=0, tp=tp, gpus=tuple(range(tp))))
        up = [e.instance_id for e in events(backend, set(INSTANCES))]
        assert sorted(up) == sorted(INSTANCES)
        yield backend
    finally:
        backend.shutdown()
        ray.shutdown()


def events(backend, instance_ids: set[str], kind: str = "up") -> list:
    """Poll until each instance has sent one event; all must be of `kind`."""
    got, deadline = [], time.monotonic() + HANG_GUARD_S
    while len(got) < len(instance_ids):
        assert time.monotonic() < deadline, f"timed out; got {got}"
        got += backend.poll(1.0)
    assert sorted(e.instance_id for e in got) == sorted(instance_ids), got
    assert all(e.kind == kind for e in got), got
    return got


def make_requests(prefix: str, n: int, seed: int) -> list[Request]:
    tokenizer = Tokenizer(Path(BUNDLED_MODEL))
    mask = tokenizer.special.mask
    return [
        Request(
            f"{prefix}{i}",
            tuple(tokenizer.encode_chat(p.question)),
            GEN_LEN,
            CONFIG.block_len,
            mask,
            threshold=0.9,
        )
        for i, p in enumerate(arith.generate(n, seed=seed))
    ]


def drive(backend, work: dict[str, list[Request]], max_steps: int = 200) -> dict[str, list]:
    """Step each instance's requests (all instances at once) for `max_steps` steps or until
    they finish; each instance's step outputs."""
    on_instance = {instance_id: set() for instance_id in work}
    outputs = {instance_id: [] for instance_id in work}
    for _ in range(max_steps):
        active = {i: [r for r in rs if not r.is_finished] for i, rs in work.items()}
        active = {i: rs for i, rs in active.items() if rs}
        if not active:
            break
        for instance_id, requests in active.items():
            sent = on_instance[instance_id]
            items = [r.step_item(CONFIG.kv_cache, r.request_id in sent) for r in requests]
            sent.update(r.request_id for r in requests)
            backend.step(instance_id, StepBatch(tuple(items)))
        for event in events(backend, set(active), kind="done"):
            assert event.seconds > 0
            for request, result in zip(active[event.instance_id], event.output.results):
                request.apply(result)
            outputs[event.instance_id].append(event.output)
    return outputs


@pytest.mark.slow
def test_steps_match_an_in_process_engine(backend):
    remote, local = make_requests("eq", 3, seed=3), make_requests("eq", 3, seed=3)
    outputs = drive(backend, {"solo": remote}, max_steps=4)["solo"]
    engine = Engine.from_checkpoint(BUNDLED_MODEL, CONFIG)
    assert len(outputs) == 4
    for output in outputs:
        local = [r for r in local if not r.is_finished]  # as `drive` does
        items = [r.step_item(CONFIG.kv_cache, engine.has_request(r.request_id)) for r in local]
        expected = engine.execute(StepBatch(tuple(items)))
        assert output.num_tokens == expected.num_tokens
        for got, want in zip(output.results, expected.results, strict=True):
            assert (got.request_id, got.kind, got.block_index) == (
                want.request_id,
                want.kind,
                want.block_index,
            )
            np.testing.assert_array_equal(got.positions, want.positions)
            np.testing.assert_array_equal(got.tokens, want.tokens)
            np.testing.assert_allclose(got.confidences, want.confidences, rtol=0, atol=1e-6)
        for request, result in zip(local, expected.results):
            request.apply(result)
    assert sum(len(r.positions) for o in outputs for r in o.results) > 0
    backend.release("solo", [r.request_id for r in remote])


@pytest.mark.slow
def test_tensor_parallel_pair_commits_what_a_single_rank_does(backend):
    single, pair = make_requests("tp", 3, seed=5), make_requests("tp", 3, seed=5)
    drive(backend, {"solo": single, "pair": pair})
    assert all(r.is_finished for r in single + pair)
    assert all(r.num_committed > 0 for r in pair)
    for a, b in zip(single, pair):
        np.testing.assert_array_equal(a.output_ids, b.output_ids)
        assert a.num_steps == b.num_steps


@pytest.mark.slow
def test_a_bad_step_fails_and_the_instance_serves_on(backend):
    (request,) = make_requests("bad", 1, seed=7)
    item = request.step_item(CONFIG.kv_cache, on_instance=False)
    backend.step("solo", StepBatch((replace(item, threshold=1.5),)))
    (failed,) = events(backend, {"solo"}, kind="failed")
    assert failed.error.startswith("ValueError") and "threshold=1.5" in failed.error

    backend.step("solo", StepBatch((replace(item, spec=None),)))  # never sent its sequence
    (failed,) = events(backend, {"solo"}, kind="failed")
    assert failed.error.startswith("KeyError") and "bad0" in failed.error

    backend.step("solo", StepBatch((item,)))
    (done,) = events(backend, {"solo"}, kind="done")
    assert [r.request_id for r in done.output.results] == ["bad0"]
    backend.release("solo", ["bad0"])


@pytest.mark.slow
def test_killing_an_instance_reports_it_died_once(backend):
    backend.kill("victim")
    (died,) = events(backend, {"victim"}, kind="died")
    assert "ActorDiedError" in died.error
    backend.step("victim", StepBatch(()))  # it is gone: ignored, nothing more is reported
    assert backend.poll(0.2) == []


@pytest.mark.slow
def test_an_instance_that_cannot_load_fails_then_dies(backend, tmp_path):
    broken = RayBackend(WorkerConfig(model=str(tmp_path / "missing"), threads=1))
    broken.start(InstanceSpec("broken", node=0, tp=1, gpus=(0,)))
    got, deadline = [], time.monotonic() + HANG_GUARD_S
    while len(got) < 2 and time.monotonic() < deadline:
        got += broken.poll(1.0)
    assert [e.kind for e in got] == ["failed", "died"]
    assert "missing" in got[0].error
    assert broken.poll(0.1) == []
    broken.shutdown()  # leaves the cluster it did not start running
    assert ray.is_initialized()


@pytest.mark.slow
def test_wake_ends_a_poll_early(backend):
    threading.Timer(0.2, backend.wake).start()
    start = time.monotonic()
    assert backend.poll(HANG_GUARD_S) == []
    assert time.monotonic() - start < HANG_GUARD_S  # it ended before its timeout


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="reads Linux /proc")
def test_the_local_ray_is_reachable_from_this_machine_only(backend):
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    ray_processes = descendants(os.getpid())  # the GCS server, the raylet, its workers
    assert len(ray_processes) >= 3
    for pid in [os.getpid(), *ray_processes]:
        try:
            assert listening_addresses(pid) <= LOOPBACK, Path(f"/proc/{pid}/cmdline").read_text()
        except FileNotFoundError:
            pass  # (a worker that exited meanwhile)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            pass  # (gone meanwhile)
    found, todo = [], [pid]
    while todo:
        above = todo.pop()
        children = [p for p, parent in parents.items() if parent == above]
        found += children
        todo += children
    return found


def test_ray_token_file_is_made_and_kept_private(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    token = tmp_path / ".ray" / "auth_token"
    keep_token_private(create=False)  # joining a cluster: its token comes from elsewhere
    assert not token.exists()
    keep_token_private(create=True)  # a local Ray: made before Ray would write one 0644
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    token.chmod(0o644)  # as Ray 2.60 writes it
    keep_token_private(create=False)
    assert token.stat().st_mode & 0o777 == 0o600
    token.unlink()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    keep_token_private(create=True)
    assert not token.exists()


@pytest.mark.slow
def test_a_cluster_serves_through_ray_actors(backend):
    from dilaserve.cluster.runtime import Cluster, ClusterConfig

    questions = [p.question for p in arith.generate(4, seed=5, split="test")]
    config = ClusterConfig(WorkerConfig(engine=CONFIG, threads=1), instances=(1,), backend="ray")
    with Cluster(config) as cluster:
        results = [h.result(HANG_GUARD_S) for h in [cluster.submit(q) for q in questions]]
    assert all(r.num_steps >= 2 and r.text for r in results)
    assert ray.is_initialized()  # the cluster's backend did not own (or stop) Ray
