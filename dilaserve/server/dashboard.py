"""`GET /dashboard`, the live page, and `GET /dashboard/data`, what it draws.

`LiveFeed` hears the controller thread through `ServerMetrics` (steps run, requests finished or
failed; and the API's refusals) and samples the cluster (queue, requests in flight, instances,
migrations, reconfigurations, instance failures) at most every `SAMPLE_SECONDS` of steps and at
every data request, into a bounded `dashboard.timeline.Timeline` behind a lock; its time axis
is seconds since it began to watch. A request costs O(its steps) once; a data request costs what
`Timeline.to_json` does, whatever the load.

With an API key set the page and its data need it, as `/v1/` does: as a bearer token, or, so that
a browser can ask for it, as the password of HTTP Basic authentication (any user name; only the
page itself answers 401 with a Basic challenge). The page served then carries a token that opens
the dashboard only, which its data requests send: browsers do not all send Basic credentials
again for a script's requests. The token expires (`TOKEN_SECONDS` after the page was served: it
is its expiry time and an HMAC of it under the key), so that one copied out of a page, a proxy
log or a browser's history does not open the dashboard for good; a page left open past it
asks to be reloaded.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from dilaserve.dashboard.page import live_page
from dilaserve.dashboard.timeline import Timeline

DATA_PATH = "/dashboard/data"
SAMPLE_SECONDS = 0.1  # the cluster's gauges are sampled at most this often on the step path
MAX_TRACKED = 1 << 16  # priorities remembered for requests in flight (more: the oldest go)
CHALLENGE = {"WWW-Authenticate": 'Basic realm="dilaserve dashboard", charset="UTF-8"'}
# how long a page's token opens the dashboard's data: a working day (a page left open overnight
# is reloaded, asking for the key again)
TOKEN_SECONDS = 12 * 3600.0


class LiveFeed:
    """The live server's `Timeline`: `ServerMetrics` calls the hooks on the controller thread."""

    def __init__(self, interval: float = 2.0, keep: int = 300):
        self.timeline = Timeline(interval, keep)
        self._lock = threading.Lock()
        self._cluster = None
        self._priority: dict[str, int] = {}  # request id -> priority, from its first step
        self._seen = {"migrations": 0, "reconfigurations": 0, "failures": 0}
        self._next_sample = 0.0
        self._t0 = 0.0

    def watch(self, cluster) -> None:
        """Follow `cluster` (started: the time axis begins now)."""
        self._cluster = cluster
        self._t0 = time.perf_counter()

    def _now(self) -> float:
        """Seconds since `watch`: the server, not the control plane, reads the clock."""
        return time.perf_counter() - self._t0

    # -- hooks (controller thread) ----------------------------------------------------------

    def step_done(self, instance_id: str, kind: str, output, seconds: float) -> None:
        if self._cluster is None:
            return
        self._remember_priorities(output)
        now = self._now()
        with self._lock:
            self.timeline.step_done(now, instance_id, kind, output.num_tokens, seconds)
            if now >= self._next_sample:
                self._sample(now)

    def request_done(self, result, thresholds: list[float]) -> None:
        if self._cluster is None:
            return
        priority = self._priority.pop(result.request_id, 0)
        now, tokens = self._now(), len(result.token_ids)
        with self._lock:
            self.timeline.request_done(
                now, result.latency, result.met_slo, priority, thresholds, tokens
            )

    def request_failed(self, request_id: str, reason: str) -> None:
        self._priority.pop(request_id, None)
        if self._cluster is None or reason == "CancelledError":  # a cancel is no failure
            return
        with self._lock:
            self.timeline.request_failed(self._now())

    def request_rejected(self) -> None:
        """A request refused at admission (429 or 503; called on the event loop)."""
        if self._cluster is None:
            return
        with self._lock:
            self.timeline.request_rejected(self._now())

    def _remember_priorities(self, output) -> None:
        """The priority of each request seen for the first time (the scheduler still tracks it:
        this runs before the scheduler hears of the step)."""
        tracked = self._cluster.scheduler.requests
        for r in output.results:
            rid = r.request_id
            if rid not in self._priority and rid in tracked:
                if len(self._priority) >= MAX_TRACKED:
                    self._priority.pop(next(iter(self._priority)))
                self._priority[rid] = tracked[rid].request.priority

    # -- the page's data (event loop) -------------------------------------------------------

    def data(self, meta: dict) -> dict:
        if self._cluster is None:
            raise RuntimeError("the dashboard's feed watches no cluster yet")
        now = self._now()
        with self._lock:
            self._sample(now)
            return self.timeline.to_json(now, meta)

    def _sample(self, now: float) -> None:
        c, t = self._cluster, self.timeline
        self._next_sample = now + SAMPLE_SECONDS
        budget = c.quality_budget
        quality = None if budget is None else (budget.loss(c.now()), budget.budget)
        t.sample(now, c.queue_length(), c.in_flight, c.step_slowdown, c.deadline_factor, quality)
        instances = {iid: inst.tp for iid, inst in dict(c.scheduler.instances).items()}
        if instances != t.instance_tp:
            t.set_instances(now, instances)
        stats, seen = c.controller.stats, self._seen
        if stats["migrations"] > seen["migrations"]:
            t.migrated(now, stats["migrations"] - seen["migrations"])
        if stats["reconfigurations"] > seen["reconfigurations"]:
            t.event(now, "reconfiguration", _plan_text(c))
        if stats["failures"] > seen["failures"]:
            count = stats["failures"] - seen["failures"]
            t.event(now, "instance failure", f"{count} instance(s) failed")
        self._seen = {k: stats[k] for k in seen}


