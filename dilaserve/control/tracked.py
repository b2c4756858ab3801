"""The scheduler's record of a request it tracks, which placement, load control and lost work
read and update (the scheduler owns them)."""

from __future__ import annotations

from dataclasses import dataclass

from dilaserve.request import Request


@dataclass
class Tracked:
    request: Request
    seq: int  # admission order, the last tie-break of service order
    refreshed_at: int = -1  # committed tokens at the last prediction refresh
    allowed: tuple[float, ...] = ()
    instance: str | None = None  # where its state lives
    bound: str | None = None  # the only instance it may use (no migration / on-arrival)
    needs_threshold: bool = True
    order: tuple = ()  # (-priority, arrival, seq): arrival service order
    lost: bool = False  # it cannot meet its deadline any more (`lost_work.py`)
