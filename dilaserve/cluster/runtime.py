"""The cluster runtime: the control plane driven by the wall clock and real model instances.

`Cluster` (configured by `config.ClusterConfig`) is what callers hold. It builds a scheduler
(`control.build`), a backend of model instances (`backends`) and the `Controller` that one
thread runs (`controller`: events in, decisions carried out, faults survived), and starts that
thread once the initial instances are up; the clock starts at zero then. Callers on any thread
submit requests (checked by `intake`, then queued for the controller, or refused at once:
`Overloaded` over capacity or at `max_in_flight`, `Closed` while not serving or while no
instance serves) and cancel them; `health()` says "degraded" until lost capacity is back;
`drain` and `close` end serving; what it shows of itself (load, estimates) is
`readings.ClusterReadings`'. What the controller records (`stats`, the decision `log`, the
`recording` for replay, step timings, instances over time) is the controller's
(`cluster.controller`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from dilaserve.cluster.backends import Backend, start_all
from dilaserve.cluster.config import ClusterConfig, make_backend
from dilaserve.cluster.controller import Controller
from dilaserve.cluster.gate import Gate
from dilaserve.cluster.intake import Intake, longest_token_chars
from dilaserve.cluster.readings import ClusterReadings
from dilaserve.cluster.requests import (
    FULL,
    Answers,
    Closed,
    InvalidRequest,
    Observer,
    Overloaded,
    RequestHandle,
)
from dilaserve.control.build import build_scheduler

log = logging.getLogger("dilaserve.cluster")
# refused for capacity in a row, none admitted between: health says "degraded" (one refusal
# is a request too big for the moment; several in a row are admission refusing the work)
REFUSALS_DEGRADED = 3


def with_family_cache(config: ClusterConfig, family) -> ClusterConfig:
    """`config` with the control plane's cache mode resolved as the engine resolves it: a
    block-diffusion family runs its exact block cache for any mode but none."""
    scheduler = config.control.scheduler
    mode = family.cache_mode(scheduler.kv_cache)
    if mode is scheduler.kv_cache:
        return config
    control = replace(config.control, scheduler=replace(scheduler, kv_cache=mode))
    return replace(config, control=control)


def checked_model_config(config: ClusterConfig):
    """The checkpoint's model config, every TP degree of the layout checked against it."""
    from dilaserve.models.registry import load_config

    model_config = load_config(Path(config.worker.model))
    for tp in sorted(set(config.instances)):
        model_config.check_tensor_parallel(tp)
    return model_config


