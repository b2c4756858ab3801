"""`dilaserve serve`: the cluster behind the HTTP API, run by uvicorn.

The port is bound before anything loads: a port in use stops the command at once with one
line. The "serving at ..." line is logged once the server really listens.

Shutdown (SIGINT/SIGTERM): the server keeps listening while it drains, so that new requests
get 503 with Retry-After and `Connection: close` (`guards.py`: at any load, before capacity's
429) and `/health` says 503 rather than a refused connection; requests in flight have up to the
drain timeout to finish; those still running then get an error in OpenAI's shape (a stream: an
error event and `[DONE]`). New connections are turned away (`listener.py`) once nothing is in
flight, or for the drain's last second (`LAST_CALL_SECONDS`), so that a client the server took
has time to send its request. Then the listener closes without resetting the connections the
kernel already completed (`listener.py`: those queued are taken and answered 503 too, and the
server waits until every connection it took has closed after an answer that told its client
to, one with no request yet or kept alive after an earlier answer included), while the
instances stop. The process exits within the drain timeout plus
`EXIT_SECONDS`: each step of uvicorn's shutdown gets what is left of that second, and an
instance still stopping then is left to end on its own (its socket closes with the process).
Workers ignore terminal signals (a SIGTERM to the process group, as systemd and `timeout`
send, reaches them too): the server stops them. A second signal stops at once.

The HTTP front's limits (`ServerSettings`): request heads and read timeouts (`limits.py`), open
connections (uvicorn's `limit_concurrency`: 503 over it), body size and early refusals
(`guards.py`). The access log shows no query strings (a client may put a key there), and, with
periodic lines (`--log-interval`), no line per 429: the periodic line counts them.
"""

from __future__ import annotations

import gc
import logging
import math
import socket
import threading
import time
from pathlib import Path

import uvicorn

from dilaserve.cluster.runtime import Cluster, ClusterConfig
from dilaserve.server.app import ServerSettings, create_app, describe_cluster
from dilaserve.server.guards import allowed_hosts_for, draining_answer
from dilaserve.server.limits import limited_protocol
from dilaserve.server.listener import close_listeners, turn_new_connections_away
from dilaserve.server.metrics import ServerMetrics

log = logging.getLogger("dilaserve.server")
EXIT_SECONDS = 1.0  # after the drain timeout, the longest the process takes to exit
# Of EXIT_SECONDS, while the cluster closes (failing what is left): uvicorn's loop's tick
# (0.1 s, later on a busy machine), then the listener's close, which waits until every
# connection's request is answered (`listener.py`: a connection just opened is waited on for
# its first request), uvicorn's own pause (0.1 s) and up to GRACEFUL_SECONDS for the last
# answers to go out; each wait gets only what is left of the exit's deadline less what comes
# after it (at least MIN_WAIT_SECONDS), and EXIT_MARGIN is kept for the interpreter's exit.
# Without a drain (a second signal), the listener's close waits at most LAST_WORD_SECONDS.
LAST_WORD_SECONDS = 0.3
GRACEFUL_SECONDS = 0.25
UVICORN_PAUSE_SECONDS = 0.1
EXIT_MARGIN = 0.25
MIN_WAIT_SECONDS = 0.05
# New connections are turned away for the drain's last LAST_CALL_SECONDS (at most
# LAST_CALL_SHARE of it), so that every connection the server took has that long at least to
# carry its request before the listener closes.
LAST_CALL_SECONDS = 1.0
LAST_CALL_SHARE = 0.5
CLOSE_JOIN_SECONDS = 0.2  # the controller thread's to stop before what is left is failed
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
    is rare (measured on the bundled model: docs/serving/reliability.md)."""
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
        self._exit_by: float | None = None  # (monotonic) once a drain began

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info(
                "dilaserve serving %s at %s (%s)",
                self.settings.model_name,
                self.settings.address,
                describe_cluster(self.cluster.config),
            )

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's, but a request sent before the listener closed, on an open connection or
        one still in the kernel's accept queue, is answered (503: draining) rather than dropped
        with its connection (`listener.py`); within the drain's exit deadline."""
        after = UVICORN_PAUSE_SECONDS + EXIT_MARGIN
        most = LAST_WORD_SECONDS if self._exit_by is None else math.inf  # (a drain's: all left)
        last_word = self._time_left(most, after + GRACEFUL_SECONDS)
        connections = self.server_state.connections
        await close_listeners(self.servers, connections, last_word, draining_answer())
        graceful = self.config.timeout_graceful_shutdown or GRACEFUL_SECONDS
        self.config.timeout_graceful_shutdown = self._time_left(graceful, after)
        await super().shutdown(sockets)

    def _time_left(self, most: float, kept: float) -> float:
        """Seconds a shutdown step may take: at most `most`, and no more than the exit's
        deadline leaves once `kept` seconds are kept for what comes after it."""
        if self._exit_by is None:  # no drain: not bounded by one
            return most
        return min(most, max(self._exit_by - time.monotonic() - kept, MIN_WAIT_SECONDS))

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
        timeout = self.settings.drain_timeout
        self._exit_by = time.monotonic() + timeout + EXIT_SECONDS
        last_call = min(LAST_CALL_SECONDS, timeout * LAST_CALL_SHARE)
        drained = self.cluster.drain(timeout - last_call)
        # new connections are turned away from here on (`listener.py`), and those the server
        # took have the rest of the drain and of the exit to send their requests: a client may
        # take its time to write once connected (beside a CPU hog, 131 connections taken in the
        # drain's last 0.4 s had sent nothing when the listener closed)
        turn_new_connections_away(self.servers)
        if not (drained or self.cluster.drain(last_call)):
            log.info("drain timed out: failing %d requests in flight", self.cluster.in_flight)
        # fails what is left, in OpenAI's shape, and stops the instances, while uvicorn shuts
        # down (its listener's close waits for those answers); an instance slower to stop than
        # the process is left to end on its own
        closing = threading.Thread(
            target=self.cluster.close, args=(CLOSE_JOIN_SECONDS,), name="dilaserve-close"
        )
        closing.daemon = True
        closing.start()
        super().handle_exit(sig, frame)


