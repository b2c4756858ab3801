"""One instance as the scheduler sees it: where it runs, its running step, the batch gathered for
its next step, and the requests whose state (tokens, KV cache) it holds.

The scheduler decides what joins a batch (Algorithm 3); this is the batch's bookkeeping: the
full-sequence and cache-step tokens gathered so far, whether another request fits, what the
batch's step costs on this instance's latency curves, and handing the batch over at launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dilaserve.control.profile import Curve
from dilaserve.protocol import CACHED_KINDS, StepKind

# A running step is overdue (`overdue`: the instance stalled, e.g. its worker stopped or starved
# of CPU) past STALL_FACTOR times its predicted time at the measured speed, and past
# STALL_SECONDS: robustness constants, not fitted to a trace. Far below the step timeout, which
# kills: a stalled instance only takes no new work until its step ends.
STALL_FACTOR = 10.0
STALL_SECONDS = 1.0


@dataclass
class InstanceState:
    instance_id: str
    tp: int
    max_batch_tokens: int
    full_curve: Curve  # latency of sequence steps (full, recompute, prefill) on this TP degree
    cache_curve: Curve | None = None  # latency of cache (block, commit) steps, with a KV cache
    node: int = 0
    gpus: tuple[int, ...] = ()
    # Alg. 3's maxBatchSize as Stage 1 chose it for this TP degree (`PlannerConfig.batch_limits`):
    # (full-sequence, cache-step) tokens, each family bounded alone; None: `max_batch_tokens`
    # over the mixed batch
    planned_batch: tuple[int, int | None] | None = None
    draining: bool = False  # being stopped: finishes its running step, takes no new work
    stalled: bool = False  # its running step is overdue: takes no new work until it ends
    busy: bool = False
    launched_at: float = 0.0  # when the running step started
    busy_until: float = 0.0  # predicted end of the running step
    pending: list[str] = field(default_factory=list)  # the gathered batch, in order
    pending_kinds: list[StepKind] = field(default_factory=list)
    pending_tokens: list[int] = field(default_factory=list)
    pending_full: int = 0  # full-sequence tokens of the gathered batch
    pending_cache: int = 0  # cache-step tokens of the gathered batch
    running_full: int = 0  # full-sequence tokens of the running step's batch
    running_cache: int = 0  # cache-step tokens of the running step's batch
    running: frozenset[str] = frozenset()  # the running step's requests (while `busy`)
    solo: bool = False  # the gathered batch is one request that must run alone
    holds: set[str] = field(default_factory=set)  # requests whose state lives here
    residents: int = 0  # requests assigned here (running, waiting or held)
    resident_tokens: int = 0  # their tokens: what a full-sequence step over them reads
    lost_residents: int = 0  # of them, requests that cannot meet their deadline any more
    # (tokens, step latency) last asked of each curve: placement asks every candidate, and
    # within a round only the chosen instance's batch changes
    full_memo: tuple[int, float] = (0, 0.0)
    cache_memo: tuple[int, float] = (0, 0.0)
    seconds_memo: tuple = (None, (0.0, 0.0))  # ((resident tokens, residents), step_seconds)

    @property
    def takes_work(self) -> bool:
        return not (self.draining or self.stalled)

    def overdue(self, now: float, slowdown: float = 1.0) -> bool:
        """Has the running step run past `STALL_FACTOR` times its predicted time (at the
        measured `slowdown`, never below the profile's) and past `STALL_SECONDS`?"""
        if not self.busy:
            return False
        predicted = (self.busy_until - self.launched_at) * max(slowdown, 1.0)
        return now - self.launched_at > max(STALL_FACTOR * predicted, STALL_SECONDS)

    def has_room(
        self, tokens: int, max_requests: float, solo: bool = False, cached: bool = False
    ) -> bool:
        """A batch takes a request's step (`cached`: a cache step) while within its batch tokens
        and `max_requests`; an empty one takes any. A request that runs alone (`solo`) needs an
        empty batch, and a batch holding one takes no one else."""
        if not self.pending:
            return True
        if solo or self.solo or len(self.pending) >= max_requests:
            return False
        if self.planned_batch is None:
            return self.pending_full + self.pending_cache + tokens <= self.max_batch_tokens
        full, cache = self.planned_batch
        if cached and cache is not None:
            return self.pending_cache + tokens <= cache
        return self.pending_full + tokens <= full

    def gather(self, request_id: str, kind: StepKind, tokens: int, solo: bool = False) -> None:
        """Add a request's next step (`tokens` processed) to the batch; `solo`: it runs alone
        (the batch is empty, and takes no one else)."""
        self.solo = solo
        self.pending.append(request_id)
        self.pending_kinds.append(kind)
        self.pending_tokens.append(tokens)
        if kind in CACHED_KINDS:
            self.pending_cache += tokens
        else:
            self.pending_full += tokens

    def ungather(self, request_id: str) -> None:
        """Take a request out of the batch, if it is there."""
        if request_id not in self.pending:
            return
        i = self.pending.index(request_id)
        kind, tokens = self.pending_kinds.pop(i), self.pending_tokens.pop(i)
        del self.pending[i]
        self.solo = self.solo and bool(self.pending)
        if kind in CACHED_KINDS:
            self.pending_cache -= tokens
        else:
            self.pending_full -= tokens

    def clear(self) -> list[str]:
        """Empty the batch; returns the requests that were in it."""
        gathered = self.pending
        self.pending, self.pending_kinds, self.pending_tokens = [], [], []
        self.pending_full = self.pending_cache = 0
        self.solo = False
        return gathered

    def next_batch(self) -> tuple[int, int]:
        """(full-sequence, cache-step) tokens of this instance's next step as known now: the
        gathered batch and, while a step runs, that step's requests, which come back to it
        (Alg. 3's `inst.batchSize`: the instance's whole batch, not only what joined it)."""
        if not self.busy:
            return self.pending_full, self.pending_cache
        return self.pending_full + self.running_full, self.pending_cache + self.running_cache

    def next_batch_requests(self) -> int:
        """Requests in this instance's next step as known now (see `next_batch`)."""
        return len(self.pending) + (len(self.running) if self.busy else 0)

    def latency(self, full: int, cache: int) -> float:
        """Seconds of one step over `full` full-sequence and `cache` cache-step tokens."""
        seconds = 0.0
        if full:
            if self.full_memo[0] != full:
                self.full_memo = (full, self.full_curve.at(full))
            seconds += self.full_memo[1]
        if cache:
            if self.cache_memo[0] != cache:
                assert self.cache_curve is not None  # cache tokens come only with a cache
                self.cache_memo = (cache, self.cache_curve.at(cache))
            seconds += self.cache_memo[1]
        return seconds

    def launch(self, now: float) -> None:
        """Start the gathered batch: the instance is busy until its predicted end and holds
        every request in it."""
        self.launched_at = now
        self.busy_until = now + self.latency(self.pending_full, self.pending_cache)
        self.running_full, self.running_cache = self.pending_full, self.pending_cache
        self.running = frozenset(self.pending)
        self.busy = True
        self.holds.update(self.clear())
