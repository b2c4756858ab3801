"""A memory budget for an instance's K/V (`EngineConfig.kv_memory`): the requests' slots and the
CUDA graphs' static buffers together, so that neither can take the memory the other needs.

The graphs' static buffers are sized once, when the engine starts: they are reserved from the
budget first, and an engine whose buffers alone exceed it refuses to start, naming both. A
request's slot is taken at its first store (`kv_cache.py`); when it would take the slots past
what is left, the slots of the requests stepped least recently (none of the step running) are
dropped. Such a request's next step runs without its cache, as after a move: an approximate
cache recomputes (and stores again), an exact one prefills again (the same K/V, so the same
tokens). When even dropping every other slot leaves no room, the step runs and stores nothing,
and the request's next step recomputes again. `evictions` and `unstored` count both.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Set

GIB = 1 << 30


class KVBudget:
    def __init__(self, limit_gib: float | None, reserved_bytes: int = 0):
        self.limit = None if limit_gib is None else limit_gib * GIB
        if self.limit is not None and reserved_bytes > self.limit:
            raise ValueError(
                f"the CUDA graphs' static buffers take {reserved_bytes / GIB:.3g} GiB, more "
                f"than the K/V memory of {limit_gib:g} GiB (kv_memory): give fewer graph rows "
                "(cuda_graphs), a shorter cuda_graph_context, or more memory"
            )
        self.reserved = reserved_bytes
        self._held: OrderedDict[str, int] = OrderedDict()  # slot bytes, least recent first
        self.evictions = 0  # slots dropped to make room
        self.unstored = 0  # stores skipped for want of room

    @property
    def held_bytes(self) -> int:
        """Bytes of the slots held, the static buffers included."""
        return self.reserved + sum(self._held.values())

    def stepped(self, request_ids: Set[str]) -> None:
        """The requests of the step now running were stepped most recently."""
        for rid in request_ids:
            if rid in self._held:
                self._held.move_to_end(rid)

    def take(self, request_id: str, size: int, stepping: Set[str], drop: Callable[[str], None]):
        """Room for `request_id`'s new slot of `size` bytes: True once it is counted, after
        `drop(rid)` of the least recently stepped slots outside `stepping` where needed; False
        (nothing dropped) when no room can be made."""
        if self.limit is None:
            return True
        over = self.held_bytes + size - self.limit
        if over > 0:
            victims, freed = [], 0
            for rid, held in self._held.items():
                if freed >= over:
                    break
                if rid not in stepping:
                    victims.append(rid)
                    freed += held
            if freed < over:
                self.unstored += 1
                return False
            for rid in victims:
                del self._held[rid]
                drop(rid)
            self.evictions += len(victims)
        self._held[request_id] = size
        return True

    def release(self, request_id: str) -> None:
        self._held.pop(request_id, None)
