"""The controller's own stalls: an event it handled for longer than a tick.

While the controller's one thread handles an event, no result is read: a step that ends
meanwhile looks, to the controller, as slow as the event was long, and so does every request
then in flight. A planner round held the controller 0.1-0.4 s on this 2-core machine, and over
a second in the reliability suite (a class per millisecond of wait then: `reconfigure.py`);
learnt, such a stall read as steps 10x the profile's time and requests 12x their prediction,
and admission refused a load the cluster had room for (docs/serving/reliability.md).
So the steps running across a stall teach the measured speed nothing (`measured`), and the
requests in flight teach no on-time factor, admission's or Alg. 1's, as at a fault
(`Controller._void_timings`, `Admission.void`). Before, Alg. 1's still learnt from them, and
the requests after a stall ran at the lowest threshold and taught admission's in turn (a
scratch replay: admission's factor 1.0 before the stall, 2.73 after; now 1.0 after).

A tick is the controller's own period: an event that outlasts it held back a tick too. The
steps left unmeasured are recorded with the run, so that a replay leaves them unmeasured as
well (`sim/replay.py`). Bookkeeping only: the caller passes the times.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger("dilaserve.cluster")


class StallWatch:
    def __init__(self, tick: float):
        self.tick = tick  # seconds: an event handled for longer is a stall
        self.count = 0  # stalls seen
        self._unmeasured: set[str] = set()  # instances whose running step spans a stall

    def handled(self, began: float, ended: float, running: Iterable[str]) -> bool:
        """An event was handled from `began` to `ended` while `running` instances ran a step:
        whether that was a stall (those steps' times are then not measured)."""
        if ended - began <= self.tick:
            return False
        self.count += 1
        log.warning("the controller was held up for %.2f s (over a tick)", ended - began)
        self._unmeasured.update(running)
        return True

    def launched(self, instance_id: str) -> None:
        """A new step starts on the instance (whatever became of its last one)."""
        self._unmeasured.discard(instance_id)

    def measured(self, instance_id: str) -> bool:
        """The instance's step just ended: whether its time is the machine's (it spans no
        stall of ours)."""
        if instance_id in self._unmeasured:
            self._unmeasured.discard(instance_id)
            return False
        return True
