"""What a request's steps cost under each KV-cache mode: their kinds, tokens and latency curves.

A family declares its cache semantics (DESIGN section 1); the control plane, the planner and the
simulator read them here (`SchedulerConfig.costs`, `PlannerConfig.costs`, `SimulationSpec.costs`)
and nowhere else branch on the cache mode; only the engine, which runs the steps, does too.
Every step falls in one of two groups that an instance batches and a latency profile prices on
separate curves: *sequence* steps run the prompt and the output window up to (at least) the
current block, *block* steps run one or two blocks against stored K/V (`protocol.CACHED_KINDS`).

| mode | new to an instance | a block's first step | other steps | moving mid-block |
| --- | --- | --- | --- | --- |
| none | full (P + L) | full | full | free: no cache |
| prefix, dual | recompute (P + L) | recompute | cache (B) | never: approximate cache |
| block (exact) | prefill (P + blocks) | commit (2B) | block (B) | priced: a prefill |

Algorithms 2/4 and 1/5 count a request's remaining steps as *boundary* steps (one per block not
yet started: recompute, or commit with an exact cache) and *inner* steps (the rest: cache or
block steps). Without a cache every step is a full step over the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from dilaserve.config import DEFAULT_BLOCK_LEN
from dilaserve.protocol import KVCacheMode, StepKind
from dilaserve.request import (  # (compiled constants: `request.py` says why)
    KIND_BLOCK,
    KIND_CACHE,
    KIND_COMMIT,
    KIND_FULL,
    KIND_PREFILL,
    KIND_RECOMPUTE,
    KINDS_CACHED,
    MODE_BLOCK,
    MODE_NONE,
)


@dataclass(frozen=True, slots=True)
class StepCosts:
    mode: KVCacheMode = KVCacheMode.DUAL
    block_len: int = DEFAULT_BLOCK_LEN

    def __post_init__(self):
        try:
            object.__setattr__(self, "mode", KVCacheMode(self.mode))
        except ValueError:
            modes = [m.value for m in KVCacheMode]
            raise ValueError(f"{self.mode=} must be one of {modes}") from None
        if self.block_len <= 0:
            raise ValueError(f"{self.block_len=} must be positive")

    @classmethod
    def of(cls, spec: StepCosts | int | None) -> StepCosts:
        """`spec` itself, or the approximate cache of block `spec` (None: no cache)."""
        if isinstance(spec, StepCosts):
            return spec
        return cls(KVCacheMode.NONE) if spec is None else cls(KVCacheMode.DUAL, spec)

    @property
    def cached(self) -> bool:
        return self.mode is not MODE_NONE

    @property
    def exact(self) -> bool:
        return self.mode is MODE_BLOCK

    @property
    def cache_block(self) -> int | None:
        """The block length Alg. 4/5 count steps by, or None without a cache."""
        return self.block_len if self.cached else None

    def next_kind(self, request, has_cache: bool) -> StepKind:
        """The kind of `request`'s next step on an instance that holds its cache or not."""
        return request.next_kind(self.mode, has_cache)

    @property
    def kinds(self) -> tuple[StepKind, ...]:
        """Every kind a request's steps take, the sequence step's first: what a latency
        profile of this cache must price."""
        return tuple(dict.fromkeys((self.sequence_kind, self.inner_kind, self.boundary_kind)))

    @property
    def sequence_kind(self) -> StepKind:
        """The kind of a step of a request new to an instance (the sequence group's curve)."""
        if self.exact:
            return KIND_PREFILL
        return KIND_RECOMPUTE if self.cached else KIND_FULL

    @property
    def inner_kind(self) -> StepKind:
        """The kind of a block's later steps (the block group's curve, with a cache)."""
        if self.exact:
            return KIND_BLOCK
        return KIND_CACHE if self.cached else KIND_FULL

    @property
    def boundary_kind(self) -> StepKind:
        """The kind of a block's first step where the request's cache is."""
        return KIND_COMMIT if self.exact else self.sequence_kind

    def tokens(self, kind: StepKind, num_tokens: int) -> int:
        """Tokens a step of `kind` processes for a request of `num_tokens` (prompt + window):
        one block for cache and block steps, two for a commit, else the whole sequence (a
        prefill runs up to the current block's end: `request_tokens` prices it so)."""
        if kind is KIND_COMMIT:
            return 2 * self.block_len
        return self.block_len if kind in KINDS_CACHED else num_tokens

    def request_tokens(self, kind: StepKind, request) -> int:
        """Tokens a step of `kind` processes for `request` as it stands: a prefill runs the
        prompt and the output up to the end of its current block (its blocks at absolute
        positions), the other kinds as `tokens` says."""
        if kind is not KIND_PREFILL:
            return self.tokens(kind, request.num_tokens)
        end = (
            request.prompt_len - request.block_offset + (request.current_block + 1) * self.block_len
        )
        return min(end, request.num_tokens)

    def boundary_batch_tokens(self, sequence_tokens, num_requests: int = 1):
        """Tokens of a boundary step over `num_requests` requests: a commit of two blocks each
        with an exact cache, else `sequence_tokens` (their whole sequences; numbers or arrays)."""
        return 2 * self.block_len * num_requests if self.exact else sequence_tokens

    def inner_tokens(self, num_tokens: int) -> int:
        return self.tokens(self.inner_kind, num_tokens)

    def stays_with_cache(self, kind: StepKind) -> bool:
        """Whether a step of `kind` must run where the request's cache is: an approximate
        cache's mid-block steps. (An exact cache moves at the price of a prefill.)"""
        return kind is KIND_CACHE
