"""The cluster's controller: what its one thread does, from events in to decisions carried out.

`Controller.run` turns what happens into the scheduler's events, one at a time and each at its
own clock reading: requests that `Cluster` queued from any thread (`on_arrival`, once admitted
by capacity: `control.admission`), their cancellations, steps that instances report done
(`on_step_done`), ticks every `tick` seconds (`on_tick`: deferred requests, planner rounds) and
instances coming up or dying. It carries out the decisions (steps sent without waiting, releases,
finished requests, reconfigurations through the simulator's `Rollout`) and streams answers
(`Answers`). `Cluster` queues requests and owns the clock (`now`). A run, recorded, replays
in the simulator to the same decision log (`sim.replay`); that is tested.

Faults: a dead instance's requests continue elsewhere from their last committed tokens (its
running step is lost), the failure is counted and logged, and a replacement with the same GPUs
is started (`replace_failed`; retried with backoff: `replacements`); an instance whose step
runs past its step timeout (`HangWatch.timeout_of`: the configured or derived timeout times its
measured slowdown) is killed as hung, the last one serving only past `LAST_INSTANCE_GRACE`
times that (`hangs.py`): slowness alone never leaves none. If the engine raises on a step, its
requests resume, each alone from then on; one whose step fails alone fails. An exception in
the controller (a bug) fails only what its event concerned, one request or one instance (taken
out and replaced), and it goes on (`_survive`). A stall of its own: `stalls.py`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import Callable

from dilaserve.cluster.backends import Backend, WorkerEvent
from dilaserve.cluster.config import ClusterConfig
from dilaserve.cluster.gate import Admitting
from dilaserve.cluster.hangs import HangWatch
from dilaserve.cluster.replacements import Replacements
from dilaserve.cluster.requests import Answers, Observer, Recording, RequestHandle
from dilaserve.cluster.stalls import StallWatch
from dilaserve.control.admission import Admission
from dilaserve.control.decision_log import DecisionLog
from dilaserve.control.decisions import Decisions, InstanceSpec
from dilaserve.control.rollout import Rollout
from dilaserve.control.scheduler import Scheduler
from dilaserve.protocol import StepBatch, StepOutput

log = logging.getLogger("dilaserve.cluster")
STEP_TIMES_KEPT = 100_000  # steps whose timings a cluster keeps (the latest)
# s: while arrivals or cancellations queue, the instances' events are read at least this often
# and handled first, so that an instance does not wait on a burst for its next step
READ_EVENTS_EVERY = 0.002


class Controller:
    """`now`: the cluster's clock (seconds since it started serving). `Cluster` adds to
    `handles`, `arrivals` and `cancels` from the callers' threads (the controller's thread
    takes them out), reads `admitting` (its `room`) and `replacements`, and sets `closing` to
    stop `run`."""

    def __init__(
        self,
        config: ClusterConfig,
        scheduler: Scheduler,
        backend: Backend,
        answers: Answers,
        observer: Observer | None,
        now: Callable[[], float],
    ):
        self.config = config
        self.scheduler = scheduler
        self.backend = backend
        self.answers = answers
        self.observer = observer
        self.now = now
        self.rollout = Rollout(scheduler, self, config.max_batch_tokens)
        self.replacements = Replacements()
        self.admission = Admission(scheduler, config.overload, model=config.admission_time,
                                   restoring=lambda: self.replacements.pending)  # fmt: skip
        self.stalls = StallWatch(config.tick)
        self.hangs = HangWatch(config.derived_step_timeout(scheduler.profile), scheduler.speed)
        self.log = DecisionLog(keep_lines=config.record)
        self.recording = Recording() if config.record else None
        self.stats = {
            "failures": 0,
            "failed_steps": 0,
            "migrations": 0,
            "reconfigurations": 0,
            "controller_errors": 0,  # exceptions in the controller (survived: see `_survive`)
            "refused": 0,  # over capacity at admission (`admission`), refused
            "refused_invalid": 0,  # of those, with an SLO no idle cluster meets (a 400)
            "deprioritized": 0,  # over capacity at admission, served last
        }
        # (round trip, engine seconds) of the latest steps: bounded, for a server that runs on
        self.step_times: deque[tuple[float, float]] = deque(maxlen=STEP_TIMES_KEPT)
        self.steps_run = 0
        self.instance_log: list[tuple[float, dict[int, int]]] = []
        self.handles: dict[str, RequestHandle] = {}  # requests in flight, by id
        self.arrivals: deque[RequestHandle] = deque()
        self.cancels: deque[str] = deque()
        self.closing = threading.Event()  # `run` returns once it is set
        self.restored_after: float | None = None  # the latest replacement: seconds lost to up
        # the room the front asks, and admission of each arrival (`gate.py`)
        self.admitting = Admitting(
            self.admission, answers, self.handles, self.stats, self.recording, config.admission_wait
        )
        self._specs: dict[str, InstanceSpec] = {}  # starting or running
        self._started_at: dict[str, float] = {}  # starting: when (the planner prices starts)
        self._inflight: dict[str, tuple[float, StepBatch]] = {}
        self._events: deque[WorkerEvent] = deque()
        self._read_at = 0.0  # when the instances' events were last read
        self._last = 0.0
        self._handling: tuple[str, object] = ("start", None)  # what the controller is handling

    def start(self, specs: list[InstanceSpec]) -> None:
        """Take in the initial instances, up at clock zero (before `run`)."""
        for spec in specs:
            self._specs[spec.instance_id] = spec
            self.rollout.add(spec, 0.0)
        self._next_tick = self.config.tick

    # -- the controller loop -----------------------------------------------------------------

    def _clock(self) -> float:
        """Now, strictly after the last event (so that events keep their order in replay)."""
        now = max(self.now(), self._last + 1e-9)
        self._last = now
        return now

    def run(self) -> None:
        """The controller thread: one event at a time until `closing` is set."""
        while not self.closing.is_set():
            self.run_once()

    def run_once(self) -> None:
        """One event (or a wait for one), then the front's `room` priced again if the event
        may have changed it (`Admitting.price_room`)."""
        try:
            began = self.now()
            self._next_event()
            if self._handling[0] != "poll":  # the load or the instances may have changed
                if self.stalls.handled(began, self.now(), self._inflight):
                    self._void_timings()  # it held up every result (`stalls.py`)
                    self.admitting.pace.stalled(self.now())  # and every arrival
                self.admitting.stale = True
            self.admitting.price_room(self._last, self._queued(), self.arrivals)
        except Exception as e:  # a controller bug: fail what it concerned, never the rest
            self._survive(e)

    def _queued(self) -> bool:
        """Whether an arrival, a cancellation or an instance's event waits to be handled."""
        return bool(self.arrivals or self.cancels or self._events)

    def _next_event(self) -> None:
        """A tick when due; else an instance's event (its step has ended: until it is handled
        the instance waits), an arrival, a cancellation; else a wait for the instances' events
        (docs/cluster.md: 300 arrivals first once held both instances idle for 0.3 s)."""
        now = self._clock()
        if now >= self._next_tick:
            self._handling = ("tick", None)
            self._last = self._next_tick
            self._next_tick += self.config.tick
            self._tick(self._last)
            return
        self._handling = ("poll", None)
        if (self.arrivals or self.cancels) and now - self._read_at >= READ_EVENTS_EVERY:
            self._read_events(0.0)
        if self._events:
            self._handling = ("event", self._events.popleft())
            self._on_event(self._handling[1], now)
        elif self.arrivals:
            self._handling = ("arrival", self.arrivals.popleft())
            self._admit(self._handling[1], now)
        elif self.cancels:
            self._handling = ("cancel", self.cancels.popleft())
            self._cancel(self._handling[1], now)
        else:
            self._read_events(self._next_tick - now)

    def _read_events(self, timeout: float) -> None:
        """The instances' events, waiting up to `timeout` seconds for one."""
        self._events.extend(self.backend.poll(timeout))
        self._read_at = self.now()

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
            self.hangs.hung.add(what.instance_id)
            self.backend.kill(what.instance_id)

    def _drop(self, rid: str, error: Exception) -> None:
        """Fail one request after a controller error, forgetting it in the scheduler."""
        try:
            if rid in self.scheduler.requests:
                self.apply(self.scheduler.cancel(rid), self._last, f"c{rid}")
        except Exception:
            log.exception("could not cancel request %s", rid)
        handle = self.handles.get(rid)
        if handle is not None:
            message = f"request {rid} failed: internal error ({type(error).__name__}: {error})"
            self.fail(handle, RuntimeError(message))

    def _tick(self, now: float) -> None:
        speed = self.scheduler.speed
        for iid, inst in self.scheduler.instances.items():  # (the tick stalls these)
            if inst.takes_work and inst.overdue(now, speed.instance_ratio(iid)):
                self._void_timings()  # a stall is a fault too
        self.apply(self.scheduler.on_tick(now), now, "t")
        for replacement in self.replacements.due(now):
            self._replace("(retry)", replacement, now)
        launched = {iid: start for iid, (start, _) in self._inflight.items()}
        for iid in self.hangs.to_kill(launched, self.scheduler.instances, now):
            self.backend.kill(iid)

    def _admit(self, handle: RequestHandle, now: float) -> None:
        request = handle.request
        request.arrival_time = now
        if not self.admitting.within_capacity(handle, now):
            return
        handle.admission.set_result(None)
        self.admission.admitted(request, now)
        if self.recording is not None:
            self.recording.requests.append(request.fresh())
        self.apply(self.scheduler.on_arrival(request, now), now, f"a{request.request_id}")

    def _cancel(self, rid: str, now: float) -> None:
        handle = self.handles.get(rid)
        if handle is None:
            return  # finished meanwhile
        if rid in self.scheduler.requests:
            self.apply(self.scheduler.cancel(rid), now, f"c{rid}")
        self.fail(handle, concurrent.futures.CancelledError(f"request {rid} was cancelled"))

    def _on_event(self, event: WorkerEvent, now: float) -> None:
        iid = event.instance_id
        if event.kind == "up":
            if self.replacements.pending:  # (lost capacity restored)
                self._void_timings()
            restored = self.replacements.up(iid, now)
            if restored is not None:
                self.restored_after = restored
                log.info("instance %s up: lost capacity restored after %.2f s", iid, restored)
            self._measure_start(iid, now)
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
        self.hangs.stepped(iid)
        self.step_times.append((now - launched, event.seconds))
        self.steps_run += 1
        tp = self.scheduler.instances[iid].tp
        if not self.is_whole:  # what they take now is the fault's
            self._void_timings(item.request_id for item in batch.items)
        measured = self.stalls.measured(iid)  # (not across a stall of ours: `stalls.py`)
        if self.config.measured_speed and measured:  # the step's cost, end to end
            self.scheduler.speed.observe(tp, batch, now - launched, iid, now)
        if self.observer is not None:
            self.observer.step_done(iid, tp, event.output, event.seconds)
        if self.recording is not None:
            self.recording.launches.append((iid, launched, now, event.output.results))
            if not measured:
                self.recording.unmeasured.add((iid, launched))
        decisions = self.scheduler.on_step_done(iid, event.output, now)
        self.apply(decisions, now, f"d{iid}")
        for result in event.output.results:  # stream what they committed
            rid = result.request_id
            handle = self.handles.get(rid)
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
                handle = self.handles.get(rid)
                if handle is not None:
                    self.fail(handle, RuntimeError(f"request {rid} failed: {error}"))
            self.apply(self.scheduler.on_step_done(iid, StepOutput((), 0), now), now, f"d{iid}")
        self.rollout.on_step_done(iid, now)

    def _instance_failed(self, iid: str, error: str, now: float) -> None:
        if iid not in self._specs and iid not in self.scheduler.instances:
            return  # already handled (a failed load is reported, then its exit)
        self.stats["failures"] += 1
        log.error("instance %s failed: %s", iid, error)
        if iid in self.scheduler.instances:
            self._void_timings()
        self._inflight.pop(iid, None)
        self.hangs.gone(iid)
        spec = self._specs.pop(iid, None)
        self._started_at.pop(iid, None)
        was_serving = iid in self.scheduler.instances  # not one that failed to load
        self.rollout.on_failed(iid, now)
        if spec is None or not self.config.replace_failed or self.closing.is_set():
            return
        replacement = self.replacements.lost(spec, was_serving, now)
        if replacement is not None:
            self._replace(iid, replacement, now)

    def _void_timings(self, only=None) -> None:
        """A fault begins or ends (an instance stalled, died or is replaced), or the controller
        stalled (`stalls.py`): the requests in flight (`only` these) teach no on-time factor."""
        voided = self.admission.void(self.scheduler.requests if only is None else only)
        if self.recording is not None:
            self.recording.voided.update(voided)

    @property
    def is_whole(self) -> bool:
        """No instance stalled or being replaced (else the requests that step teach nothing)."""
        return not (self.replacements.pending or self.scheduler.num_stalled)

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
            self.stalls.launched(launch.instance_id)
            self._inflight[launch.instance_id] = (now, launch.batch)
            self.backend.step(launch.instance_id, launch.batch)
        for rid in d.finished:
            self._finish(rid, now)
        if d.reconfiguration is not None and self.rollout.begin(d.reconfiguration, now):
            self.stats["reconfigurations"] += 1
            log.info("reconfiguring to %s", d.reconfiguration.target)

    def start_instance(self, spec: InstanceSpec, now: float) -> None:
        self._specs[spec.instance_id] = spec
        self._started_at[spec.instance_id] = now
        try:
            self.backend.start(spec)
        except Exception as e:  # e.g. no file descriptors or memory to spawn a process
            log.exception("could not start instance %s", spec.instance_id)
            self._events.append(WorkerEvent("died", spec.instance_id, error=f"not started: {e}"))

    def _measure_start(self, iid: str, now: float) -> None:
        """An instance is up: its start-up, measured, prices the planner's next moves."""
        started = self._started_at.pop(iid, None)
        reconfigurer = self.scheduler.reconfigurer
        if started is not None and reconfigurer is not None:
            reconfigurer.started(now - started)

    def instance_added(self, spec: InstanceSpec, now: float) -> None:
        self._log_instances(now)

    def instance_removed(self, instance_id: str, now: float) -> None:
        self._specs.pop(instance_id, None)
        self._started_at.pop(instance_id, None)
        self._inflight.pop(instance_id, None)
        self.backend.stop(instance_id)
        self._log_instances(now)

    def _log_instances(self, now: float) -> None:
        self.instance_log.append((now, self.scheduler.instances_by_tp()))

    # -- results -----------------------------------------------------------------------------

    def _finish(self, rid: str, now: float) -> None:
        handle = self.handles.pop(rid, None)
        self.admission.finished(rid, now)
        if handle is not None:
            self.answers.finish(handle, now)

    def fail(self, handle: RequestHandle, error: BaseException) -> None:
        self.handles.pop(handle.request_id, None)
        self.admission.dropped(handle.request_id)
        self.answers.fail(handle, error)
