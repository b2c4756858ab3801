"""`dilaserve serve`: the cluster behind the HTTP API, run by uvicorn.

The port is bound before anything loads: a port in use stops the command at once with one
line. The "serving at ..." line is logged once the server really listens.

Shutdown (SIGINT/SIGTERM): the server keeps listening while it drains, so that new requests
get 503 with Retry-After and `/health` says 503 rather than a refused connection; requests in
flight have up to the drain timeout to finish; those still running then get an error in
OpenAI's shape (a stream: an error event and `[DONE]`). Only then does uvicorn stop listening
and the instances stop. Workers ignore terminal signals (a SIGTERM to the process group, as
systemd and `timeout` send, reaches them too): the server stops them. A second signal stops
at once.
"""

from __future__ import annotations

import gc
import logging
import socket
import threading
from pathlib import Path

import uvicorn

from dilaserve.cluster.runtime import Cluster, ClusterConfig
from dilaserve.server.app import ServerSettings, create_app, describe_cluster
from dilaserve.server.guards import allowed_hosts_for
from dilaserve.server.metrics import ServerMetrics

log = logging.getLogger("dilaserve.server")
FLUSH_SECONDS = 0.5  # after failing what is left, time for those answers to go out
# Idle keep-alive connections are closed after this (uvicorn's default is 5 s). A client that
# reuses one just as the server closes it loses that request (a read error), so the server
# should outlast the clients and proxies in front of it (commonly 60 s).
KEEP_ALIVE_SECONDS = 65


def build_app(
    config: ClusterConfig,
    settings: ServerSettings | None = None,
    address: str = "",
    manage: bool = True,
):
    """The app and its cluster (not started; with `manage`, the app starts and closes it)."""
    metrics = ServerMetrics()
    cluster = Cluster(config, observer=metrics)
    settings = settings or ServerSettings(Path(config.worker.model).name, address)
    return create_app(cluster, settings, metrics, manage), cluster


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening); a port in use is a one-line error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (--port, --host)") from None
    return sock


def freeze_start_up_heap() -> None:
    """Exempt everything start-up made (modules, the tokenizer, the predictor, ...) from the
    garbage collector, and collect less often. Each full pass walked that heap and held the
    interpreter for 130-160 ms, stalling the HTTP front and the controller alike (under 3x
    overload, a refusal's p99); frozen, 20-50 ms, and with the higher thresholds a full pass
    is rare (measured on the bundled model: docs/serving.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)  # (Python's defaults: 700, 10, 10)


class DrainingServer(uvicorn.Server):
    """uvicorn, with the shutdown this module's docstring describes."""

    def __init__(self, config: uvicorn.Config, cluster: Cluster, settings: ServerSettings):
        super().__init__(config)
        self.cluster = cluster
        self.settings = settings
        self._draining: threading.Thread | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info(
                "dilaserve serving %s at %s (%s)",
                self.settings.model_name,
                self.settings.address,
                describe_cluster(self.cluster.config),
            )

    def handle_exit(self, sig, frame) -> None:
        if self._draining is not None or not self.started:
            return super().handle_exit(sig, frame)  # a second signal, or still starting: now
        log.info(
            "draining: up to %.0f s for %d requests",
            self.settings.drain_timeout,
            self.cluster.in_flight,
        )
        self._draining = threading.Thread(
            target=self._drain_then_exit, args=(sig, frame), name="dilaserve-drain", daemon=True
        )
        self._draining.start()

    def _drain_then_exit(self, sig, frame) -> None:
        drained = self.cluster.drain(self.settings.drain_timeout)
        if not drained:
            log.info("drain timed out: failing %d requests in flight", self.cluster.in_flight)
        self.cluster.close()  # fails what is left, in OpenAI's shape, and stops the instances
        threading.Event().wait(FLUSH_SECONDS)
        super().handle_exit(sig, frame)


def serve(
    config: ClusterConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    drain_timeout: float = 30.0,
    api_key: str | None = None,
    log_interval: float = 10.0,
    calibration: dict | None = None,
    max_body_bytes: int | None = None,
    allowed_hosts: tuple[str, ...] | None = None,
    docs: bool = False,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sock = bind(host, port)  # before anything loads
    shown = f"[{host}]" if ":" in host else host
    settings = ServerSettings(
        model_name or Path(config.worker.model).name,
        f"http://{shown}:{port}",
        drain_timeout,
        api_key=api_key,
        log_interval=log_interval,
        allowed_hosts=allowed_hosts_for(host, allowed_hosts),
        docs=docs,
        calibration=calibration,
        **({} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}),
    )
    app, cluster = build_app(config, settings, manage=False)
    cluster.start()  # before uvicorn: a model that fails to load is one error line, not a trace
    freeze_start_up_heap()
    uv = uvicorn.Config(
        app, log_level="info", timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_SECONDS
    )
    server = DrainingServer(uv, cluster, settings)
    try:
        server.run(sockets=[sock])
    finally:
        cluster.close()
