"""The model side of an instance: one rank of a tensor-parallel gang, holding the engine.

An instance of TP degree d is d ranks. Each rank loads its shard of every column- and
row-parallel layer (`models.layers`), joins a `torch.distributed` group with the others (gloo on
CPU, NCCL on GPU) and runs every step the controller sends; the all-reduces inside the row-
parallel layers keep the ranks in lock step, so every rank computes the same `StepOutput` and
only rank 0 answers. Requests' tokens and K/V caches live here, in the engine; the controller
sends a request's sequence once (`SequenceSpec`), then only what changes (`StepItem`).

A local worker is a `python -m dilaserve.cluster.worker FD` process (so that nothing of the
caller's main module is re-imported) talking over the socket it inherits as FD (`serve_pipe`);
the Ray backend calls `InstanceWorker`'s methods from an actor.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from dilaserve.config import BUNDLED_MODEL, EngineConfig
from dilaserve.protocol import Executor, StepBatch, StepOutput

WORKER_NICE = 0  # ranks' default niceness: the server's (docs/cluster.md, Worker priority)
MAX_NICE = 19  # the lowest CPU priority on Linux


@dataclass(frozen=True)
class WorkerConfig:
    """What every instance loads: the checkpoint, the engine settings, CPU threads per rank."""

    model: str = str(BUNDLED_MODEL)
    engine: EngineConfig = field(default_factory=EngineConfig)
    threads: int | None = None  # torch intra-op threads per rank; None: torch's default
    tp_timeout: float = 120.0  # seconds a rank waits for its gang at start-up
    # added to each rank's CPU niceness (`--worker-nice`): the rank then yields the cores to the
    # HTTP front and the controller, and to every other process on the machine as well
    # (docs/cluster.md, Worker priority); 0 leaves it
    nice: int = WORKER_NICE

    def __post_init__(self):
        if not 0 <= self.nice <= MAX_NICE:
            raise ValueError(
                f"{self.nice=} must be 0 to {MAX_NICE} (a rank may not raise its CPU priority)"
            )


def init_tensor_parallel(rank: int, size: int, rendezvous: str, device: str, timeout: float):
    """Join the gang's process group; a `TPGroup`. Every rank of a gang runs on one node, so
    the ranks meet in a file (`rendezvous`, in a folder only this user can read) and talk
    over the loopback interface: nothing listens on the network."""
    from dilaserve.models.layers import TPGroup

    if size == 1:
        return TPGroup()
    import datetime

    import torch.distributed as dist

    loopback = loopback_interface()
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if loopback is not None:
            os.environ.setdefault(name, loopback)
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        store=dist.FileStore(rendezvous, size),
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    return TPGroup(size, rank, dist.group.WORLD)


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface ("lo" on Linux), if it has one."""
    import socket

    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)


def new_rendezvous() -> str:
    """A file for one gang's ranks to meet in, in a new folder only this user can read."""
    import tempfile

    return os.path.join(tempfile.mkdtemp(prefix="dilaserve-tp-"), "store")


class InstanceWorker:
    """One rank: loads its shard of the model into an engine, the rank's `Executor`, and
    runs steps through it."""

    def __init__(self, config: WorkerConfig, rank: int = 0, size: int = 1, rendezvous: str = ""):
        import torch

        from dilaserve.engine.engine import Engine
        from dilaserve.models.checkpoint import load_model
        from dilaserve.models.tokenizer import Tokenizer

        if config.threads:
            torch.set_num_threads(config.threads)
        if config.nice:
            os.nice(config.nice)
        engine = config.engine
        tp = init_tensor_parallel(rank, size, rendezvous, engine.device, config.tp_timeout)
        self.rank = rank
        model = load_model(config.model, engine.dtype, tp, device=engine.device)
        special = Tokenizer(Path(config.model), model.config).special
        self.executor: Executor = Engine(model, special, engine)

    def step(self, batch: StepBatch) -> tuple[StepOutput, float]:
        """Run one step; the output and the seconds the engine took."""
        start = time.perf_counter()
        output = self.executor.execute(batch)
        return output, time.perf_counter() - start

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.executor.release(rid)


def preload_quietly() -> None:
    """Import what loading a model takes (torch above all, 1.5 CPU-seconds) before the orders
    come, so that a spare rank has it done when it is taken, without slowing the ranks that
    serve: in a thread of its own at the lowest CPU priority. Niceness is per thread on Linux,
    and an unprivileged thread cannot take it back, so this process's main thread, which runs
    the steps and starts torch's compute threads, keeps its own. Nothing here touches a GPU,
    so `CUDA_VISIBLE_DEVICES` set after it still holds."""

    def run():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MAX_NICE)
        import torch  # noqa: F401

        from dilaserve.engine import engine  # noqa: F401
        from dilaserve.models import checkpoint, tokenizer  # noqa: F401

    thread = threading.Thread(target=run, name="preload")
    thread.start()
    thread.join()


def serve_pipe(conn, spare: bool = False) -> None:
    """A local worker process: read its orders, load, say "up", then answer commands until
    told to stop (or the controller goes away).

    A spare (`spare`) first imports (`preload_quietly`) and says ("ready",).
    First message: ("init", WorkerConfig, rank, size, rendezvous, gpus). Commands: ("step", batch)
    -> ("done", output, seconds) or ("failed", error); ("release", request_ids); ("stop",).
    Only rank 0 answers.
    """
    try:
        if spare:  # (`LocalBackend`'s)
            preload_quietly()
            conn.send(("ready",))
        _, config, rank, size, rendezvous, gpus = conn.recv()
    except (EOFError, OSError):
        return  # a spare never taken
    if gpus and config.engine.device.startswith("cuda"):
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    try:
        worker = InstanceWorker(config, rank, size, rendezvous)
    except Exception:
        conn.send(("failed", traceback.format_exc(limit=3)))
        return
    if rank == 0:
        conn.send(("up",))
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):
            return  # the controller went away
        if command[0] == "stop":
            return
        if command[0] == "release":
            worker.release(command[1])
            continue
        try:
            output, seconds = worker.step(command[1])
        except Exception as e:  # a bad batch fails, never the worker
            if rank == 0:
                conn.send(("failed", f"{type(e).__name__}: {e}"))
            continue
        if rank == 0:
            conn.send(("done", output, seconds))


if __name__ == "__main__":
    import signal
    import sys
    from multiprocessing.connection import Connection

    # Ctrl-C and a SIGTERM to the process group (systemd, `timeout`) reach workers too; the
    # controller decides when they stop (and a worker whose controller is gone sees its socket
    # close and exits).
    for terminal in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(terminal, signal.SIG_IGN)
    serve_pipe(Connection(int(sys.argv[1])), spare="--spare" in sys.argv[2:])
