"""Instances as Ray actors: the same `Backend` as `LocalBackend`, on one machine or a cluster.

Every rank of an instance is an actor holding an `InstanceWorker`. A gang of d ranks reserves d
bundles (a GPU each when the engine runs on cuda) in one STRICT_PACK placement group, so Ray keeps
it on one node: its ranks all-reduce inside every layer, and the planner sizes gangs by the GPUs
of one node. Ray, not the planner, picks the node and the GPUs (it sets each actor's
CUDA_VISIBLE_DEVICES), so `spec.node` and `spec.gpus` are not used here. A gang whose resources no
node has stays loading: Ray waits for them.

Nothing blocks, as in `LocalBackend`: `start`, `step` and `release` submit actor calls and return,
and `poll` turns the calls that finished into events. Every call goes to every rank, since the
row-parallel all-reduces need them all, and each rank's reply is watched, because a rank waiting
in an all-reduce on a dead peer never answers; only rank 0 returns an output. A sequential actor
runs its calls in submission order, so replies are read in that order too.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

try:
    import ray
    from ray.exceptions import RayError, RayTaskError
    from ray.util.placement_group import (
        PlacementGroup,
        placement_group,
        remove_placement_group,
    )
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:  # an optional dependency
    raise ImportError("the Ray backend needs ray: pip install 'dilaserve[ray]'") from e

from dilaserve.cluster.backends import WorkerEvent
from dilaserve.cluster.worker import InstanceWorker, WorkerConfig, new_rendezvous
from dilaserve.control.decisions import InstanceSpec
from dilaserve.protocol import StepBatch, StepOutput

log = logging.getLogger("dilaserve.cluster")

# ray.wait cannot also wait on a threading.Event, so poll waits in slices this long and checks
# for a wake between them.
WAIT_SLICE = 0.01
# An idle instance has no call in flight to fail if its actors die; poll pings its ranks once
# this many seconds have passed without a reply, so that a death is still seen.
HEARTBEAT = 1.0
# Without an address, the Ray started here runs on this machine alone and listens on the
# loopback interface only (`start_local_ray`): an open Ray head runs code for anyone who reaches
# it. Ray's servers bind its node address, which Ray 2.60 turns from 127.0.0.1 into the
# machine's outward address unless multi-node clusters are off (this setting, read by Ray when
# it is imported and by every Ray process it starts).
LOCAL_ONLY = "127.0.0.1"
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class _Rank:
    """One rank: loads its shard when told (so that a loading error is a reply, not a dead
    actor) and runs the steps it is sent."""

    def __init__(self, rank: int):
        self.rank = rank
        self.worker: InstanceWorker | None = None

    def rendezvous(self) -> str:
        """Rank 0: the file on its node where the gang's process group meets (a gang's ranks
        share a node: see the placement group)."""
        return new_rendezvous()

    def load(self, config: WorkerConfig, size: int, rendezvous: str) -> None:
        self.worker = InstanceWorker(config, self.rank, size, rendezvous)

    def step(self, batch: StepBatch) -> tuple[StepOutput, float] | None:
        """Rank 0 answers; every other rank computed the same output (or error), kept here."""
        try:
            output = self.worker.step(batch)
        except Exception:
            if self.rank == 0:
                raise
            return None
        return output if self.rank == 0 else None

    def release(self, request_ids: list[str]) -> None:
        self.worker.release(request_ids)

    def ping(self) -> bool:
        """Answers while the actor lives (an idle instance's liveness check)."""
        return True


_RankActor = ray.remote(_Rank)


@dataclass
class _Gang:
    group: PlacementGroup
    actors: list  # one per rank
    calls: deque = field(default_factory=deque)  # (kind, a ref per rank), oldest first
    heard: float = field(default_factory=time.monotonic)  # when every rank last replied


class RayBackend:
    """Each rank of each instance is a Ray actor; a gang shares one placement group."""

    def __init__(
        self, worker: WorkerConfig, address: str | None = None, cpus_per_rank: float = 1.0
    ):
        if cpus_per_rank <= 0:
            raise ValueError(f"{cpus_per_rank=} must be positive")
        self.worker = worker
        self.cpus_per_rank = cpus_per_rank
        self._gpus = 1 if worker.engine.device.startswith("cuda") else 0
        self._gangs: dict[str, _Gang] = {}
        self._woken = threading.Event()
        self._owns_ray = not ray.is_initialized()
        address = address or os.environ.get("RAY_ADDRESS")
        if self._owns_ray and address:
            keep_token_private(create=False)
            ray.init(address=address)
        elif self._owns_ray:
            start_local_ray()

    def start(self, spec: InstanceSpec) -> None:
        if spec.instance_id in self._gangs:
            raise ValueError(f"instance {spec.instance_id} is already running")
        bundle = {"CPU": self.cpus_per_rank} | ({"GPU": self._gpus} if self._gpus else {})
        group = placement_group([bundle] * spec.tp, strategy="STRICT_PACK")
        actors = [
            _RankActor.options(
                num_cpus=self.cpus_per_rank,
                num_gpus=self._gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                ),
            ).remote(rank)
            for rank in range(spec.tp)
        ]
        # Ray resolves the rendezvous before running the other ranks' loads: nothing waits here.
        meet = actors[0].rendezvous.remote() if spec.tp > 1 else ""
        gang = _Gang(group, actors)
        gang.calls.append(("load", [a.load.remote(self.worker, spec.tp, meet) for a in actors]))
        self._gangs[spec.instance_id] = gang

    def step(self, instance_id: str, batch: StepBatch) -> None:
        gang = self._gangs.get(instance_id)
        if gang is not None:  # else it is gone, and poll has said so
            gang.calls.append(("step", [a.step.remote(batch) for a in gang.actors]))

    def release(self, instance_id: str, request_ids: list[str]) -> None:
        gang = self._gangs.get(instance_id)
        if gang is not None:
            for actor in gang.actors:
                actor.release.remote(list(request_ids))

    def stop(self, instance_id: str) -> None:
        gang = self._gangs.pop(instance_id, None)
        if gang is not None:
            _tear_down(gang)

    def kill(self, instance_id: str) -> None:
        """Kill the actors and leave the rest to `poll`, as if they had crashed."""
        gang = self._gangs[instance_id]
        for actor in gang.actors:
            ray.kill(actor, no_restart=True)
        gang.heard = float("-inf")  # the next poll pings an idle gang at once

    def wake(self) -> None:
        self._woken.set()

    def poll(self, timeout: float) -> list[WorkerEvent]:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            self._ping_idle()
            refs = [ref for gang in self._gangs.values() for _, rs in gang.calls for ref in rs]
            left = max(deadline - time.monotonic(), 0.0)
            if refs:
                if ray.wait(refs, num_returns=1, timeout=min(left, WAIT_SLICE))[0]:
                    break
            elif self._woken.wait(min(left, HEARTBEAT)):
                break
            if self._woken.is_set() or left == 0.0:
                break
        self._woken.clear()
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        events = []
        for instance_id, gang in list(self._gangs.items()):
            events += self._collect(instance_id, gang, ready)
        return events

    def _ping_idle(self) -> None:
        now = time.monotonic()
        for gang in self._gangs.values():
            if not gang.calls and now - gang.heard > HEARTBEAT:
                gang.calls.append(("ping", [a.ping.remote() for a in gang.actors]))

    def _collect(self, instance_id: str, gang: _Gang, ready: set) -> list[WorkerEvent]:
        """Events for the gang's finished calls, in order, then "died" if any rank is gone (even
        behind a call still running: its other ranks may be stuck waiting for that one)."""
        replies = {ref: _reply(ref) for _, refs in gang.calls for ref in refs if ref in ready}
        events = []
        while gang.calls:
            kind, refs = gang.calls[0]
            got = [replies[ref] for ref in refs if ref in replies]
            errors = [e for _, e in got if e is not None]
            if any(map(_is_death, errors)):
                break
            if kind == "load" and errors:  # don't wait for the others: they may wait tp_timeout
                events.append(WorkerEvent("failed", instance_id, error=_describe(errors[0])))
                return events + [self._bury(instance_id, "loading failed")]
            if len(got) < len(refs):
                break
            gang.calls.popleft()
            gang.heard = time.monotonic()
            if kind == "load":
                events.append(WorkerEvent("up", instance_id))
            elif kind == "step" and errors:  # only rank 0 raises
                events.append(WorkerEvent("failed", instance_id, error=_describe(errors[0])))
            elif kind == "step":
                output, seconds = got[0][0]
                events.append(WorkerEvent("done", instance_id, output, seconds))
        deaths = [e for _, e in replies.values() if e is not None and _is_death(e)]
        if deaths:
            events.append(self._bury(instance_id, _describe(deaths[0])))
        return events

    def _bury(self, instance_id: str, reason: str) -> WorkerEvent:
        """A rank is gone: the rest of its gang cannot go on (their collectives would hang)."""
        _tear_down(self._gangs.pop(instance_id))
        return WorkerEvent("died", instance_id, error=reason)

    def shutdown(self) -> None:
        for instance_id in list(self._gangs):
            self.stop(instance_id)
        if self._owns_ray:
            ray.shutdown()


