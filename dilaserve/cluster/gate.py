"""What the HTTP front asks the cluster before it hands a request over (`Gate.is_full`), and the
requests it let through that the controller has not seen yet (`Gate.entering`).

The controller publishes admission's `Room` between events (`admission.py`); the gate asks it
for a request behind every request not priced yet: those queued for the controller and those
the front let through that are still on their way: counted from the moment the HTTP protocol
let them through (`guards.EarlyRefusals`), through the app's parsing and tokenizing, until
they are queued. So a burst is priced as one, each request behind those before it, and not
each as if it came alone (docs/serving/reliability.md, "The 400 clients' first wave", and
"Refusals below the app").

The controller's side is `Admitting`: it prices that `Room` again after the events that may
change it, refuses the queued arrivals the new room refuses, and asks admission in full of
each arrival it takes (`control.admission`), answering those refused."""

from __future__ import annotations

import bisect
import contextlib
import logging
import statistics
import threading
from collections import deque
from dataclasses import replace

from dilaserve.cluster.requests import FULL, InvalidRequest, Overloaded, RequestHandle
from dilaserve.control.admission import LOWEST_PRIORITY, Admission, Room
from dilaserve.control.on_time import HALF_LIFE

log = logging.getLogger("dilaserve.cluster")
ROOM_MAX_AGE = 0.01  # s: while events queue, the `room` is priced again at most this late
PACE_KEPT = 64  # the latest requests asked in full whose waits the `Pace` is the median of
PACE_EVIDENCE = 16  # of them, before the median is used (a few say little)


class Gate:
    def __init__(self, controller, slo: float):
        self.controller = controller  # its `arrivals` and `admitting` (the `room`)
        self.slo = slo  # the server's default SLO, seconds
        self._entering = 0  # requests `entering`: let through, not queued yet
        self._lock = threading.Lock()

    def is_full(
        self, priority, slo=None, max_tokens=None, entry: _Entry | None = None, probe=False
    ) -> bool:
        """`refuses`, behind the requests queued for the controller and those `entering` (but
        `entry`, the asker's own). `probe`: a question before the request is judged (the
        front's, whether to read its body first), not a refusal."""
        ahead = len(self.controller.arrivals) + self._entering
        if entry is not None and entry.counted:
            ahead -= 1
        return self.refuses(priority, slo, max_tokens, ahead, probe)

    def refuses(self, priority, slo, max_tokens, ahead: int, probe: bool = False) -> bool:
        """`room_refuses` of the controller's room; a refusal (not a `probe`) counts toward
        `health`."""
        admitting = self.controller.admitting
        if not room_refuses(admitting.room, self.slo, priority, slo, max_tokens, ahead):
            return False
        if not probe:
            admitting.refused_in_a_row += 1
        return True

    def enter(self) -> _Entry:
        """Count a request let through (by `is_full`) ahead of later ones until it `leave`s."""
        return _Entry(self)

    @contextlib.contextmanager
    def entering(self, submit, entry: _Entry | None = None):
        """Count a request let through ahead of later ones (from `entry`, when the front
        counted it already) until it is queued for the controller or refused. Yields `submit`
        (the cluster's, to call off the event loop: it tokenizes), which stops the count when
        it returns or raises."""
        entry = entry or self.enter()

        def submitting(*args, **kwargs):
            try:
                return submit(*args, **kwargs)
            finally:
                entry.leave()

        try:
            yield submitting
        finally:
            entry.leave()


class _Entry:
    """One request `entering`: counted from its creation until the first `leave`."""

    def __init__(self, gate: Gate):
        self.gate, self.counted = gate, True
        with gate._lock:
            gate._entering += 1

    def leave(self) -> None:
        with self.gate._lock:
            if self.counted:
                self.counted = False
                self.gate._entering -= 1


