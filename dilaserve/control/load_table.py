"""Load control's inputs for every request in flight, kept as arrays between events.

Algorithm 2/4 walks all requests in service order on every run. Rebuilding that view from the
request objects costs O(n) Python work per event; this table keeps each request's row (predicted
steps per threshold, tokens, recompute steps left) in a slot, updates rows as steps complete and
predictions refresh, and re-sorts slots only when requests come or go. A completed step is only
noted (a list append, the bulk of every event); the notes are applied in one vectorised pass
when a row is next read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dilaserve.control.thresholds import allowed_ranks, load_matrix


class LoadTable:
    def __init__(self, num_thresholds: int, capacity: int = 64):
        self._slots: dict[str, int] = {}
        self._ids: list[str | None] = []
        self._free: list[int] = []
        self.steps = np.zeros((0, num_thresholds))  # predicted at the last refresh
        self.counted = np.zeros(0)  # steps done since then
        self.tokens = np.zeros(0)
        self._token_sum = 0  # of the rows' tokens (integers: exactly the array's sum)
        self.recompute = np.zeros(0)
        self.ranks = np.zeros(0, dtype=np.int64)
        self._keys = np.zeros((0, 3))  # (-priority, arrival, admission sequence)
        self._left_out = np.zeros(0, dtype=bool)  # rows Alg. 2/4 skips (lost work)
        self._grow(capacity)
        self._order: np.ndarray | None = None  # active slots in service order
        # slot -> steps done and recompute steps left, not yet stored (the same keys, inserted
        # together: in the same order)
        self._stepped: dict[int, int] = {}
        self._recompute_now: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slots

    def _grow(self, size: int) -> None:
        old = len(self._ids)

        def extend(a: np.ndarray, fill) -> np.ndarray:
            out = np.full((size, *a.shape[1:]), fill, dtype=a.dtype)
            out[:old] = a[:old]
            return out

        self.steps, self.tokens = extend(self.steps, 0.0), extend(self.tokens, 0.0)
        self.counted = extend(self.counted, 0.0)
        self.recompute, self.ranks = extend(self.recompute, 0.0), extend(self.ranks, 0)
        self._keys, self._left_out = extend(self._keys, 0.0), extend(self._left_out, False)
        self._ids += [None] * (size - old)
        self._free += range(size - 1, old - 1, -1)

    def add(self, request_id: str, order_key: tuple[float, float, float], num_tokens: int) -> None:
        """A new row; `order_key` sorts service order ascending (higher priority first)."""
        if request_id in self._slots:
            raise ValueError(f"request {request_id} is already in the load table")
        if not self._free:
            self._grow(2 * len(self._ids))
        slot = self._free.pop()
        self._slots[request_id] = slot
        self._ids[slot] = request_id
        self._keys[slot] = order_key
        self._left_out[slot] = False
        self.tokens[slot] = num_tokens
        self._token_sum += num_tokens
        self.ranks[slot] = -1  # not yet decided
        self._order = None

    def leave_out(self, request_id: str) -> None:
        """Alg. 2/4 skips the row from now on: it is served after every request still on time
        (`lost_work.py`), so its load takes none of their capacity. Admission still counts it."""
        self._left_out[self._slots[request_id]] = True

    def remove(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._token_sum -= int(self.tokens[slot])
            self._ids[slot] = None
            self._free.append(slot)
            self._order = None

    def set_rows(
        self, request_ids: Sequence[str], steps: np.ndarray, recompute_left: Sequence[int]
    ) -> None:
        """Fresh predictions, [len(request_ids), thresholds], and recompute steps left."""
        slots = [self._slots[rid] for rid in request_ids]
        self._count()
        self.steps[slots] = steps
        self.counted[slots] = 0.0
        self.recompute[slots] = recompute_left

    def steps_of(self, request_id: str) -> list[float]:
        """The request's estimate now, per threshold: its prediction, one step less per step
        done since (never below one)."""
        slot = self._slots[request_id]
        self._count()
        done = float(self.counted[slot])
        return [max(steps - done, 1.0) for steps in self.steps[slot].tolist()]

    def count_step(self, requests: Sequence) -> None:
        """One step done for each of `requests` (in the table): the estimates count down one
        step until the next refresh; recompute steps left are re-read."""
        stepped, recompute = self._stepped, self._recompute_now
        for r in requests:
            slot = self._slots[r.request_id]
            stepped[slot] = stepped.get(slot, 0) + 1
            recompute[slot] = r.num_blocks_to_recompute

    def _count(self) -> None:
        """Store the steps noted since the last read (counted in a dict: `np.add.at` over a
        list of slots cost more than the rest of the table's upkeep)."""
        if self._stepped:
            n = len(self._stepped)
            slots = np.fromiter(self._stepped, np.int64, n)
            self.counted[slots] += np.fromiter(self._stepped.values(), np.float64, n)
            self.recompute[slots] = np.fromiter(self._recompute_now.values(), np.float64, n)
            self._stepped, self._recompute_now = {}, {}

    def lowest_load(self, min_priority: float, costs, column: int = -1) -> tuple[float, float, int]:
        """(load, tokens, rows) of the rows of priority >= `min_priority`, each at its steps
        left at the lowest threshold (`column`: the last, unless a quality floor closes it):
        admission's view of the work served before a newcomer, in one vectorised pass."""
        slots = self._service_order()
        slots = slots[-self._keys[slots, 0] >= min_priority]
        self._count()
        steps = np.maximum(self.steps[slots, column] - self.counted[slots], 1.0)[:, None]
        loads = load_matrix(steps, self.tokens[slots], self.recompute[slots], costs)
        return float(loads.sum()), float(self.tokens[slots].sum()), len(slots)

    def lowest_rows(self, column: int = -1) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """(ids, steps left at the lowest threshold (`column`), recompute steps left, tokens) of
        every row, lost ones too (served last, they still take their steps): what the batched
        time model prices the requests sharing the batches by (`BatchedTime.in_flight`)."""
        slots = self._service_order()
        self._count()
        steps = np.maximum(self.steps[slots, column] - self.counted[slots], 1.0)
        ids = [self._ids[s] for s in slots.tolist()]
        return ids, steps, self.recompute[slots], self.tokens[slots]

    def lowest_priority(self) -> float:
        """The lowest priority of any row (+inf: none)."""
        slots = self._service_order()
        return float(-self._keys[slots, 0].max()) if slots.size else float("inf")

    def mean_tokens(self) -> float:
        """The rows' mean tokens (every run of Alg. 2/4 asks): their sum is kept as rows come
        and go, exactly the array's (integers, far below 2**53)."""
        if not self._slots:
            return 0.0
        return self._token_sum / len(self._slots)

    def _service_order(self) -> np.ndarray:
        if self._order is None:
            slots = np.fromiter(self._slots.values(), dtype=np.int64, count=len(self._slots))
            keys = self._keys[slots]
            self._order = slots[np.lexsort((keys[:, 2], keys[:, 1], keys[:, 0]))]
        return self._order

    def run(self, capacity: float, costs, width: int | None = None) -> list[tuple[str, int]]:
        """Algorithm 2/4 over every row not left out, on the ladder's first `width` thresholds
        (default: all; the last of them is every request's lowest); returns (request, rank) for
        rows whose rank changed.

        A rank is the index, in the descending threshold ladder, of the highest allowed one.
        """
        order = self._service_order()
        order = order[~self._left_out[order]]
        if order.size == 0:
            return []
        self._count()
        steps = np.maximum(self.steps[order] - self.counted[order, None], 1.0)
        steps = steps[:, :width]
        loads = load_matrix(steps, self.tokens[order], self.recompute[order], costs)
        ranks = allowed_ranks(loads, capacity)
        changed = np.flatnonzero(ranks != self.ranks[order])
        self.ranks[order] = ranks
        return [(self._ids[order[i]], int(ranks[i])) for i in changed]
