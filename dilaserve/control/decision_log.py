"""The decisions a driver carried out, as one line per event and a digest of them: what the
simulator-runtime parity test and the pinned digests compare. On the hot path of every
simulated event (compiled by `make compile`)."""

from __future__ import annotations

import hashlib

from dilaserve.control.decisions import Decisions
from dilaserve.protocol import StepKind

_KIND_TEXT = {kind: kind.value for kind in StepKind}
_THRESHOLD_TEXT: dict[float, str] = {}  # str() of the thresholds seen: a log line names many


def _text(threshold: float) -> str:
    text = _THRESHOLD_TEXT.get(threshold)
    if text is None:
        text = str(threshold)
        if len(_THRESHOLD_TEXT) < 4096:
            _THRESHOLD_TEXT[threshold] = text
    return text


class DecisionLog:
    """The decisions a driver carried out, one line per event that decided anything, and
    their digest. Two drivers that fed the scheduler the same events have equal logs: this is
    what the simulator-runtime parity test compares."""

    def __init__(self, keep_lines: bool = False):
        self.lines: list[str] | None = [] if keep_lines else None
        self._hash = hashlib.sha256()

    def record(self, now: float, event: str, d: Decisions) -> None:
        if not (d.launches or d.finished or d.releases or d.reconfiguration):
            return
        parts = [f"{now:.6f}", event]
        for launch in d.launches:
            items = ",".join(
                [
                    f"{i.request_id}:{_text(i.threshold)}:{_KIND_TEXT[i.kind]}"
                    for i in launch.batch.items
                ]
            )
            parts.append(f"{launch.instance_id}[{items}]")
        parts += [f"r{i}/{r}" for i, r in d.releases]
        parts += [f"f{rid}" for rid in d.finished]
        if d.reconfiguration is not None:
            parts.append(f"plan{sorted(d.reconfiguration.target.items())}")
        line = " ".join(parts)
        self._hash.update(line.encode())
        if self.lines is not None:
            self.lines.append(line)

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()
