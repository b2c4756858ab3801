"""Which instances' running steps count as hung (the controller kills those).

A step may run for the instance's step timeout: the configured or derived timeout (seconds at
the profile's speed) times the instance's measured slowdown (`control/speed.py`), so that a
machine that is slow, not hung, keeps its instances (a hung instance reports no steps, and its
slowdown decays back to the profile's). The last instance serving is killed only once its step
has run `LAST_INSTANCE_GRACE` times its timeout: within it, it may be slow (spared: killing it
would leave nothing serving, logged once per step); past it, it is hung, and with nothing
killed nothing would ever serve again. Bookkeeping only: the caller passes the time and kills.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from dilaserve.control.speed import MeasuredSpeed

log = logging.getLogger("dilaserve.cluster")
LAST_INSTANCE_GRACE = 10.0


class HangWatch:
    def __init__(self, step_timeout: float, speed: MeasuredSpeed):
        self.step_timeout = step_timeout  # seconds at the profile's speed
        self.speed = speed
        self.hung: set[str] = set()  # killed as hung (or taken out), death not yet seen
        self._spared: set[str] = set()  # past the timeout, but the last serving (logged)

    def timeout_of(self, instance_id: str) -> float:
        """Seconds a step of the instance may run before it counts as hung."""
        return self.step_timeout * max(self.speed.instance_ratio(instance_id), 1.0)

    def to_kill(
        self, launched: Mapping[str, float], instances: Iterable[str], now: float
    ) -> list[str]:
        """The instances to kill now, of those whose running step started at `launched[iid]`;
        `instances` are every instance up. Each returned is counted hung from now on."""
        serving = set(instances)
        kill = []
        for iid, start in launched.items():
            seconds = now - start
            if seconds <= self.timeout_of(iid) or iid in self.hung:
                continue
            last = serving - self.hung <= {iid}
            if last and seconds <= LAST_INSTANCE_GRACE * self.timeout_of(iid):
                if iid not in self._spared:
                    self._spared.add(iid)
                    log.warning(
                        "instance %s: a step has run %.0f s, past its timeout; not killed yet: "
                        "it is the last instance serving (killed past %.0fx the timeout)",
                        iid,
                        seconds,
                        LAST_INSTANCE_GRACE,
                    )
                continue
            log.error("instance %s: a step has run %.0f s; killing it as hung", iid, seconds)
            self.hung.add(iid)  # its death is reported, and handled, as any other
            kill.append(iid)
        return kill

    def stepped(self, instance_id: str) -> None:
        """The instance finished a step: a later one is judged afresh."""
        self._spared.discard(instance_id)

    def gone(self, instance_id: str) -> None:
        """The instance's death was handled."""
        self.hung.discard(instance_id)
        self._spared.discard(instance_id)