def start_local_ray(**options) -> None:
    """A Ray of our own on this machine (`options` go to `ray.init` too), reachable from it only:
    node address 127.0.0.1, every server on the loopback interface, no dashboard, and Ray's
    token authentication (unless RAY_AUTH_MODE=disabled) with a token file only this user can
    read. Raises, with Ray shut down again, if Ray put its node anywhere else."""
    from ray._private import ray_constants

    keep_token_private(create=True)
    multi_node, saved = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(SINGLE_NODE_ENV)
    ray_constants.ENABLE_RAY_CLUSTER, os.environ[SINGLE_NODE_ENV] = False, "0"
    try:  # (the processes Ray starts now keep the setting)
        ray.init(address="local", include_dashboard=False, _node_ip_address=LOCAL_ONLY, **options)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = multi_node
        if saved is None:
            del os.environ[SINGLE_NODE_ENV]
        else:
            os.environ[SINGLE_NODE_ENV] = saved
    node = ray.util.get_node_ip_address()
    if node != LOCAL_ONLY:
        ray.shutdown()
        raise RuntimeError(
            f"Ray {ray.__version__} put its node on {node}, not {LOCAL_ONLY}: its servers "
            "would listen on the network (docs/cluster-ray.md, Security); give --ray-address "
            "of a cluster on a private network instead"
        )


