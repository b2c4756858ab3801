"""Restoring lost capacity: an instance that dies while serving is replaced at once, and a
replacement that fails to start (the process could not be spawned) or to load is tried again
after a backoff that doubles, up to `MAX_BACKOFF` seconds apart, until one is up.

Bookkeeping only: the controller starts what `lost` and `due` return, and tells `up`, which
says how long the capacity was lost (the controller logs it).
"""

from __future__ import annotations

import dataclasses

from dilaserve.control.decisions import InstanceSpec

FIRST_BACKOFF = 1.0  # seconds before the first retry of a replacement that failed
MAX_BACKOFF = 60.0  # seconds between retries, at most


@dataclasses.dataclass(frozen=True)
class _Retry:
    due: float
    spec: InstanceSpec  # the replacement that failed
    attempt: int  # retries made so far
    lost_at: float  # when the serving instance it replaces was lost


class Replacements:
    def __init__(self):
        # replacement starting -> (retries before it, when the instance it replaces was lost)
        self._attempts: dict[str, tuple[int, float]] = {}
        self._retries: list[_Retry] = []
        self._count = 0

    @property
    def pending(self) -> bool:
        """Is lost capacity not yet restored (a replacement loading or waiting to retry)?"""
        return bool(self._attempts or self._retries)

    def lost(self, spec: InstanceSpec, was_serving: bool, now: float) -> InstanceSpec | None:
        """An instance failed: the replacement to start now (for one that was serving), or
        None (a replacement that failed is retried later; other instances are not replaced)."""
        starting = self._attempts.pop(spec.instance_id, None)
        if was_serving:
            return self._replacement(spec, 0, now)
        if starting is not None:
            attempt, lost_at = starting
            delay = min(FIRST_BACKOFF * 2**attempt, MAX_BACKOFF)
            self._retries.append(_Retry(now + delay, spec, attempt + 1, lost_at))
        return None

    def up(self, instance_id: str, now: float) -> float | None:
        """An instance is up: the seconds since the capacity it restores was lost, if it is a
        replacement."""
        starting = self._attempts.pop(instance_id, None)
        return None if starting is None else now - starting[1]

    def due(self, now: float) -> list[InstanceSpec]:
        """Replacements whose retry is due, to start now."""
        ready = [r for r in self._retries if r.due <= now]
        self._retries = [r for r in self._retries if r.due > now]
        return [self._replacement(r.spec, r.attempt, r.lost_at) for r in ready]

    def _replacement(self, spec: InstanceSpec, attempt: int, lost_at: float) -> InstanceSpec:
        self._count += 1
        name = f"{spec.instance_id.split('.')[0]}.{self._count}"
        self._attempts[name] = (attempt, lost_at)
        return dataclasses.replace(spec, instance_id=name)
