"""What the HTTP front asks the cluster before it hands a request over (`Gate.is_full`), and the
requests it let through that the controller has not seen yet (`Gate.entering`).

The controller publishes admission's `Room` between events (`admission.py`); the gate asks it
for a request behind every request not priced yet: those queued for the controller and those
the front let through that are still on their way: counted from the moment the HTTP protocol
let them through (`guards.EarlyRefusals`), through the app's parsing and tokenizing, until
they are queued. So a burst is priced as one, each request behind those before it, and not
each as if it came alone (docs/serving/reliability.md, "The 400 clients' first wave", and
"Refusals below the app")."""

from __future__ import annotations

import contextlib
import threading


class Gate:
    def __init__(self, controller, slo: float):
        self.controller = controller  # its `room`, `arrivals` and `refused_in_a_row`
        self.slo = slo  # the server's default SLO, seconds
        self._entering = 0  # requests `entering`: let through, not queued yet
        self._lock = threading.Lock()

    def is_full(self, priority, slo=None, max_tokens=None, entry: _Entry | None = None) -> bool:
        """`refuses`, behind the requests queued for the controller and those `entering` (but
        `entry`, the asker's own)."""
        ahead = len(self.controller.arrivals) + self._entering
        if entry is not None and entry.counted:
            ahead -= 1
        return self.refuses(priority, slo, max_tokens, ahead)

    def refuses(self, priority, slo, max_tokens, ahead: int) -> bool:
        """`room_refuses` of the controller's room; a refusal counts toward `health`."""
        if not room_refuses(self.controller.room, self.slo, priority, slo, max_tokens, ahead):
            return False
        self.controller.refused_in_a_row += 1
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
