"""Where instances run: worker processes on this machine (`local`) or Ray actors (`ray`).

A backend starts and stops instances and carries step commands to them; what comes back is a
stream of `WorkerEvent`s that the controller reads with `poll`. It never blocks on one instance:
commands are sent without waiting, and `poll` returns whatever any instance has finished.

- "up": the instance has loaded its model and takes work;
- "done": a step finished (`output`, and `seconds` the engine took, measured in the worker);
- "failed": a step raised (its requests retry alone, and one that fails alone fails; the
  instance lives on), or loading failed;
- "died": the instance's process is gone (killed, crashed, out of memory).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Protocol

from dilaserve.cluster.worker import WorkerConfig, new_rendezvous
from dilaserve.control.decisions import InstanceSpec
from dilaserve.protocol import StepBatch, StepOutput

LOADING_NOTE_SECONDS = 15.0  # while instances load, a line this often


@dataclass(frozen=True)
class WorkerEvent:
    kind: str  # "up" | "done" | "failed" | "died"
    instance_id: str
    output: StepOutput | None = None
    seconds: float = 0.0
    error: str = ""


class Backend(Protocol):
    def start(self, spec: InstanceSpec) -> None:
        """Begin loading an instance; an "up" (or "failed"/"died") event follows."""
        ...

    def step(self, instance_id: str, batch: StepBatch) -> None:
        """Send a step without waiting; a "done" (or "failed"/"died") event follows."""
        ...

    def release(self, instance_id: str, request_ids: list[str]) -> None: ...

    def stop(self, instance_id: str) -> None:
        """Shut an instance down (no event follows)."""
        ...

    def kill(self, instance_id: str) -> None:
        """Kill an instance's processes abruptly, as a crash would (fault tests)."""
        ...

    def poll(self, timeout: float) -> list[WorkerEvent]:
        """Events that are ready, waiting at most `timeout` seconds for the first."""
        ...

    def wake(self) -> None:
        """Make a `poll` in progress return now (thread-safe)."""
        ...

    def shutdown(self) -> None: ...


def start_all(
    backend: Backend,
    specs: list[InstanceSpec],
    timeout: float,
    report: Callable[[str], None] | None = None,
) -> None:
    """Start instances and wait until every one is up; if one fails or `timeout` seconds pass,
    shut the backend down and raise. `report` is told each instance that comes up, and every
    `LOADING_NOTE_SECONDS` while none does."""
    report = report or (lambda _: None)
    for spec in specs:
        backend.start(spec)
    waiting = {s.instance_id for s in specs}
    start = time.monotonic()
    deadline, note = start + timeout, start + LOADING_NOTE_SECONDS
    while waiting:
        now = time.monotonic()
        if now > deadline:
            backend.shutdown()
            raise TimeoutError(f"instances {sorted(waiting)} did not load in time")
        if now > note:
            report(f"still loading {', '.join(sorted(waiting))} ({now - start:.0f} s)")
            note = now + LOADING_NOTE_SECONDS
        for event in backend.poll(0.5):
            if event.kind != "up":
                backend.shutdown()
                raise RuntimeError(f"instance {event.instance_id} failed: {event.error}")
            waiting.discard(event.instance_id)
            done = len(specs) - len(waiting)
            elapsed = time.monotonic() - start
            report(f"instance {event.instance_id} up ({done}/{len(specs)}, {elapsed:.0f} s)")


@dataclass
class _Gang:
    processes: list[subprocess.Popen]
    conns: list  # controller ends of each rank's socket; rank 0 answers
    rendezvous: str = ""  # the file its ranks met in (TP > 1)
    dead: bool = False
    up: bool = False  # rank 0 said it has loaded


@dataclass
class _Spare:
    process: subprocess.Popen
    conn: Connection  # the controller's end of its socket
    ready: bool = False  # it said "ready": its imports are done


def _new_rank(spare: bool) -> tuple[subprocess.Popen, Connection]:
    """A rank process (`python -m dilaserve.cluster.worker FD [--spare]`) waiting for its
    orders, and the controller's end of its socket."""
    ours, theirs = Pipe()
    fd = theirs.fileno()
    command = [sys.executable, "-m", "dilaserve.cluster.worker", str(fd)]
    command += ["--spare"] if spare else []
    try:
        return subprocess.Popen(command, pass_fds=(fd,)), ours
    except OSError:
        ours.close()
        raise
    finally:
        theirs.close()


def _close_gang(gang: _Gang, kill: bool) -> list[int]:
    """Kill (if asked) and reap a gang's processes, close its sockets, remove its rendezvous
    folder; the processes' exit codes."""
    codes = []
    for p in gang.processes:
        if kill and p.poll() is None:
            p.kill()
        codes.append(p.wait())
    for conn in gang.conns:
        conn.close()
    if gang.rendezvous:
        shutil.rmtree(os.path.dirname(gang.rendezvous), ignore_errors=True)
    return codes