def _plan_text(cluster) -> str:
    log = cluster.controller.rollout.log
    if not log:
        return "begun"
    target = log[-1]["target"]
    return "to " + ", ".join(f"{n} x TP-{tp}" for tp, n in sorted(target.items()))


def page_meta(cluster, settings) -> dict:
    """What the page says of the server: model, policy, default SLO, calibration."""
    control = cluster.config.control
    return {
        "source": "live",
        "title": f"dilaserve: {settings.model_name}",
        "model": settings.model_name,
        "policy": control.policy,
        "calibration": settings.calibration,
        "slo_s": control.scheduler.slo,
    }


def add_dashboard(
    app: FastAPI, feed: LiveFeed, meta: Callable[[], dict], api_key: str | None = None
) -> None:
    """The page and its data on `app`; `meta()`: what the page says of the server (read at each
    data request). Checking the API key, if any, is the app's middleware's job
    (`is_authorised`); each page served carries a fresh dashboard token for its data
    requests."""

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard():
        token = None if api_key is None else dashboard_token(api_key, time.time())
        page = live_page(DATA_PATH, token=token)
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get(DATA_PATH, include_in_schema=False)
    async def dashboard_data():
        return JSONResponse(feed.data(meta()), headers={"Cache-Control": "no-store"})


def is_dashboard(path: str) -> bool:
    return path == "/dashboard" or path.startswith("/dashboard/")


def dashboard_token(key: str, now: float) -> str:
    """A token that opens the dashboard and nothing else until `TOKEN_SECONDS` after `now`
    (Unix time): "<expiry>.<HMAC of it under the key>"."""
    expires = str(int(now + TOKEN_SECONDS))
    return f"{expires}.{_token_mac(key, expires)}"


def _token_mac(key: str, expires: str) -> str:
    message = f"dilaserve dashboard until {expires}".encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def is_authorised(path: str, authorization: bytes, key: str, now: float | None = None) -> bool:
    """Whether a dashboard path may be served to a request that did not send the API key as a
    bearer token: the key as a Basic password, or an unexpired dashboard token as a bearer
    token (`now`: Unix time, default the clock's)."""
    if not is_dashboard(path):
        return False
    return _token_valid(authorization, key, time.time() if now is None else now) or (
        _basic_password_matches(authorization, key)
    )


def _token_valid(authorization: bytes, key: str, now: float) -> bool:
    """Whether `Authorization: Bearer <expiry>.<mac>` carries a token of `key` not expired."""
    scheme, _, token = authorization.partition(b" ")
    expires, _, mac = token.decode("ascii", "replace").partition(".")
    if (
        scheme.lower() != b"bearer"
        or not (expires.isascii() and expires.isdigit())
        or int(expires) <= now
    ):
        return False
    return secrets.compare_digest(mac.encode(), _token_mac(key, expires).encode())


def challenge(path: str) -> dict | None:
    """The headers of a 401: the page asks a browser for the key (its data requests do not)."""
    return CHALLENGE if path == "/dashboard" else None


def _basic_password_matches(authorization: bytes, key: str) -> bool:
    """Whether `Authorization: Basic ...` carries `key` as its password."""
    scheme, _, encoded = authorization.partition(b" ")
    if scheme.lower() != b"basic":
        return False
    try:
        _, _, password = base64.b64decode(encoded.strip(), validate=True).partition(b":")
    except (binascii.Error, ValueError):
        return False
    return secrets.compare_digest(password, key.encode())