def room_refuses(room, server_slo: float, priority, slo, max_tokens, ahead: int) -> bool:
    """Would `room` (admission's, `control/room.py`) refuse a request of `priority`, `slo`
    seconds (None: the server's, `server_slo`) and `max_tokens` behind `ahead` requests not
    priced yet? One that asks for less than the server's SLO, or whose fields are not what the
    API takes, is left to admission (which alone tells an SLO no idle cluster meets, a 400,
    from one the load refuses, a 429; `intake` names a wrong field)."""
    if slo is not None and not slo > 0:
        slo = None  # (not a positive number: `intake` names it)
    if slo is not None and slo < server_slo:
        return False
    if not isinstance(max_tokens, int) or max_tokens < 1:
        max_tokens = None  # (`intake` names what is wrong)
    if not isinstance(priority, int):
        return False
    return room.refuses(priority, slo, max_tokens, ahead)


def refused_behind(room, server_slo: float, requests) -> list[bool]:
    """For each of `requests` (`Request`s queued for admission, in order): whether `room`
    refuses it behind those ahead of it that it does not refuse (`room_refuses`)."""
    refused, kept = [], 0
    for r in requests:
        refused.append(room_refuses(room, server_slo, r.priority, r.slo, r.max_tokens, kept))
        kept += not refused[-1]
    return refused


class Pace:
    """Seconds from a request's receipt to its pricing by admission in full, per request
    ahead of it (itself included): the median over the latest `PACE_KEPT` requests asked
    behind others, each its wait over the requests asked between its receipt and it, plus
    one (its receipt: when the front read its head, `guards.RECEIVED`). The `Room` takes this
    much of a newcomer's SLO for each request ahead of it, as admission in full will find it
    gone. A burst of 400 at an idle server was let through for the time alone each takes
    beside those ahead, but the controller priced them 1.7-3 ms apart (the 250th waited 0.42
    s), and those it no longer took were refused as the room, priced again while those ahead
    were admitted, closed: 100-460 ms after they were sent (docs/serving/reliability.md). A
    lone request teaches nothing (its wait is its own path's, tokenizing included, about 1
    ms, not a pace), and it takes nothing from a request with none ahead.

    An estimate is not a fact (DESIGN.md 7): between bursts the latest burst's pace decays
    toward none with admission's half-life (`on_time.HALF_LIFE`), and a wait across a stall
    of the controller (`stalls.py`) is the stall's, not a pace: a request received before a
    stall ended teaches nothing. Else a controller held up for a second would have taught a
    pace that refused, at the front, every request with others ahead: the very requests that
    measure it again."""

    def __init__(self, half_life: float = HALF_LIFE):
        self.half_life = half_life
        self._median = 0.0  # of the waits kept, when the latest was learnt
        self._learnt_at = 0.0
        self._stall_ended = float("-inf")
        self._asked: list[float] = []  # when the latest requests were asked (ascending)
        self._waits: deque[float] = deque(maxlen=PACE_KEPT)  # each wait over its count

    def at(self, now: float) -> float:
        """The pace at `now`: the median of the waits kept, halved for each half-life since
        the latest was learnt; 0 until `PACE_EVIDENCE` requests were asked behind others (a
        cold server priced its first burst's streams tens of milliseconds apart while its
        caches warmed, and a pace from those few refused 9 of 16 with the room's wait bound)."""
        return self._median * 0.5 ** (max(now - self._learnt_at, 0.0) / self.half_life)

    def asked(self, received: float, now: float) -> None:
        """A request received at `received` is asked in full at `now` (the same clock)."""
        ahead = len(self._asked) - bisect.bisect_right(self._asked, received)
        if ahead and received >= self._stall_ended:
            self._waits.append(max(now - received, 0.0) / (ahead + 1))
            if len(self._waits) >= PACE_EVIDENCE:
                self._median, self._learnt_at = statistics.median(self._waits), now
        self._asked.append(now)
        if len(self._asked) > 16 * PACE_KEPT:  # (a burst's is what counts: keep the latest)
            del self._asked[: 8 * PACE_KEPT]

    def stalled(self, ended: float) -> None:
        """The controller was held up until `ended` (`StallWatch.handled`): the requests
        received before then waited for the stall."""
        self._stall_ended = ended