class Cluster(ClusterReadings):
    def __init__(
        self,
        config: ClusterConfig = ClusterConfig(),
        backend: Backend | None = None,
        observer: Observer | None = None,
    ):
        from dilaserve.models.registry import family_of
        from dilaserve.models.tokenizer import Tokenizer

        model_config = checked_model_config(config)
        family = family_of(model_config)
        self.config = config = with_family_cache(config, family)
        self.aligned_blocks = family.is_block_causal  # blocks at absolute positions
        self.tokenizer = Tokenizer(Path(config.worker.model), model_config)
        self.scheduler = build_scheduler(config.control)
        self.block_len = config.control.scheduler.block_len
        self.backend = backend or make_backend(config)
        self.intake = self._intake(model_config, family)
        answers = Answers(self.tokenizer, observer)
        self.controller = Controller(
            config, self.scheduler, self.backend, answers, observer, self.now
        )
        self.gate = Gate(self.controller, self.slo)
        self._accepting = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._next_id = 0

    def _intake(self, model_config, family) -> Intake:
        config = self.config
        engine = config.worker.engine
        decoding = family.decoding_for(model_config, engine.editing)
        return Intake(
            self.tokenizer,
            self.block_len,
            model_config.max_sequence_length,
            config.max_tokens,
            model_config.vocab_size,
            config.dws_estimator(),
            config.dws_prior,
            longest_token_chars(self.tokenizer),
            aligned=family.is_block_causal,
            decoding=decoding,
            engine_steps=engine.steps,
            step_budget=decoding.budget_for(
                family.cache_mode(engine.kv_cache), engine.step_budget, engine.block_len
            ),
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Load the initial instances (waiting until all are up), then start serving."""
        specs = self.config.initial_specs()
        worker = self.config.worker
        log.info(
            "loading %d instances %s of %s on %s: a process per rank loads the weights",
            len(specs),
            [s.tp for s in specs],
            Path(worker.model).name,
            worker.engine.device,
        )
        start_all(self.backend, specs, self.config.start_timeout, log.info)
        self._t0 = time.perf_counter()
        self.controller.start(specs)
        self._thread = threading.Thread(
            target=self.controller.run, name="dilaserve-controller", daemon=True
        )
        self._thread.start()
        self._accepting = True
        log.info(
            "cluster up: %d instances %s; a step past %.1f s counts as hung",
            len(specs),
            [s.tp for s in specs],
            self.controller.hangs.step_timeout,
        )
        return self

    def drain(self, timeout: float) -> bool:
        """Take no new requests and wait up to `timeout` s for those in flight; all done?"""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self.controller.handles and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.controller.handles

    @property
    def accepting(self) -> bool:
        return self._accepting

    def health(self) -> str:
        """Says "ok"; "degraded": lost capacity not yet restored, or admission refusing every
        request (`health_reason` says which); "unavailable": not accepting requests, or every
        instance lost (a planned reconfiguration may briefly run none)."""
        if not self._accepting or self._all_lost():
            return "unavailable"
        return "ok" if self.health_reason() is None else "degraded"

    def health_reason(self) -> str | None:
        """Why the cluster is not "ok" (None: it is)."""
        if not self._accepting:
            return "not accepting requests (starting or shutting down)"
        if self._all_lost():
            return "no instance serving: lost capacity is being restored"
        if self.controller.replacements.pending:
            return "lost capacity is being restored"
        refused = self.controller.admitting.refused_in_a_row
        if refused >= REFUSALS_DEGRADED:
            return (
                f"admission refused the last {refused} requests (steps measured at "
                f"{self.scheduler.speed.slowdown:.1f}x the profile's time)"
            )
        return None

    def _all_lost(self) -> bool:
        return not self.scheduler.instances and self.controller.replacements.pending

    def close(self, timeout: float = 30.0) -> None:
        """Stop serving; requests still in flight fail with `Closed`. Closing twice is once."""
        self._accepting = False
        if self.controller.closing.is_set():
            return
        self.controller.closing.set()
        self.backend.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        error = Closed("the server shut down before the request finished")
        for handle in list(self.controller.handles.values()):
            self.controller.fail(handle, error)
        self.backend.shutdown()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def now(self) -> float:
        """Seconds since the cluster started serving."""
        return time.perf_counter() - self._t0

    # -- requests ----------------------------------------------------------------------------

    def submit(
        self,
        prompt: str | list[int],
        max_tokens: int | None = None,
        slo: float | None = None,
        priority: int = 0,
        chat: bool = True,
        request_id: str | None = None,
        threshold: float | None = None,
        min_threshold: float | None = None,
        max_threshold: float | None = None,
        text: str | None = None,
        stop: str | Sequence[str] | None = None,
        steps: int | None = None,
        received: float | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        stream: bool = True,
    ) -> RequestHandle:
        """Queue a request (thread-safe). `max_tokens` is the output window, rounded up to
        whole blocks; `slo` seconds from now (default: the scheduler's). `threshold` pins the
        confidence threshold; `min_threshold`/`max_threshold` bound what the policy may pick.
        `text`: the user's prompt text for the DWS predictor (default: `prompt` if a string).
        `stop`: up to 4 strings; the answer ends before the first of them, and the request
        stops being worked on once one is committed. `steps`: steps per block of the family's
        step schedule (None: the engine's). `received`: the `time.perf_counter()` at which the
        request reached the caller (its latency and SLO count from there; default: now).
        `loop`: the event loop to stream to (default: the caller's, if it runs in one);
        `stream=False`: the result only, no text as it grows (`RequestHandle`). Raises ValueError
        naming a bad argument, `Overloaded` when admission refuses, `Closed` when not serving."""
        ahead = len(self.controller.arrivals)
        if self.gate.refuses(priority, slo, max_tokens, ahead):  # before any work, tokenizing
            raise Overloaded(FULL)
        submission = self.intake.check(
            prompt,
            max_tokens,
            slo,
            priority,
            chat,
            threshold,
            min_threshold,
            max_threshold,
            text,
            stop,
            steps,
        )
        with self._lock:
            handle = self._register(submission, request_id, received, loop, stream)
        self.backend.wake()
        return handle

    def _register(self, submission, request_id, received, loop, stream) -> RequestHandle:
        """A checked submission becomes a request in flight, queued for the controller (under
        `_lock`): refused while closed, with nothing serving, or at `max_in_flight`."""
        if not self._accepting:
            raise Closed("the cluster is not accepting requests")
        if self._all_lost():
            raise Closed("no instance is serving (lost capacity is being restored)")
        handles = self.controller.handles
        if len(handles) >= self.config.max_in_flight:
            raise Overloaded(f"{len(handles)} requests in flight (the limit)")
        rid = request_id or f"req-{self._next_id}"
        self._next_id += 1
        if rid in handles:
            raise InvalidRequest("request_id", f"request_id {rid!r} is already in flight")
        submitted = self.now() if received is None else min(self.now(), received - self._t0)
        request = submission.request(
            rid, submitted, self.block_len, self.tokenizer.special.mask, self.aligned_blocks
        )
        handle = RequestHandle(request, submitted, submission.stop, loop, stream)
        handles[rid] = handle
        self.controller.arrivals.append(handle)
        return handle

    def cancel(self, request_id: str) -> None:
        """Stop working on a request (thread-safe; e.g. its client went away)."""
        self.controller.cancels.append(request_id)
        self.backend.wake()

    def is_full(
        self,
        priority: int,
        slo: float | None = None,
        max_tokens: int | None = None,
        entry=None,
        probe: bool = False,
    ) -> bool:
        """Would a request of `priority` and `slo` seconds (default: the server's) be refused
        now, before any work? (`gate.py`: admission's `Room`, behind the requests not priced
        yet, but `entry`, the request's own count from `enter`; a `probe` refuses nothing, so
        `health` does not count it.)"""
        return self.gate.is_full(priority, slo, max_tokens, entry, probe)

    def enter(self):
        """Count a request the front lets through ahead of later ones, from now until it
        `leave`s or is queued (`Gate.enter`)."""
        return self.gate.enter()

    def entering(self, entry=None):
        """While a request the front let through is on its way to the controller, it counts
        ahead of later ones (`Gate.entering`, from `entry` if the front counted it already);
        yields the `submit` to call for it."""
        return self.gate.entering(self.submit, entry)
