"""What `serve` says while it starts: each instance as it comes up, a line while none does, and
a calibration's warnings a line per kind (not one per profile point)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dilaserve.calibration.store import Calibration, CalibrationKey, _warnings
from dilaserve.cluster import backends
from dilaserve.cluster.backends import WorkerEvent, start_all
from dilaserve.control.decisions import InstanceSpec


class SlowBackend:
    """Instances come up one per `up_every` polls; `fail` fails instead."""

    def __init__(self, up_every: int, fail: str | None = None):
        self.up_every, self.fail, self.polls, self.waiting = up_every, fail, 0, []
        self.stopped = False

    def start(self, spec):
        self.waiting.append(spec.instance_id)

    def poll(self, timeout):
        self.polls += 1
        if self.polls % self.up_every or not self.waiting:
            return []
        name = self.waiting.pop(0)
        kind = "failed" if name == self.fail else "up"
        return [WorkerEvent(kind, name, error="out of memory" if kind == "failed" else "")]

    def shutdown(self):
        self.stopped = True


def specs(n: int) -> list[InstanceSpec]:
    return [InstanceSpec(f"i{k}", 0, 1, (k,), None) for k in range(n)]


def test_each_instance_is_reported_as_it_comes_up(monkeypatch):
    monkeypatch.setattr(backends, "LOADING_NOTE_SECONDS", 0.0)  # a note at every poll
    lines = []
    start_all(SlowBackend(up_every=3), specs(2), timeout=60.0, report=lines.append)
    ups = [line for line in lines if " up " in line]
    assert [u.split(" (")[0] for u in ups] == ["instance i0 up", "instance i1 up"]
    assert "(1/2," in ups[0] and "(2/2," in ups[1]
    assert any(line.startswith("still loading i0, i1 (") for line in lines)


def test_a_failed_instance_stops_the_start_with_its_error():
    backend = SlowBackend(up_every=1, fail="i1")
    with pytest.raises(RuntimeError, match="instance i1 failed: out of memory"):
        start_all(backend, specs(2), timeout=60.0)
    assert backend.stopped


def test_implausible_profile_points_are_one_line():
    points = tuple(
        f"tp=1 recompute step of {64 * 2**k} tokens: repeats spread 40%" for k in range(6)
    )
    other = "step predictor held-out error 50.4% is over 35.1%"
    key = CalibrationKey("m", "0" * 64, "cuda", "bfloat16")
    found = Calibration(Path("/c"), key, (1,), "", points + (other,))
    lines = _warnings(found)
    assert len(lines) == 2
    assert lines[0] == f"calibration /c: {other}"
    assert "6 profile points stayed implausible (tp=1 recompute step of 64 tokens" in lines[1]
    assert "and 5 more; listed in its calibration.json" in lines[1]
