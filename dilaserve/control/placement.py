"""Placement (Algorithm 3): the instance a request's next step runs on.

The candidates are every instance taking new work, unless the request may not move: a request
bound to one instance (no migration, or bound at arrival), or, with migration only before
recompute steps, a request whose next step is a cache step where its approximate cache lives. An
exact (block-diffusion) cache makes that rule a priced decision: away from its cache the
request's step is a prefill, so it moves only where that prefill still finishes first. Among the
candidates with room, Alg. 3 as the paper writes it sends the request where the latency profile
prices a step over the instance's batch with the request in it lowest: the batch is every
request the instance holds (running, gathered or between steps), in tokens, and the price is the
full-step curve of the instance's TP degree (ties go to an idle instance); with
`Policy.instance_speed` (DiLaServe's; `SchedulerConfig.instance_speed` overrides it) it is
taken times the instance's measured speed over the profile's (`speed.py`; compared to 1%),
so that a straggler the profile does not know is priced as it runs. A request that has a home
moves to placement's pick only when the move pays (beyond the paper; `Policy.priced_moves`,
off for the baselines): the steps of its block must end there,
the wait for that instance's running step included once, sooner than at home by more than it
lengthens the steps of the requests it joins there (less what it spares those it leaves) and
`SchedulerConfig.migration_price` seconds (`_move_pays`). With an
exact cache (block diffusion, beyond the paper) a move costs a prefill, so there
the request goes where its step is predicted to finish first: a busy instance starts the
gathered batch, its running step's requests included, when that step ends. Least-tokens
placement (`llumnix`) picks the batch with the fewest tokens. A queue (first-free placement:
`fcfs`, `dws-sjf`) gives waiting requests only to instances between steps, least tokens first.
Which waiting request goes first is the policy's service order (`service_key`: arrival, or DWS-
SJF's shortest aged expected cost). The scheduler owns the state; this reads it (the instances
and the tracked requests, shared mappings) and decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set

from dilaserve.control.decisions import SchedulerConfig
from dilaserve.control.instance import InstanceState
from dilaserve.control.load_control import LoadControl
from dilaserve.control.policy import Migration, Order, Placement, Policy
from dilaserve.control.speed import MeasuredSpeed
from dilaserve.protocol import StepKind
from dilaserve.request import KINDS_CACHED  # (a compiled constant: `request.py` says why)

# Instances' measured speeds are compared to this many decimals (1%): a difference below it is
# timing noise, which must not overrule placement's tie-break to an idle instance
SPEED_DIGITS = 2


class Placer:
    def __init__(
        self,
        policy: Policy,
        config: SchedulerConfig,
        instances: Mapping[str, InstanceState],
        tracked: Mapping,  # request id -> the scheduler's record (request, instance, bound)
        solo: Set[str] = frozenset(),  # requests whose steps run alone (the scheduler's set)
        speed: MeasuredSpeed | None = None,  # per-instance speeds (`Policy.prices_instances`)
        load_control: LoadControl | None = None,  # the steps a move is for (`_move_pays`)
    ):
        self.policy, self.config = policy, config
        self._load = load_control
        self.instances, self.tracked, self.solo = instances, tracked, solo
        self._queue = policy.placement is Placement.FIRST_FREE
        self._max_requests = config.max_batch_requests or float("inf")
        self._costs = config.costs
        # Alg. 3 as written prices the whole batch; an exact cache, where the step ends first
        self._fastest = policy.placement is Placement.FASTEST_STEP
        self._alg3 = self._fastest and not self._costs.exact
        # a move must pay (`_move_pays`): with an approximate cache, whatever placement picks
        self._priced = policy.priced_moves and not self._costs.exact
        self._speed = speed if policy.prices_instances(config.instance_speed) else None
        self._migrates = policy.migration is not Migration.NONE
        self._at_recompute_only = policy.migration is Migration.RECOMPUTE
        self._anywhere = policy.migration is Migration.ANY
        self._rounded_ratios: dict[float, float] = {}

    def service_key(self, now: float):
        """The order waiting requests are served in (Alg. 3's loop over them): arrival (with
        priorities), or DWS-SJF's started-first, then shortest aged expected cost (a request
        without one goes last)."""
        tracked = self.tracked
        if self.policy.order is Order.ARRIVAL:
            return lambda rid: tracked[rid].order
        keep = 1.0 - self.policy.aging

        def key(rid: str) -> tuple[int, float, float, int]:
            r = tracked[rid].request
            if r.num_steps:
                return (0, 0.0, r.arrival_time, tracked[rid].seq)
            periods = int((now - r.arrival_time) // self.policy.aging_period)
            cost = float("inf") if r.cost is None else r.cost * keep**periods
            return (1, cost, r.arrival_time, tracked[rid].seq)

        return key

    def tokens(self, t, kind: StepKind) -> int:
        """Tokens the request's step of `kind` processes."""
        return self._costs.request_tokens(kind, t.request)

    def has_room(
        self, inst: InstanceState, tokens: int, kind: StepKind, solo: bool = False
    ) -> bool:
        """Whether the batch gathered there takes the request's step of `kind` (`solo`: one
        that runs alone)."""
        if inst.busy and self._queue:
            return False  # a queue: requests wait, in service order, until an instance is free
        return inst.has_room(tokens, self._max_requests, solo, kind in KINDS_CACHED)

    def place(
        self, t, now: float, open_instances: Sequence[InstanceState]
    ) -> tuple[InstanceState, StepKind] | None:
        """The instance for the request's next step and that step's kind; None: no room."""
        r, costs = t.request, self._costs
        home = self.instances.get(t.instance) if t.instance is not None else None
        away = costs.next_kind(r, has_cache=False)
        home_kind = costs.next_kind(r, r.request_id in home.holds) if home is not None else away
        if home is not None and home.stalled:
            home = None  # its step is overdue: go elsewhere now, paying for a fresh state
        if home is not None and home.draining:
            stays = costs.stays_with_cache(home_kind)
            if not stays or self._anywhere:
                home = None  # leave now; a cache step stays with its cache
        candidates = self._candidates(t, home, home_kind, open_instances)
        solo = r.request_id in self.solo
        if len(candidates) == 1:  # no choice (cache step at home, bound request): room only
            inst = candidates[0]
            kind = home_kind if inst is home else away
            return (inst, kind) if self.has_room(inst, self.tokens(t, kind), kind, solo) else None
        best, best_key, can_stay = None, None, False
        for inst in candidates:
            kind = home_kind if inst is home else away
            n = self.tokens(t, kind)
            if not self.has_room(inst, n, kind, solo):
                continue
            can_stay = can_stay or inst is home
            joining = 0 if inst is home else r.num_tokens
            key = (self._cost(inst, kind, n, joining, now), inst.busy, inst.instance_id)
            if best_key is None or key < best_key:
                best, best_key = (inst, kind), key
        if self._priced and can_stay and best is not None and best[0] is not home:
            assert home is not None  # it has room, so it is a candidate
            if not self._move_pays(t, best[0], best[1], home, home_kind, now):
                return home, home_kind
        return best

    def _move_pays(
        self,
        t,
        to: InstanceState,
        kind: StepKind,
        home: InstanceState,
        home_kind: StepKind,
        now: float,
    ) -> bool:
        """Whether moving to Alg. 3's pick `to` beats staying at `home` by more than the move
        costs, in request-seconds over the block the move is for: the request's own steps must
        end sooner there (each instance's next batch with the request in it starting when its
        running step ends; the home the request's last step just left is free now), by more
        than what its tokens add to the steps of every request in `to`'s next batch, less what
        leaving spares those in home's, plus `config.migration_price` seconds. Alg. 3's price
        does not see that wait: with an approximate cache a request moves only at a block's
        first step, a recompute at home or away alike (the sequence travels with the step), so
        waiting for a busy instance's running step is what a move costs the request, once, and
        lengthening the steps of the batch it joins is what it costs the others, at every step
        of the block, as long as it stays (`LoadControl.steps_per_block`; one step without
        load control). Priced by its own step alone, migration sat below `no-migration` on
        the Azure conversation trace; priced over one step, DiLaServe met 0.36 points fewer
        SLOs on the training traces at the TP-2 start than priced over the block
        (docs/control/scheduling.md, "Migration that pays")."""
        steps = self._load.steps_per_block(t.request) if self._load is not None else 1.0
        ends = self._block_cost(to, kind, self.tokens(t, kind), now, steps)
        stays = self._block_cost(home, home_kind, self.tokens(t, home_kind), now, steps)
        return ends + self.config.migration_price < stays

    def _block_cost(
        self, inst: InstanceState, kind: StepKind, n: int, now: float, steps: float
    ) -> float:
        """Request-seconds a block of `steps` steps of `kind` processing `n` tokens costs on
        `inst`: the wait for its running step, then each step's latency with the request in
        the batch and what the request adds to the others' (each waits for the longer step;
        the batch taken as it is now)."""
        without, with_it = _next_step(inst, kind, n)
        slows = inst.next_batch_requests() * (with_it - without)
        return self._start(inst, now) - now + steps * (with_it + slows)

    def _step_end(self, inst: InstanceState, kind: StepKind, n: int, now: float) -> float:
        """When the instance's next step, with a step of `kind` processing `n` tokens in it,
        ends: its next batch (the gathered one and, while a step runs, that step's requests,
        which come back to it) starts when the running step ends."""
        return self._start(inst, now) + _next_step(inst, kind, n)[1]

    @staticmethod
    def _start(inst: InstanceState, now: float) -> float:
        """When the instance's next step starts: when its running step ends, or now."""
        return inst.busy_until if inst.busy and inst.busy_until > now else now

    def _cost(self, inst: InstanceState, kind: StepKind, n: int, joining: int, now: float) -> float:
        """What placement minimises on `inst` for a step of `kind` processing `n` tokens, the
        request bringing `joining` tokens to the instance (0 at home)."""
        if self._alg3:  # the step latency at the batch's tokens with this request in it
            price = inst.full_curve.at(inst.resident_tokens + joining)
            if self._speed is not None:  # at the instance's measured speed
                price *= self._rounded(self._speed.instance_ratio(inst.instance_id))
            return price
        if self._fastest:  # an exact cache: where the step, a prefill away from home, ends first
            return self._step_end(inst, kind, n, now)
        full, cache = inst.pending_full, inst.pending_cache
        if kind in KINDS_CACHED:
            cache += n
        else:
            full += n
        return full + cache + self._running_tokens(inst)

    def _rounded(self, ratio: float) -> float:
        """`round(ratio, SPEED_DIGITS)`, remembered for the latest ratios: `round` to digits is
        slow, and one event's placements read each instance's ratio, the same, many times."""
        rounded = self._rounded_ratios.get(ratio)
        if rounded is None:
            if len(self._rounded_ratios) > 64:
                self._rounded_ratios.clear()
            rounded = self._rounded_ratios[ratio] = round(ratio, SPEED_DIGITS)
        return rounded

    def bind(self, open_instances: Sequence[InstanceState]) -> str | None:
        """On-arrival placement (INFaaS): the instance a new request is bound to, the one with
        the fewest tokens bound to it; None for the other placements (or no instance)."""
        if self.policy.placement is not Placement.ON_ARRIVAL or not open_instances:
            return None
        return min(open_instances, key=self._bound_tokens).instance_id

    def _candidates(self, t, home, home_kind, open_instances) -> Sequence[InstanceState]:
        if t.bound is not None:
            bound = self.instances.get(t.bound)
            if bound is not None and bound.takes_work:
                return [bound]
            t.bound = None  # its instance went away: bind again where it lands
        if home is not None and not self._migrates:
            return [home]
        if home is not None and self._at_recompute_only and self._costs.stays_with_cache(home_kind):
            return [home]
        return open_instances

    def _running_tokens(self, inst: InstanceState) -> int:
        if not inst.busy:
            return 0
        return sum(
            self.tracked[rid].request.num_tokens for rid in inst.holds if rid in self.tracked
        )

    def _bound_tokens(self, inst: InstanceState) -> tuple[int, str]:
        tokens = sum(
            t.request.num_tokens for t in self.tracked.values() if t.bound == inst.instance_id
        )
        return tokens, inst.instance_id


def _next_step(inst: InstanceState, kind: StepKind, n: int) -> tuple[float, float]:
    """The latency of the instance's next step (`InstanceState.next_batch`) without and with a
    step of `kind` processing `n` tokens in it."""
    full, cache = inst.next_batch()
    with_it = (full, cache + n) if kind in KINDS_CACHED else (full + n, cache)
    return inst.latency(full, cache), inst.latency(*with_it)
