"""The cluster scheduler: a state machine over events, returning decisions (DESIGN section 3).

Events: `on_arrival(request, now)`, `on_step_done(instance_id, output, now)`, `on_tick(now)`.
Each returns `Decisions`: which requests run their next step on which instance at which
threshold (`StepLaunch`), which instances must drop a request's state (it moved away), which
requests finished, and (from `on_tick`, every planning period) a cluster `Reconfiguration`.
It never reads a clock and never does I/O; the simulator and the cluster runtime drive it alike.

On every event the ready requests (new, or whose step just finished) are placed (Alg. 3,
`placement.py`; a request whose next step is a cache step stays with its approximate cache), a
lost one after the others where the policy says so (`lost_work.py`). Predictions refresh and
load control (Alg. 2/4) re-runs in `load_control.py`; the threshold (Alg. 1/5, `selection.py`)
is re-selected whenever a request moves or its predictions refresh. Each instance's gathered
batch keeps its own books (`instance.py`); an instance whose running step is far overdue
(`InstanceState.overdue`) takes no new work until it ends, and a tick moves its batch elsewhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import replace

from dilaserve.control.decisions import Decisions, SchedulerConfig, StepLaunch
from dilaserve.control.instance import InstanceState
from dilaserve.control.layout import InstanceSlot
from dilaserve.control.load_control import LoadControl
from dilaserve.control.lost_work import Lost, LostWork
from dilaserve.control.placement import Placer
from dilaserve.control.policy import Migration, Order, Policy
from dilaserve.control.profile import LatencyProfile
from dilaserve.control.reconfigure import Reconfigurer
from dilaserve.control.selection import ThresholdSelection
from dilaserve.control.speed import MeasuredSpeed
from dilaserve.control.tracked import Tracked
from dilaserve.protocol import StepBatch, StepItem, StepKind, StepOutput
from dilaserve.request import Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        policy: Policy,
        profile: LatencyProfile,
        predictor,
        config: SchedulerConfig = SchedulerConfig(),
        reconfigurer: Reconfigurer | None = None,
    ):
        self.policy = policy
        self.profile = profile
        self.config = config
        self.reconfigurer = reconfigurer if policy.reconfigure else None
        self.instances: dict[str, InstanceState] = {}
        self._batch_limits: dict[int, tuple[int, int | None]] = {}  # tp -> the plan's batch
        self._open: list[InstanceState] = []  # instances that take new work (`takes_work`)
        self.requests: dict[str, Tracked] = {}
        self._ready: list[str] = []
        self._solo: set[str] = set()  # requests whose steps run alone (after a failed batch)
        self._ladder = tuple(sorted(policy.candidates, reverse=True))
        self._costs = config.costs
        self.speed = MeasuredSpeed(profile, self._costs, self.requests)  # the runtime reports
        # mid-block steps stay with an approximate cache, unless migration may happen anywhere
        # (an exact cache moves at the price of a prefill: placement weighs it every step)
        self._short_path = policy.migration is not Migration.ANY and self._costs.stays_with_cache(
            self._costs.inner_kind
        )
        self._admitted = 0
        # predictions and load control (Alg. 2/4; admission asks it the same question): dynamic
        # thresholds only, a fixed one needs neither
        self.load_control = (
            LoadControl(
                self._ladder,
                predictor,
                profile,
                config,
                self.requests,
                policy.load_control,
                policy.load_window,
                self.speed,
                policy.last_block_caps,
            )
            if policy.is_dynamic
            else None
        )
        self._placer = Placer(
            policy, config, self.instances, self.requests, self._solo, self.speed, self.load_control
        )
        self._selection = ThresholdSelection(policy, profile, config, self.speed, self.load_control)
        self.deadline = self._selection.deadline  # Alg. 1's calibration (None: point estimate)
        self.quality = self._selection.quality  # the quality budget (None: none)
        self.lost_work = None  # served after the requests still on time (`lost_work.py`), or alike
        if policy.lost_work is not Lost.NEVER and policy.is_dynamic:
            fixed = policy.order is Order.ARRIVAL
            self.lost_work = LostWork(
                policy.lost_work, self._placer, self._selection, self._move, fixed
            )

    # -- instances ---------------------------------------------------------------------------

    def add_instance(
        self,
        instance_id: str,
        tp: int,
        max_batch_tokens: int,
        node: int = 0,
        gpus: tuple[int, ...] = (),
    ) -> None:
        """An instance is up and takes work. `node` and `gpus` tell the planner where it is."""
        if instance_id in self.instances:
            raise ValueError(f"instance {instance_id} already exists")
        full_curve = self.profile.curve(tp, self._costs.sequence_kind)  # a missing TP fails here
        cache_curve = None
        if self._costs.cached:
            cache_curve = self.profile.curve(tp, self._costs.inner_kind)
        planned = self._batch_limits.get(tp)
        self.instances[instance_id] = InstanceState(
            instance_id, tp, max_batch_tokens, full_curve, cache_curve, node, gpus, planned
        )
        self._open = self._open_instances()

    def set_batch_limits(self, limits: dict[int, tuple[int, int | None]]) -> None:
        """The plan's Alg. 3 maxBatchSize per TP degree (`Reconfiguration.batch_limits`), for the
        instances up and to come; a degree it leaves out keeps its own limit."""
        self._batch_limits = dict(limits)
        for inst in self.instances.values():
            inst.planned_batch = self._batch_limits.get(inst.tp)

    def remove_instance(self, instance_id: str, now: float) -> Decisions:
        """Forget an instance (stopped, or failed: its running step is lost); its requests
        resume elsewhere from their last committed tokens."""
        inst = self.instances.pop(instance_id)
        self._open = self._open_instances()
        for rid in inst.holds | set(inst.pending):
            self._orphan(rid)
        return self._schedule(now, load_changed=True)

    def drain_instance(self, instance_id: str, now: float) -> Decisions:
        """Stop giving an instance new work: its waiting batch goes elsewhere, its running step
        finishes, and its requests move on at their next recompute step (cache steps stay with
        their cache). Remove it once `is_idle`: nothing running, gathered or held there."""
        inst = self.instances[instance_id]
        inst.draining = True
        self._open = self._open_instances()
        for rid in inst.clear():
            self._orphan(rid)
            inst.holds.discard(rid)
        return self._schedule(now, load_changed=True)

    def instances_by_tp(self) -> dict[int, int]:
        """How many instances of each TP degree are up, by degree."""
        return dict(sorted(Counter(inst.tp for inst in self.instances.values()).items()))

    def is_idle(self, instance_id: str) -> bool:
        """Nothing runs or is gathered there, and no request there is mid-block (its next step
        a cache step, which stays with its cache). Requests whose next step is a recompute
        step do not hold an instance up: they resume elsewhere when it goes."""
        inst = self.instances[instance_id]
        if inst.busy or inst.pending:
            return False
        if not self._short_path:  # its requests may move at any step
            return True
        return all(
            self.requests[rid].request.starts_block for rid in inst.holds if rid in self.requests
        )

    def _move(self, t: Tracked, to: InstanceState | None) -> None:
        """Re-home a request, keeping each instance's resident counts."""
        old = self.instances.get(t.instance) if t.instance is not None else None
        if old is not None:
            old.residents -= 1
            old.resident_tokens -= t.request.num_tokens
            old.lost_residents -= t.lost
        if to is not None:
            to.residents += 1
            to.resident_tokens += t.request.num_tokens
            to.lost_residents += t.lost
        t.instance = None if to is None else to.instance_id
        if self.lost_work is not None:
            self.lost_work.moved()

    def _orphan(self, rid: str) -> None:
        t = self.requests[rid]
        self._move(t, None)
        t.bound = None
        t.needs_threshold = True
        parked = self.lost_work is not None and self.lost_work.unpark(rid)
        if parked or rid not in self._ready:
            self._ready.append(rid)

    def _open_instances(self) -> list[InstanceState]:
        return [i for i in self.instances.values() if i.takes_work]

    def _stall_overdue(self, now: float) -> None:
        """An instance whose running step is overdue (`InstanceState.overdue`) takes no new
        work until the step ends, and its gathered batch goes elsewhere (placement leaves a
        stalled home, releasing the state it held)."""
        for inst in list(self._open):
            if inst.overdue(now, self.speed.instance_ratio(inst.instance_id)):
                inst.stalled = True
                self._open = self._open_instances()
                for rid in inst.clear():
                    self.requests[rid].needs_threshold = True
                    self._ready.append(rid)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be placed on an instance (a parked lost one included)."""
        return len(self._ready) + (self.lost_work.num_parked if self.lost_work else 0)

    @property
    def num_stalled(self) -> int:
        return sum(inst.stalled for inst in list(self.instances.values()))

    # -- events ------------------------------------------------------------------------------

    def on_arrival(self, request: Request, now: float) -> Decisions:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} is already scheduled")
        if request.deadline is None:
            request.deadline = request.arrival_time + self.config.slo
        request.status = RequestStatus.WAITING
        if self.reconfigurer is not None:
            self.reconfigurer.record(request, now)
        tracked = Tracked(request, self._admitted, allowed=self._ladder)
        tracked.order = (-request.priority, request.arrival_time, self._admitted)
        self._admitted += 1
        tracked.bound = self._placer.bind(self._open)
        self.requests[request.request_id] = tracked
        self._ready.append(request.request_id)
        if self.load_control is not None:
            self.load_control.admit(request.request_id)
        return self._schedule(now, load_changed=True)

    def on_step_done(self, instance_id: str, output: StepOutput, now: float) -> Decisions:
        inst = self.instances[instance_id]
        inst.busy = False
        if inst.stalled:  # its step ended: it takes work again
            inst.stalled = False
            self._open = self._open_instances()
        inst.holds.difference_update(output.kv_dropped)  # (their next steps: recomputes)
        finished, going_on = [], []
        for result in output.results:
            rid = result.request_id
            t = self.requests.get(rid)
            if t is None:
                continue  # cancelled while its step ran
            r = t.request
            r.apply(result, now)
            if result.is_finished:
                finished.append(rid)
                inst.holds.discard(rid)
                self._selection.finished(r, now)  # Alg. 1's calibration, the quality budget
                self._forget(t)
                continue
            self._ready.append(rid)
            going_on.append(t)
        if self.load_control is not None:
            self.load_control.stepped(going_on)
        decisions = self._schedule(now, load_changed=bool(finished))
        return Decisions(decisions.launches, decisions.releases, tuple(finished))

    def retry_alone(self, instance_id: str, request_ids: list[str], now: float) -> Decisions:
        """The step of `request_ids` on the instance failed (the engine raised): nothing it did
        counts, and which of them broke it is unknown. Each resumes from its last committed
        tokens with its state dropped there, and from now on runs alone, in a batch of its own,
        so that a request whose step fails alone can be failed alone (by the driver) and the
        others finish."""
        inst = self.instances[instance_id]
        inst.busy = False
        releases = []
        for rid in request_ids:
            if rid in self.requests:
                self._solo.add(rid)
                inst.holds.discard(rid)
                releases.append((instance_id, rid))
                self._orphan(rid)
        decisions = self._schedule(now, load_changed=False)
        return Decisions(decisions.launches, tuple(releases) + decisions.releases)

    def cancel(self, request_id: str) -> Decisions:
        """Stop scheduling a request (it failed, or its client went away); the instance
        holding its state is told to drop it. A step of it that is running is ignored."""
        t = self.requests[request_id]
        t.request.status = RequestStatus.FAILED
        if request_id in self._ready:
            self._ready.remove(request_id)
        elif self.lost_work is not None:
            self.lost_work.unpark(request_id)
        inst = self.instances.get(t.instance) if t.instance is not None else None
        self._forget(t)
        if inst is None:
            return Decisions()
        inst.ungather(request_id)
        if request_id not in inst.holds:
            return Decisions()
        inst.holds.discard(request_id)
        return Decisions(releases=((inst.instance_id, request_id),))

    def _forget(self, t: Tracked) -> None:
        rid = t.request.request_id
        self._move(t, None)
        del self.requests[rid]
        self._solo.discard(rid)
        if self.load_control is not None:
            self.load_control.forget(rid)
        self._selection.forget(rid)  # Alg. 1's calibration and the quality budget

    def on_tick(self, now: float) -> Decisions:
        """Periodic: move work off stalled instances, retry deferred requests; every planning
        period, maybe reconfigure."""
        self._stall_overdue(now)
        decisions = self._schedule(now, load_changed=False)
        if self.reconfigurer is None:
            return decisions
        slots = [InstanceSlot(i.instance_id, i.node, i.tp, i.gpus) for i in self.instances.values()]
        return replace(decisions, reconfiguration=self.reconfigurer.on_tick(now, slots))

    # -- one scheduling round ----------------------------------------------------------------

    def _schedule(self, now: float, load_changed: bool) -> Decisions:
        self.speed.advance(now)  # a stale measured slowdown decays with event time (speed.py)
        key = self._placer.service_key(now)
        ready: Iterable[str] = sorted(self._ready, key=key)
        if self.load_control is not None:
            refreshed = self.load_control.refresh(now)
            self.load_control.run_if_due(now, load_changed, refreshed, self.instances.values())
        releases, waiting, block, inner = [], [], self._costs.block_len, self._costs.inner_kind
        if self.lost_work is not None:  # lost and nowhere to go: parked (`service_order`)
            ready = self.lost_work.service_order(ready, key, self._open)
        for rid in ready:
            t = self.requests[rid]
            home = self._cache_home(t)
            if home is not None:  # Alg. 3's only candidate; what place and _assign would do
                solo = rid in self._solo
                if not self._placer.has_room(home, block, inner, solo):
                    waiting.append(rid)
                    continue
                home.gather(rid, inner, block, solo)
                if t.needs_threshold and self.policy.is_dynamic:  # its predictions refreshed
                    t.request.threshold = self._selection.choose(t, home, now)
                continue
            placed = (self.lost_work or self._placer).place(t, now, self._open)
            if placed is None:
                waiting.append(rid)
                releases += self.lost_work.park(t) if self.lost_work is not None else []
                continue
            releases += self._assign(t, *placed, now)
        self._ready = waiting
        return Decisions(tuple(self._launch(now)), tuple(releases))

    def _cache_home(self, t: Tracked) -> InstanceState | None:
        """The instance holding this request's cache when its next step is a cache step there
        and it may not move (migration only before recompute steps): the common case of every
        step-completion event, placed without the general search."""
        if not self._short_path or t.request.starts_block:
            return None
        home = self.instances.get(t.instance) if t.instance is not None else None
        if home is None or home.stalled or t.request.request_id not in home.holds:
            return None
        return home

    # -- assignment and threshold selection ----------------------------------------------

    def _assign(
        self, t: Tracked, inst: InstanceState, kind: StepKind, now: float
    ) -> list[tuple[str, str]]:
        rid, releases = t.request.request_id, []
        if t.instance != inst.instance_id:
            if t.instance is not None and t.instance in self.instances:
                self.instances[t.instance].holds.discard(rid)
                releases.append((t.instance, rid))
            t.needs_threshold = True
            if self.policy.migration is Migration.NONE and t.bound is None:
                t.bound = inst.instance_id
            self._move(t, inst)
        inst.gather(rid, kind, self._placer.tokens(t, kind), rid in self._solo)
        t.request.threshold = self._selection.choose(t, inst, now)  # Alg. 1
        t.request.status = RequestStatus.RUNNING
        return releases

    def _launch(self, now: float) -> list[StepLaunch]:
        launches = []
        for inst in self.instances.values():
            if inst.busy or not inst.pending:
                continue
            holds, requests = inst.holds, [self.requests[rid].request for rid in inst.pending]
            items = [
                StepItem(
                    r.request_id,
                    r.threshold,
                    kind,
                    None if r.request_id in holds else r.spec(),
                    steps=r.steps,
                )
                for r, kind in zip(requests, inst.pending_kinds)
            ]
            inst.launch(now)
            launches.append(StepLaunch(inst.instance_id, StepBatch(tuple(items))))
        return launches