class LocalBackend:
    """Each rank of each instance is a process on this machine, fed through a socket pair.

    A process that dies closes its socket, which `poll` sees as end-of-file.

    With `spare`, once every instance is up one more rank process imports torch and the engine
    at the lowest CPU priority (`worker.preload_quietly`) and waits, and the next rank started (a
    replacement after a fault, a new instance of a reconfiguration) is that one if it is ready:
    it has only its model left to load, about 0.5 of 1.9 CPU-seconds on the bundled model, while
    the instances left serve beside it.
    """

    def __init__(self, worker: WorkerConfig, spare: bool = False):
        self.worker = worker
        self.spare = spare
        self._spare: _Spare | None = None
        self._gangs: dict[str, _Gang] = {}
        self._wake_r, self._wake_w = Pipe(duplex=False)
        self._wake_lock = threading.Lock()

    def start(self, spec: InstanceSpec) -> None:
        if spec.instance_id in self._gangs:
            raise ValueError(f"instance {spec.instance_id} is already running")
        rendezvous = new_rendezvous() if spec.tp > 1 else ""
        gang = _Gang([], [], rendezvous)
        self._gangs[spec.instance_id] = gang  # (a rank that fails to spawn: the rest are buried)
        try:
            for rank in range(spec.tp):
                gang.conns.append(self._spawn(gang, rank, spec, rendezvous))
        except OSError:  # no file descriptors or memory left to spawn one
            del self._gangs[spec.instance_id]
            _close_gang(gang, kill=True)
            raise

    def _spawn(self, gang: _Gang, rank: int, spec: InstanceSpec, rendezvous: str):
        """One rank's process (the spare if one waits), told what to load; the controller's end
        of its socket."""
        process, ours = self._take_spare() or _new_rank(spare=False)
        gang.processes.append(process)
        ours.send(("init", self.worker, rank, spec.tp, rendezvous, spec.gpus))
        return ours

    @property
    def spare_pid(self) -> int | None:
        """The spare's process id, if one is importing or waiting."""
        return self._spare.process.pid if self._spare is not None else None

    @property
    def spare_ready(self) -> bool:
        """Has the spare done its imports? It says "ready" once, then waits for orders: this
        reads that word when it has come (the controller's thread, as every other read)."""
        spare = self._spare
        if spare is not None and not spare.ready and spare.conn.poll():
            try:
                spare.ready = spare.conn.recv() == ("ready",)
            except (EOFError, OSError):  # it died: never ready
                pass
        return spare is not None and spare.ready and spare.process.poll() is None

    def _take_spare(self) -> tuple[subprocess.Popen, Connection] | None:
        """The spare, if it is ready; one still importing is left to finish (a rank started
        now from nothing loads sooner than one importing at the lowest priority)."""
        if not self.spare_ready:
            return None
        spare, self._spare = self._spare, None
        return spare.process, spare.conn

    def _keep_spare(self) -> None:
        """Start a spare once every instance is up, if none is there. One that dies is not
        replaced (no loop of failing starts): the ranks started after it start from nothing."""
        if not self.spare or self._spare is not None:
            return
        if not all(gang.up for gang in self._gangs.values()):
            return
        try:
            self._spare = _Spare(*_new_rank(spare=True))
        except OSError:  # no file descriptors or memory left: the next start spawns its own
            self.spare = False

    def _close_spare(self) -> None:
        if self._spare is not None:
            spare, self._spare = self._spare, None
            spare.conn.close()  # it sees end-of-file where its orders would come, and exits
            spare.process.kill()
            spare.process.wait()

    def step(self, instance_id: str, batch: StepBatch) -> None:
        self._send(instance_id, ("step", batch))

    def release(self, instance_id: str, request_ids: list[str]) -> None:
        self._send(instance_id, ("release", list(request_ids)))

    def _send(self, instance_id: str, command) -> None:
        gang = self._gangs.get(instance_id)
        if gang is None or gang.dead:
            return  # its death is (or will be) reported by poll
        for conn in gang.conns:
            try:
                conn.send(command)
            except (BrokenPipeError, OSError):
                gang.dead = True  # poll reports it

    def stop(self, instance_id: str, timeout: float = 10.0) -> None:
        gang = self._gangs.pop(instance_id, None)
        if gang is None:
            return
        for conn in gang.conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for p in gang.processes:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
        _close_gang(gang, kill=True)

    def kill(self, instance_id: str) -> None:
        gang = self._gangs.get(instance_id)
        for p in gang.processes if gang is not None else ():
            p.kill()

    def wake(self) -> None:
        with self._wake_lock:
            self._wake_w.send_bytes(b"w")

    def poll(self, timeout: float) -> list[WorkerEvent]:
        waitables = [self._wake_r]
        for gang in self._gangs.values():
            waitables += gang.conns
        ready = set(wait(waitables, max(timeout, 0.0)))
        while self._wake_r in ready and self._wake_r.poll():
            self._wake_r.recv_bytes()
        events = []
        for instance_id, gang in list(self._gangs.items()):
            events += self._read(instance_id, gang)
            if gang.dead or any(p.poll() is not None for p in gang.processes):
                events.append(self._bury(instance_id, gang))
        self._keep_spare()
        return events

    def _read(self, instance_id: str, gang: _Gang) -> list[WorkerEvent]:
        """Rank 0's answers; end-of-file on any rank's socket means that rank is gone."""
        events = []
        try:
            for conn in gang.conns[1:]:
                if conn.poll():
                    conn.recv()  # ranks > 0 never write: this raises EOFError
            while gang.conns[0].poll():
                message = gang.conns[0].recv()
                if message[0] == "up":
                    gang.up = True
                    events.append(WorkerEvent("up", instance_id))
                elif message[0] == "done":
                    events.append(WorkerEvent("done", instance_id, message[1], message[2]))
                else:
                    events.append(WorkerEvent("failed", instance_id, error=message[1]))
        except (EOFError, OSError):
            gang.dead = True
        return events

    def _bury(self, instance_id: str, gang: _Gang) -> WorkerEvent:
        """A rank is gone: the rest of its gang cannot go on (their collectives would hang)."""
        del self._gangs[instance_id]
        codes = _close_gang(gang, kill=True)
        return WorkerEvent("died", instance_id, error=f"worker processes exited with {codes}")

    def shutdown(self) -> None:
        self._close_spare()
        for instance_id in list(self._gangs):
            self.stop(instance_id)
