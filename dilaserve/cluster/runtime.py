"""The cluster runtime: the control plane driven by the wall clock and real model instances.

`Cluster` (configured by `config.ClusterConfig`) owns a scheduler (`control.build`), a backend
of model instances (`backends`), and one controller thread. The thread turns what happens into
the scheduler's events, one at a time and each at its own clock reading: requests submitted from
any thread (`on_arrival`), steps that instances report done (`on_step_done`), ticks every `tick`
seconds (`on_tick`: deferred requests, planner rounds) and instances coming up or dying. It
carries out the decisions: step commands to instances (sent without waiting, so steps on
different instances overlap), releases, finished requests, and reconfigurations through the same
`Rollout` as the simulator. The clock starts at zero once the initial instances are up.

Because the simulator drives the same scheduler and rollout, a run here, recorded
(`Recording`: each admitted request, each launch with its clock times and outcome), replays in
the simulator to the same decision log (`sim.replay`); that parity is tested.

Faults: if an instance's process dies, its requests continue elsewhere from their last
committed tokens (the step it was running is lost), the failure is counted and logged, and a
replacement with the same GPUs is started (`replace_failed`); an instance whose step runs past
`step_timeout` is taken for hung and killed, to the same end. A replacement that cannot be
started or dies loading is retried with backoff (`replacements`); while no instance serves,
new requests are refused (`Closed`), and `health()` says "degraded" until capacity is back.
If the engine raises on a step (a batch too big for memory, a request that breaks it), the
step's requests resume from their last committed tokens, each alone from then on; one whose
step fails alone fails. An exception in the controller itself (a bug) fails only what the event
it was handling concerned: one request, or one instance (taken out and replaced); the
controller goes on (`_survive`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from dilaserve.cluster.backends import Backend, WorkerEvent, start_all
from dilaserve.cluster.config import ClusterConfig, make_backend
from dilaserve.cluster.intake import Intake, longest_token_chars
from dilaserve.cluster.replacements import Replacements
from dilaserve.cluster.requests import (
    FULL,
    Answers,
    Closed,
    InvalidRequest,
    Observer,
    Overloaded,
    Recording,
    RequestHandle,
)
from dilaserve.control.admission import LOWEST_PRIORITY, Admission, Room
from dilaserve.control.build import build_scheduler
from dilaserve.control.decisions import DecisionLog, Decisions, InstanceSpec
from dilaserve.control.rollout import Rollout
from dilaserve.protocol import StepBatch, StepOutput

log = logging.getLogger("dilaserve.cluster")
STEP_TIMES_KEPT = 100_000  # steps whose timings a cluster keeps (the latest)


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


class Cluster:
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
        self.intake = self._intake(model_config)
        self.observer = observer
        self.answers = Answers(self.tokenizer, observer)
        self.rollout = Rollout(self.scheduler, self, config.max_batch_tokens)
        self.admission = Admission(self.scheduler, config.overload)
        self.step_timeout = config.derived_step_timeout(self.scheduler.profile)
        self.log = DecisionLog(keep_lines=config.record)
        self.recording = Recording() if config.record else None
        self.stats = {
            "failures": 0,
            "failed_steps": 0,
            "migrations": 0,
            "reconfigurations": 0,
            "controller_errors": 0,  # exceptions in the controller (survived: see `_survive`)
            "refused": 0,  # over capacity at admission (`admission`), refused
            "deprioritized": 0,  # over capacity at admission, served last
        }
        # (round trip, engine seconds) of the latest steps: bounded, for a server that runs on
        self.step_times: deque[tuple[float, float]] = deque(maxlen=STEP_TIMES_KEPT)
        self.steps_run = 0
        self.instance_log: list[tuple[float, dict[int, int]]] = []
        self._handles: dict[str, RequestHandle] = {}
        self._specs: dict[str, InstanceSpec] = {}  # starting or running
        self._inflight: dict[str, tuple[float, StepBatch]] = {}
        self._hung: set[str] = set()  # killed for a step past `step_timeout`, death not yet seen
        self._arrivals: deque[RequestHandle] = deque()
        self._cancels: deque[str] = deque()
        self._accepting = False
        self._events: deque[WorkerEvent] = deque()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._last = 0.0
        self._next_id = 0
        self.replacements = Replacements()
        self._handling: tuple[str, object] = ("start", None)  # what the controller is handling
        self._room = Room()  # admission's answer between events (`is_full`)

    def _intake(self, model_config) -> Intake:
        config = self.config
        return Intake(
            self.tokenizer,
            self.block_len,
            model_config.max_sequence_length,
            config.max_tokens,
            model_config.vocab_size,
            config.dws_estimator(),
            config.dws_prior,
            longest_token_chars(self.tokenizer),
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Load the initial instances (waiting until all are up), then start serving."""
        specs = self.config.initial_specs()
        start_all(self.backend, specs, self.config.start_timeout)
        self._t0 = time.perf_counter()
        for spec in specs:
            self._specs[spec.instance_id] = spec
            self.rollout.add(spec, 0.0)
        self._next_tick = self.config.tick
        self._thread = threading.Thread(target=self._run, name="dilaserve-controller", daemon=True)
        self._thread.start()
        self._accepting = True
        log.info(
            "cluster up: %d instances %s; a step past %.1f s counts as hung",
            len(specs),
            [s.tp for s in specs],
            self.step_timeout,
        )
        return self

    def drain(self, timeout: float) -> bool:
        """Take no new requests and wait up to `timeout` s for those in flight; all done?"""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._handles and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._handles

    @property
    def accepting(self) -> bool:
        return self._accepting

    def health(self) -> str:
        """Says "ok"; "degraded": lost capacity not yet restored; "unavailable": not accepting
        requests, or every instance lost (a planned reconfiguration may briefly run none)."""
        if not self._accepting or self._all_lost():
            return "unavailable"
        return "degraded" if self.replacements.pending else "ok"

    def _all_lost(self) -> bool:
        return not self.scheduler.instances and self.replacements.pending

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    def queue_length(self) -> int:
        """Requests waiting to be placed on an instance."""
        return len(self._arrivals) + len(self.scheduler._ready)

    @property
    def step_slowdown(self) -> float:
        """Steps' measured time over the latency profile's, running (`control/speed.py`)."""
        return self.scheduler.speed.ratio

    @property
    def step_time_ratio(self) -> float:
        """Steps' measured time over the profile's, geometric mean over every step so far."""
        return self.scheduler.speed.run_ratio

    def instances_by_tp(self) -> dict[int, int]:
        return dict(self.instance_log[-1][1]) if self.instance_log else {}

    def close(self, timeout: float = 30.0) -> None:
        """Stop serving; requests still in flight fail with `Closed`. Closing twice is once."""
        self._accepting = False
        if self._closing.is_set():
            return
        self._closing.set()
        self.backend.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        error = Closed("the server shut down before the request finished")
        for handle in list(self._handles.values()):
            self._fail(handle, error)
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
        received: float | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestHandle:
        """Queue a request (thread-safe). `max_tokens` is the output window, rounded up to
        whole blocks; `slo` seconds from now (default: the scheduler's). `threshold` pins the
        confidence threshold; `min_threshold`/`max_threshold` bound what the policy may pick.
        `text`: the user's prompt text for the DWS predictor (default: `prompt` if a string).
        `stop`: up to 4 strings; the answer ends before the first of them, and the request
        stops being worked on once one is committed. `received`: the `time.perf_counter()` at
        which the request reached the caller (its latency and SLO count from there; default:
        now). `loop`: the event loop to stream to (default: the caller's, if it runs in one).

        Raises ValueError naming a bad argument, `Overloaded` when admission control refuses
        work, and `Closed` when the cluster is not serving."""
        if self.is_full(priority):  # before any work on it, tokenizing included
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
        )
        with self._lock:
            handle = self._register(submission, request_id, received, loop)
        self.backend.wake()
        return handle

    def _register(self, submission, request_id, received, loop) -> RequestHandle:
        """A checked submission becomes a request in flight, queued for the controller (under
        `_lock`): refused while closed, with nothing serving, or at `max_in_flight`."""
        if not self._accepting:
            raise Closed("the cluster is not accepting requests")
        if self._all_lost():
            raise Closed("no instance is serving (lost capacity is being restored)")
        if len(self._handles) >= self.config.max_in_flight:
            raise Overloaded(f"{len(self._handles)} requests in flight (the limit)")
        rid = request_id or f"req-{self._next_id}"
        self._next_id += 1
        if rid in self._handles:
            raise InvalidRequest("request_id", f"request_id {rid!r} is already in flight")
        submitted = self.now() if received is None else min(self.now(), received - self._t0)
        request = submission.request(
            rid, submitted, self.block_len, self.tokenizer.special.mask, self.aligned_blocks
        )
        handle = RequestHandle(request, submitted, submission.stop, loop)
        self._handles[rid] = handle
        self._arrivals.append(handle)
        return handle

    def cancel(self, request_id: str) -> None:
        """Stop working on a request (thread-safe; e.g. its client went away)."""
        self._cancels.append(request_id)
        self.backend.wake()

    # -- the controller loop -----------------------------------------------------------------

    def _clock(self) -> float:
        """Now, strictly after the last event (so that events keep their order in replay)."""
        now = max(self.now(), self._last + 1e-9)
        self._last = now
        return now

    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                self._next_event()
                if self._handling[0] != "poll":  # the load or the instances may have changed
                    self._room = self.admission.room()
            except Exception as e:  # a controller bug: fail what it concerned, never the rest
                self._survive(e)

    def _next_event(self) -> None:
        now = self._clock()
        if now >= self._next_tick:
            self._handling = ("tick", None)
            self._last = self._next_tick
            self._next_tick += self.config.tick
            self._tick(self._last)
        elif self._arrivals:
            self._handling = ("arrival", self._arrivals.popleft())
            self._admit(self._handling[1], now)
        elif self._cancels:
            self._handling = ("cancel", self._cancels.popleft())
            self._cancel(self._handling[1], now)
        elif self._events:
            self._handling = ("event", self._events.popleft())
            self._on_event(self._handling[1], now)
        else:
            self._handling = ("poll", None)
            self._events.extend(self.backend.poll(self._next_tick - now))

    def _survive(self, error: Exception) -> None:
        """An exception while handling one event fails only what the event concerned: an
        arrival's or a cancellation's request fails; an instance's event takes the instance out
        (killed: its requests resume elsewhere and it is replaced, as when it dies); a tick's
        round is skipped. The controller goes on."""
        self.stats["controller_errors"] += 1
        kind, what = self._handling
        log.exception("controller error handling a %s (survived)", kind)
        if kind == "arrival":
            self._drop(what.request_id, error)
        elif kind == "cancel":
            self._drop(what, error)
        elif kind == "event" and what.instance_id in self._specs:
            self._hung.add(what.instance_id)
            self.backend.kill(what.instance_id)

    def _drop(self, rid: str, error: Exception) -> None:
        """Fail one request after a controller error, forgetting it in the scheduler."""
        try:
            if rid in self.scheduler.requests:
                self.apply(self.scheduler.cancel(rid), self._last, f"c{rid}")
        except Exception:
            log.exception("could not cancel request %s", rid)
        handle = self._handles.get(rid)
        if handle is not None:
            message = f"request {rid} failed: internal error ({type(error).__name__}: {error})"
            self._fail(handle, RuntimeError(message))

    def _tick(self, now: float) -> None:
        self.apply(self.scheduler.on_tick(now), now, "t")
        for replacement in self.replacements.due(now):
            self._replace("(retry)", replacement, now)
        for iid, (launched, _) in self._inflight.items():
            if now - launched > self.step_timeout and iid not in self._hung:
                log.error(
                    "instance %s: a step has run %.0f s; killing it as hung", iid, now - launched
                )
                self._hung.add(iid)  # its death is reported, and handled, as any other
                self.backend.kill(iid)

    def _admit(self, handle: RequestHandle, now: float) -> None:
        request = handle.request
        request.arrival_time = now
        if not self._within_capacity(handle, now):
            return
        handle.admission.set_result(None)
        if self.recording is not None:
            self.recording.requests.append(request.fresh())
        self.apply(self.scheduler.on_arrival(request, now), now, f"a{request.request_id}")

    def _within_capacity(self, handle: RequestHandle, now: float) -> bool:
        """Admission by capacity (`admission`): a request that cannot meet its SLO is refused,
        or served last."""
        try:
            refusal = self.admission.refusal(handle.request, now)
        except Exception:  # a bug in the check must not fail the request: admit it
            self.stats["controller_errors"] += 1
            log.exception("admission check of request %s failed; admitted", handle.request_id)
            return True
        if refusal is None:
            return True
        if self.admission.mode == "deprioritize":
            self.stats["deprioritized"] += 1
            handle.request.priority = LOWEST_PRIORITY
            return True
        self.stats["refused"] += 1
        self._handles.pop(handle.request_id, None)
        self.answers.refuse(handle, Overloaded(f"cannot meet its SLO now: {refusal}"))
        return False

    def is_full(self, priority: int) -> bool:
        """Would a request of `priority` be refused now? (`admission.Room`: it comes after
        everything in flight, and the capacity left as of the controller's last event is
        below the least a request adds.)"""
        return isinstance(priority, int) and self._room.refuses(priority)

    def _cancel(self, rid: str, now: float) -> None:
        handle = self._handles.get(rid)
        if handle is None:
            return  # finished meanwhile
        if rid in self.scheduler.requests:
            self.apply(self.scheduler.cancel(rid), now, f"c{rid}")
        self._fail(handle, concurrent.futures.CancelledError(f"request {rid} was cancelled"))

    def _on_event(self, event: WorkerEvent, now: float) -> None:
        iid = event.instance_id
        if event.kind == "up":
            self.replacements.up(iid)
            if iid in self._specs:
                self.rollout.on_up(self._specs[iid], now)
        elif event.kind == "done":
            self._step_done(iid, event, now)
        elif event.kind == "failed" and iid in self._inflight:
            self._step_failed(iid, event.error, now)
        else:  # died, or failed to load
            self._instance_failed(iid, event.error, now)

    def _step_done(self, iid: str, event: WorkerEvent, now: float) -> None:
        if iid not in self.scheduler.instances:
            return  # removed meanwhile; its requests already moved on
        launched, batch = self._inflight.pop(iid)
        self.step_times.append((now - launched, event.seconds))
        self.steps_run += 1
        tp = self.scheduler.instances[iid].tp
        if self.config.measured_speed:  # the step's cost, end to end
            self.scheduler.speed.observe(tp, batch, now - launched)
        if self.observer is not None:
            self.observer.step_done(iid, tp, event.output, event.seconds)
        if self.recording is not None:
            self.recording.launches.append((iid, launched, now, event.output.results))
        decisions = self.scheduler.on_step_done(iid, event.output, now)
        self.apply(decisions, now, f"d{iid}")
        for result in event.output.results:  # stream what they committed
            rid = result.request_id
            handle = self._handles.get(rid)
            if handle is None or handle.request.is_finished or not self.answers.stream(handle):
                continue
            self.apply(self.scheduler.cancel(rid), now, f"c{rid}")  # a stop string came
            self._finish(rid, now)
        self.rollout.on_step_done(iid, now)

    def _step_failed(self, iid: str, error: str, now: float) -> None:
        """The engine rejected a batch; the instance goes on. Which request broke it is
        unknown, so each of a batch retries alone, and a request that fails alone fails."""
        _, batch = self._inflight.pop(iid)
        self.stats["failed_steps"] += 1
        log.error("step on instance %s failed: %s", iid, error)
        live = [i.request_id for i in batch.items if i.request_id in self.scheduler.requests]
        if len(live) > 1:
            self.apply(self.scheduler.retry_alone(iid, live, now), now, f"r{iid}")
        else:
            for rid in live:
                self.apply(self.scheduler.cancel(rid), now, f"c{rid}")
                handle = self._handles.get(rid)
                if handle is not None:
                    self._fail(handle, RuntimeError(f"request {rid} failed: {error}"))
            self.apply(self.scheduler.on_step_done(iid, StepOutput((), 0), now), now, f"d{iid}")
        self.rollout.on_step_done(iid, now)

    def _instance_failed(self, iid: str, error: str, now: float) -> None:
        if iid not in self._specs and iid not in self.scheduler.instances:
            return  # already handled (a failed load is reported, then its exit)
        self.stats["failures"] += 1
        log.error("instance %s failed: %s", iid, error)
        self._inflight.pop(iid, None)
        self._hung.discard(iid)
        spec = self._specs.pop(iid, None)
        was_serving = iid in self.scheduler.instances  # not one that failed to load
        self.rollout.on_failed(iid, now)
        if spec is None or not self.config.replace_failed or self._closing.is_set():
            return
        replacement = self.replacements.lost(spec, was_serving, now)
        if replacement is not None:
            self._replace(iid, replacement, now)

    def _replace(self, iid: str, replacement: InstanceSpec, now: float) -> None:
        log.info("replacing instance %s with %s", iid, replacement.instance_id)
        self.rollout.replace(replacement, now)

    # -- carrying out decisions (also what `Rollout` calls) ----------------------------------

    def apply(self, d: Decisions, now: float, event: str) -> None:
        self.log.record(now, event, d)
        for instance_id, rid in d.releases:
            self.stats["migrations"] += 1
            self.backend.release(instance_id, [rid])
        for launch in d.launches:
            self._inflight[launch.instance_id] = (now, launch.batch)
            self.backend.step(launch.instance_id, launch.batch)
        for rid in d.finished:
            self._finish(rid, now)
        if d.reconfiguration is not None and self.rollout.begin(d.reconfiguration, now):
            self.stats["reconfigurations"] += 1
            log.info("reconfiguring to %s", d.reconfiguration.target)

    def start_instance(self, spec: InstanceSpec, now: float) -> None:
        self._specs[spec.instance_id] = spec
        try:
            self.backend.start(spec)
        except Exception as e:  # e.g. no file descriptors or memory to spawn a process
            log.exception("could not start instance %s", spec.instance_id)
            self._events.append(WorkerEvent("died", spec.instance_id, error=f"not started: {e}"))

    def instance_added(self, spec: InstanceSpec, now: float) -> None:
        self._log_instances(now)

    def instance_removed(self, instance_id: str, now: float) -> None:
        self._specs.pop(instance_id, None)
        self._inflight.pop(instance_id, None)
        self.backend.stop(instance_id)
        self._log_instances(now)

    def _log_instances(self, now: float) -> None:
        self.instance_log.append((now, self.scheduler.instances_by_tp()))

    # -- results -----------------------------------------------------------------------------

    def _finish(self, rid: str, now: float) -> None:
        handle = self._handles.pop(rid, None)
        if handle is not None:
            self.answers.finish(handle, now)

    def _fail(self, handle: RequestHandle, error: BaseException) -> None:
        self._handles.pop(handle.request_id, None)
        self.answers.fail(handle, error)