class Admitting:
    """The controller's side of the gate, on its thread: the `room` the front asks, priced again
    after events (`price_room`), and admission of each arrival (`within_capacity`). A refused
    arrival is answered (a 429, or a 400 for an SLO no idle cluster meets), counted in `stats`
    and in `refused_in_a_row` (`Cluster.health`; written from the callers' threads too: a
    monitoring figure), dropped from `handles` and kept by the `recording` if there is one."""

    def __init__(
        self, admission: Admission, answers, handles: dict, stats: dict, recording, most_wait
    ):
        self.admission = admission
        self.most_wait = most_wait  # seconds (`Room.most_wait`: `ClusterConfig.admission_wait`)
        self.answers, self.handles, self.stats, self.recording = answers, handles, stats, recording
        self.room = Room()  # admission's answer between events (`Gate.is_full`)
        self.stale = False  # an event may have changed the room since it was priced
        self._room_at = 0.0  # when it was priced
        self.refused_in_a_row = 0  # refused for capacity since the last admitted
        self.pace = Pace()  # how long the requests ahead of a newcomer delay it

    def price_room(self, now: float, queued: bool, arrivals: deque[RequestHandle]) -> None:
        """Price the `room` again if it is `stale`: at once when no event is `queued`, else at
        most `ROOM_MAX_AGE` late (a burst of arrivals is answered sooner when each arrival does
        not price it again: docs/serving/reliability.md, "Where the refusals wait"); then
        refuse the queued `arrivals` it refuses."""
        if not self.stale or (queued and now - self._room_at < ROOM_MAX_AGE):
            return
        room = self.admission.room(now)
        room = replace(room, pace=self.pace.at(now), most_wait=self.most_wait)
        self.room, self._room_at, self.stale = room, now, False
        self._refuse_beyond_room(arrivals, now)

    def _refuse_beyond_room(self, arrivals: deque[RequestHandle], now: float) -> None:
        """Refuse at once the queued arrivals that the `room` refuses behind those ahead of
        them: in a burst they are the last in the queue, and waited there behind every
        admission before them (docs/serving/reliability.md, "Where the refusals wait"). The
        rest stay queued, in order, to be asked in full. Only when refusing (`reject`); the
        front's rule (`room_refuses`)."""
        if self.admission.mode != "reject" or not arrivals:
            return
        queued = [arrivals.popleft() for _ in range(len(arrivals))]
        requests, refused = [h.request for h in queued], [False] * len(queued)
        try:
            slo = self.admission.scheduler.config.slo
            refused = refused_behind(self.room, slo, requests)
        finally:  # (callers append behind them meanwhile)
            arrivals.extendleft(reversed([h for h, no in zip(queued, refused) if not no]))
        for handle in (h for h, no in zip(queued, refused) if no):
            handle.request.arrival_time = now
            self.refuse(handle, Overloaded(FULL))

    def within_capacity(self, handle: RequestHandle, now: float) -> bool:
        """Admission by capacity (`admission`): a request that cannot meet its SLO is refused,
        or served last."""
        self.pace.asked(handle.submitted, now)
        try:
            refusal = self.admission.refusal(handle.request, now, handle.submitted)
        except Exception:  # a bug in the check must not fail the request: admit it
            self.stats["controller_errors"] += 1
            log.exception("admission check of request %s failed; admitted", handle.request_id)
            return True
        if refusal is None:
            self.refused_in_a_row = 0
            return True
        if self.admission.mode == "deprioritize":
            self.stats["deprioritized"] += 1
            handle.request.priority = LOWEST_PRIORITY
            return True
        if refusal.param is not None:  # the request's fault, whatever the load: a 400
            self.stats["refused_invalid"] += 1
            self.refuse(handle, InvalidRequest(refusal.param, refusal.reason))
            return False
        self.refuse(handle, Overloaded(f"cannot meet its SLO now: {refusal}"))
        return False

    def refuse(self, handle: RequestHandle, error: Exception) -> None:
        """Answer a queued arrival with `error` (a 429, or an `InvalidRequest`'s 400)."""
        self.stats["refused"] += 1
        self.handles.pop(handle.request_id, None)
        if isinstance(error, Overloaded):
            self.refused_in_a_row += 1
        if self.recording is not None:
            self.recording.refused.append(handle.request.fresh())
        self.answers.refuse(handle, error)