def server_config(app, settings: ServerSettings, **options) -> uvicorn.Config:
    """uvicorn's configuration with the front's limits and, for `create_app`'s app, its early
    refusals (`options`: more of uvicorn's, e.g. a port). Its access log shows paths without
    their query strings."""
    refusals = getattr(getattr(app, "state", None), "refusals", None)
    counted = settings.log_interval > 0  # 429s counted by the periodic line, not logged
    uv = uvicorn.Config(
        app,
        **{
            "log_level": "info",
            "http": limited_protocol(settings.http, refusals, log_refusals=not counted),
            "ws": "none",
            "limit_concurrency": settings.max_connections,
            "timeout_graceful_shutdown": GRACEFUL_SECONDS,
            "timeout_keep_alive": KEEP_ALIVE_SECONDS,
            **options,
        },
    )
    access = logging.getLogger("uvicorn.access")  # (configured by uvicorn.Config)
    for kind in (QueryRedacted, RefusalsCounted):
        for old in [f for f in access.filters if isinstance(f, kind)]:
            access.removeFilter(old)
    access.addFilter(QueryRedacted())
    if counted:
        access.addFilter(RefusalsCounted())
    return uv


class RefusalsCounted(logging.Filter):
    """No access-log line for a 429: the server's periodic line counts them
    (`ServerMetrics.interval_line`). Over capacity they are most answers (400 closed-loop
    clients: about 300 a second), and their lines cost the event loop what it needs to
    answer them."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) > 4 and args[4] == 429)


class QueryRedacted(logging.Filter):
    """Access-log lines without query strings: a client may put a key there (`?api_key=`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) > 2 and "?" in str(args[2]):
            path = str(args[2]).split("?", 1)[0]
            record.args = (*args[:2], f"{path}?[query not logged]", *args[3:])
        return True


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
    **limits,
) -> None:
    """`limits`: more `ServerSettings` fields (max_messages, max_connections, http)."""
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
        **limits,
    )
    app, cluster = build_app(config, settings, manage=False)
    cluster.start()  # before uvicorn: a model that fails to load is one error line, not a trace
    freeze_start_up_heap()
    server = DrainingServer(server_config(app, settings), cluster, settings)
    try:
        server.run(sockets=[sock])
    finally:
        cluster.close()
