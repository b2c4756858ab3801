"""`dilaserve serve`: the cluster behind the HTTP API, run by uvicorn.

SIGINT/SIGTERM shut down gracefully: uvicorn stops accepting connections and waits for open
ones (streams in progress) up to the drain timeout, then the app drains the cluster and stops
its instances.
"""

from __future__ import annotations

import logging
from pathlib import Path

import uvicorn

from dilaserve.cluster.runtime import Cluster, ClusterConfig
from dilaserve.server.app import ServerSettings, create_app
from dilaserve.server.metrics import ServerMetrics


def build_app(config: ClusterConfig, settings: ServerSettings | None = None, address: str = ""):
    """The app and its cluster (not started: the app starts it)."""
    metrics = ServerMetrics()
    cluster = Cluster(config, observer=metrics)
    settings = settings or ServerSettings(Path(config.worker.model).name, address)
    return create_app(cluster, settings, metrics), cluster


def serve(
    config: ClusterConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    drain_timeout: float = 30.0,
    api_key: str | None = None,
    log_interval: float = 10.0,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    address = f"http://{host}:{port}"
    name = model_name or Path(config.worker.model).name
    settings = ServerSettings(
        name, address, drain_timeout, api_key=api_key, log_interval=log_interval
    )
    app, _ = build_app(config, settings)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=int(drain_timeout),
    )
