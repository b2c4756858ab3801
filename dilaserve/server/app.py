"""The OpenAI-compatible HTTP API: `create_app(cluster, settings, metrics)`.

Endpoints: `POST /v1/completions` (raw prompt), `POST /v1/chat/completions` (the checkpoint's
chat template), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus), `GET /dashboard`
(a live page, `server/dashboard.py`). With
`stream: true` a response is Server-Sent Events whose deltas are committed text only, in order:
text goes out once it and everything before it is committed. `usage` counts generated tokens
only (of the text returned). Errors have OpenAI's shape (`{"error": {"message", "type",
"param", "code"}}`): 400 naming the bad field, 413 (a body over the limit), 404 (an unknown
model), 429 (over capacity: `control/admission.py`) and 503 (shutting down, or no instance
left) with Retry-After; what the front refuses before any handler runs (Host, draining,
capacity, body size) is `guards.py`'s, and what uvicorn's protocol refuses (request heads, slow
clients) `limits.py`'s. One bad request never touches another: validation happens before the
request reaches the cluster (a large body's off the event loop), and a failed request
(whatever it raised) fails alone. A client that disconnects, streaming
or not, has its request cancelled. With an API key set, `/v1/` endpoints answer only requests
carrying `Authorization: Bearer KEY` (401 otherwise; the dashboard also takes KEY as a Basic
password, so that a browser can ask for it); `/health` and `/metrics` stay open to probes and
scrapers.

The app starts the cluster when it starts and, on shutdown, stops taking requests, lets those
in flight finish (up to `drain_timeout` seconds), then stops the instances.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from dilaserve.cluster.runtime import Cluster
from dilaserve.server.bodies import param_of
from dilaserve.server.dashboard import add_dashboard, page_meta
from dilaserve.server.generation import GenerationApi, add_generation_routes
from dilaserve.server.guards import EarlyRefusals, Guards, error, require_api_key
from dilaserve.server.limits import HttpLimits
from dilaserve.server.metrics import ServerMetrics
from dilaserve.server.schemas import MAX_MESSAGES

log = logging.getLogger("dilaserve.server")


MAX_BODY_BYTES = 1 << 20  # default request body limit: 1 MiB (a 128k-token prompt as text)
MAX_CONNECTIONS = 1024  # default cap on open connections (more are answered 503)


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    address: str = ""  # for the start-up log line
    drain_timeout: float = 30.0  # seconds in-flight requests may take at shutdown
    retry_after: int = 1  # seconds a refused client should wait (429)
    api_key: str | None = None  # clients must send it as a bearer token (all but probes)
    log_interval: float = 10.0  # seconds between the log's activity lines (0: none)
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies get 413 before being read
    max_messages: int = MAX_MESSAGES  # a chat with more gets 400 naming `messages`
    max_connections: int = MAX_CONNECTIONS  # open connections; requests over it get 503
    http: HttpLimits = HttpLimits()  # a request's head size and read timeouts (`limits.py`)
    allowed_hosts: tuple[str, ...] = ("*",)  # Host header names answered ("*": any)
    docs: bool = False  # serve /docs and /openapi.json
    calibration: dict | None = None  # what the control plane's inputs are (GET /v1/models)

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty (leave it unset to serve without a key)")
        for name in ("max_body_bytes", "max_messages", "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")


async def _report(cluster: Cluster, metrics: ServerMetrics, seconds: float) -> None:
    """Every `seconds`, a log line of what the server did (when it did anything)."""
    while seconds > 0:
        await asyncio.sleep(seconds)
        line = metrics.interval_line(seconds, cluster.in_flight, cluster.queue_length())
        if line is not None:
            log.info(line)


def describe_cluster(config) -> str:
    """The start-up line's summary of a cluster: policy, instances and device."""
    policy, device = config.control.policy, config.worker.engine.device
    return f"policy {policy}, instances {list(config.instances)}, device {device}"


def create_app(
    cluster: Cluster, settings: ServerSettings, metrics: ServerMetrics, manage: bool = True
) -> FastAPI:
    """`manage`: start the cluster with the app and drain and close it at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage:
            await run_in_threadpool(cluster.start)
        metrics.watch(cluster)
        log.info("calibration: %s", _describe_calibration(settings.calibration))
        reporter = asyncio.create_task(_report(cluster, metrics, settings.log_interval))
        yield
        reporter.cancel()
        if manage:
            drained = await run_in_threadpool(cluster.drain, settings.drain_timeout)
            log.info("shutting down (%s)", "drained" if drained else "drain timed out")
            await run_in_threadpool(cluster.close)

    docs = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="dilaserve", lifespan=lifespan, **docs)
    api = GenerationApi(cluster, settings, metrics)

    _add_error_handlers(app)
    add_dashboard(app, metrics.dashboard, lambda: page_meta(cluster, settings), settings.api_key)
    if settings.api_key is not None:
        require_api_key(app, settings.api_key)
    app.add_middleware(
        Guards,
        max_body_bytes=settings.max_body_bytes,
        allowed_hosts=settings.allowed_hosts,
        cluster=cluster,
        on_refusal=metrics.rejected,
    )
    app.state.refusals = EarlyRefusals(  # (the HTTP protocol's: `server_config`)
        cluster, settings.retry_after, settings.api_key, settings.allowed_hosts, metrics.rejected
    )
    add_generation_routes(app, api)
    _add_status_routes(app, cluster, settings, metrics)
    return app


def _add_status_routes(
    app: FastAPI, cluster: Cluster, settings: ServerSettings, metrics: ServerMetrics
) -> None:
    @app.get("/v1/models")
    async def models():
        card = {"id": settings.model_name, "object": "model", "owned_by": "dilaserve"}
        extras = {"dilaserve": {"calibration": settings.calibration}}
        return {"object": "list", "data": [{**card, "created": 0, **extras}]}

    @app.get("/health")
    async def health():
        body = {"in_flight": cluster.in_flight, "instances": cluster.instances_by_tp()}
        status = cluster.health()
        body["reason"] = None if status == "ok" else cluster.health_reason()
        code = 503 if status == "unavailable" else 200
        headers = {"Retry-After": "5"} if code == 503 else None
        return JSONResponse({"status": status, **body}, status_code=code, headers=headers)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _describe_calibration(calibration: dict | None) -> str:
    """The start-up log's line of what the control plane's inputs are."""
    if not calibration:
        return "not given (the control plane's inputs are not labelled)"
    return ", ".join(f"{k}={v}" for k, v in calibration.items())


def _add_error_handlers(app: FastAPI) -> None:
    """Validation and HTTP errors in OpenAI's shape (400 naming the field)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return error(400, "the request body is not valid JSON")
        param = param_of(first.get("loc", ()))
        if param is None:
            return error(400, f"the request body must be a JSON object: {first.get('msg')}")
        return error(400, f"{param}: {first.get('msg')}", param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail))
