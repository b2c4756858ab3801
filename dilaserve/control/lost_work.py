"""Lost work (an extension, beyond the paper): a request that can no longer meet its deadline at
any threshold is served after the ones that still can.

Under continuous batching every request in an instance's batch lengthens every step of that
batch, so a request that will be late anyway slows the ones that could still make it. With
`Policy.lost_work` set, a request is found lost at a placement (arrival, a block's first step, a
move) when its deadline has passed (`Lost.LATE`), when the point estimate of its remaining time
at the lowest allowed threshold misses the deadline (`POINT`), or (`LIKELY`, the default
policy's) when even that estimate times the low quantile of Alg. 1's calibration misses it: as
fast as the luckiest 5% of recent requests ran against their estimate (for the 0.95 on-time
target), it would still be late. A lost request goes only to an instance holding no request
that is not lost; where none has room it waits, its state released, until one has. It still
finishes (at the threshold Alg. 1 gives it then), and it stays lost. Once lost it teaches Alg.
1's calibration (and admission's, `on_lost`) once, at the time the estimate that found it lost
says it would have needed from there; its later finish, late by choice, teaches nothing. Load
control (Alg. 2/4) leaves it out: served after every request still on time, it takes none of
their capacity, and work lost anyway no longer lowers their thresholds. Why, and what it gains:
docs/control/scheduling.md, "Lost work".
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Iterator, Sequence

from dilaserve.control.instance import InstanceState
from dilaserve.protocol import StepKind


class Lost(str, enum.Enum):
    NEVER = "never"  # the paper: every request is served alike
    LATE = "late"  # its deadline has passed
    POINT = "point"  # the point estimate at the lowest allowed threshold misses the deadline
    # ... even at the low quantile of Alg. 1's calibration: lost with the on-time target's odds
    LIKELY = "likely"


class LostWork:
    def __init__(self, rule: Lost, placer, selection, move, fixed_order: bool):
        self.rule, self._placer, self._selection = rule, placer, selection
        self._instances, self._tracked = placer.instances, placer.tracked
        self._move = move  # the scheduler's: re-home a request (None: nowhere)
        # lost requests that wait holding nothing, bound nowhere (`service_order`): (service
        # key, request id) in service order; keys that never change where `fixed_order`
        self._fixed_order = fixed_order
        self._parked: list[tuple] = []
        self.on_lost: list = []  # callables (request id, when it would have finished)
        # (the open instances, those of them holding only lost requests), until `moved`
        self._free: tuple[Sequence[InstanceState], list[InstanceState]] | None = None

    def place(
        self, t, now: float, open_instances: Sequence[InstanceState]
    ) -> tuple[InstanceState, StepKind] | None:
        """Alg. 3's pick for the scheduler's record `t`; for a lost request (or one found lost
        there) the pick among the instances that hold only lost requests; None: it waits."""
        if not t.lost:
            placed = self._placer.place(t, now, open_instances)
            if placed is None or not self._found_lost(t, placed[0], now):
                return placed
        free = self._free_instances(open_instances)
        bound = self._instances.get(t.bound) if t.bound is not None else None
        if t.bound is not None and (bound is None or not bound.takes_work):
            t.bound = None  # its instance went away while it waited: bind again where it lands
        if t.bound is not None and all(i.instance_id != t.bound for i in free):
            return None  # bound to an instance that serves requests still on time
        return self._placer.place(t, now, free) if free else None

    def waits(self, t, open_instances: Sequence[InstanceState]) -> bool:
        """Whether the lost request `t` just waits this round: it holds no instance to give up
        and is bound to none, and no open instance holds only lost requests (so `place` would
        find nothing and `park` release nothing). What most of an overload's events ask."""
        return t.instance is None and t.bound is None and not self._free_instances(open_instances)

    def service_order(
        self, ready: Iterable[str], key, open_instances: Sequence[InstanceState]
    ) -> Iterator[str]:
        """The ready requests, in service order (`key`, the placer's), that may be placed this
        round, with the parked ones merged in at their turn. A lost request that holds nothing
        and is bound nowhere waits (`waits`) while no open instance holds only lost requests:
        it is parked, and while no instance is free the parked are passed over in bulk, kept in
        order for the next round. In an overload most requests are lost and waiting, and asking
        each of them on every event was most of a round's time."""
        parked, self._parked, i = self._parked, [], 0
        if not self._fixed_order:  # (keys that change with time: sorted afresh)
            parked = sorted((key(rid), rid) for _, rid in parked)
        try:
            for rid in [*ready, None]:
                k = None if rid is None else key(rid)
                while i < len(parked) and (k is None or parked[i] < (k,)):
                    if self._free_instances(open_instances):
                        i += 1
                        yield parked[i - 1][1]
                        continue
                    j = len(parked) if k is None else bisect.bisect_left(parked, (k,), i)
                    self._parked += parked[i:j]
                    i = j
                if rid is None:
                    break
                t = self._tracked[rid]
                if t.lost and self.waits(t, open_instances):
                    self._parked.append((k, rid))
                else:
                    yield rid
        finally:  # (a round cut short keeps what it did not reach)
            self._parked += parked[i:]

    def unpark(self, request_id: str) -> bool:
        """Forget a parked request (cancelled, or ready again); whether it was parked."""
        for k, (_, rid) in enumerate(self._parked):
            if rid == request_id:
                del self._parked[k]
                return True
        return False

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def moved(self) -> None:
        """A request moved or was found lost: which instances hold only lost requests may
        have changed (the scheduler calls this from its `_move`)."""
        self._free = None

    def _free_instances(self, open_instances: Sequence[InstanceState]) -> list[InstanceState]:
        """The open instances that hold only lost requests (or none). Every lost request that
        waits asks on every event, and the answer changes only when a request moves or is
        found lost, or the open instances change (the scheduler makes a new list then): kept
        until then."""
        if self._free is None or self._free[0] is not open_instances:
            free = [i for i in open_instances if i.residents == i.lost_residents]
            self._free = (open_instances, free)
        return self._free[1]

    def park(self, t) -> list[tuple[str, str]]:
        """A lost request that waits gives its instance up; (instance, request) to release."""
        home = self._home(t)
        if not t.lost or home is None:
            return []
        t.needs_threshold = True
        self._move(t, None)
        rid = t.request.request_id
        if rid not in home.holds:
            return []
        home.holds.discard(rid)
        return [(home.instance_id, rid)]

    def _home(self, t) -> InstanceState | None:
        return self._instances.get(t.instance) if t.instance is not None else None

    def _found_lost(self, t, inst: InstanceState, now: float) -> bool:
        """Whether `t` placed on `inst` cannot meet its deadline any more (then marked lost)."""
        deadline = t.request.deadline
        left = 0.0
        if self.rule is Lost.LATE:
            lost = now >= deadline
        else:
            left = self._selection.lowest_time_left(t, inst, now)
            factor = self._selection.low_factor(now) if self.rule is Lost.LIKELY else 1.0
            lost = now + left * factor > deadline
        if not lost:
            return False
        t.lost = True
        self._selection.load_control.leave_out(t.request.request_id)
        home = self._home(t)
        if home is not None:
            home.lost_residents += 1
            self.moved()
        calibration = self._selection.deadline
        if calibration is not None:  # what it would have taken from here, had it been served
            calibration.finished_at(t.request.request_id, now + left)
        for teach in self.on_lost:  # admission's calibration, likewise (`Admission.lost`)
            teach(t.request.request_id, now + left)
        return True