def keep_token_private(create: bool) -> None:
    """Ray's token file readable by this user only: Ray 2.60 writes `~/.ray/auth_token` with the
    umask's mode (0644: every local user could read it and drive the cluster), so a new local
    Ray gets one made here first, mode 0600, which Ray then reads; an existing one readable by
    others is narrowed to 0600. Nothing is made where token authentication is off
    (RAY_AUTH_MODE=disabled) or the token comes from elsewhere (RAY_AUTH_TOKEN, _PATH)."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    path = Path.home() / ".ray" / "auth_token"
    if path.exists():
        if path.stat().st_mode & 0o077:
            log.warning("%s was readable by other users; it is now 0600", path)
            path.chmod(0o600)
        return
    if create and os.environ.get("RAY_AUTH_MODE", "token").lower() == "token":
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))  # what Ray's own generator writes: 256 random bits


def _tear_down(gang: _Gang) -> None:
    for actor in gang.actors:
        ray.kill(actor, no_restart=True)
    remove_placement_group(gang.group)


def _reply(ref) -> tuple[object, RayError | None]:
    """A finished call's (value, None), or (None, the error it ended with)."""
    try:
        return ray.get(ref), None
    except RayError as e:
        return None, e


def _is_death(error: RayError) -> bool:
    """A task error is the engine's exception; every other Ray error means a rank is gone
    (its actor, worker process or node died)."""
    return not isinstance(error, RayTaskError)


def _describe(error: RayError) -> str:
    """The error's type and first line (a task error: the engine's own exception's)."""
    cause = error.cause if isinstance(error, RayTaskError) else error
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"
