"""The KV-cache policies: what a step stores and what it computes.

Approximate (bidirectional models):
- none: nothing is stored; every step is a full forward.
- prefix: a recompute step stores the prompt and the finished blocks; a cache step recomputes the
  current block and everything after it.
- dual: a recompute step stores everything outside the current block (prefix and the still-masked
  suffix); a cache step recomputes only the current block's `block_len` tokens.
The stored K/V are approximations (Fast-dLLM): they are refreshed at each block's first step.
With a logit shift (Dream reads position i from the output at i - 1), a cache step also runs the
position just before the block (`shift`), unless the family's rule commits a block's first
position before any cache step (Dream's: the engine passes shift 0).

Exact (block-causal models, `block`): the cache holds the K/V of positions [0, n), all in blocks
before the current one, which never change. Every step runs [n, end of the current block)
against them and stores what lies before the current block: a prefill when n = 0, a commit of
the block just finished, or nothing (a block step).

Where the K/V live: each request has one slot (`KVSlot`) for its whole sequence, allocated at its
first store and written in place. A store copies a recompute or prefill forward's K/V into the
slot's head; a cache step's layers write the queried tokens' K/V right after the stored ones and
attend to the slot in place (`KVContext`), so a request's K/V are never stacked with its batch
mates' or concatenated with its block's. The exact cache's commit step needs no copy at all:
the block it stores is already in place, at the head of what it wrote.
"""

from __future__ import annotations

from dilaserve.engine.sequence import CachedKV, Sequence
from dilaserve.models.common import KVContext, KVSlot
from dilaserve.protocol import KVCacheMode


def query_span(mode: KVCacheMode, seq: Sequence, shift: int = 0) -> tuple[int, int]:
    """Absolute [start, end) of the positions a cache step runs through the model."""
    start, end = seq.block_span(seq.block)
    if mode is KVCacheMode.PREFIX:
        end = seq.gen_len
    return seq.prompt_len + start - shift, seq.prompt_len + end


def cached_ranges(mode: KVCacheMode, seq: Sequence, shift: int = 0) -> list[tuple[int, int]]:
    """Absolute [start, end) ranges whose K/V a recompute step keeps for the following cache
    steps, in the order they are stored: the prefix, then (dual) what follows the block."""
    q_start, q_end = query_span(mode, seq, shift)
    if mode is KVCacheMode.PREFIX:
        return [(0, q_start)]
    return [(0, q_start), (q_end, seq.total_len)]


def store(mode: KVCacheMode, seq: Sequence, keys, values, row: int, shift: int = 0) -> None:
    """Keep row `row` of a recompute forward's per-layer K/V [batch, kv_heads, seq, hd]."""
    slot = _slot(seq, keys)
    length = 0
    for start, end in cached_ranges(mode, seq, shift):
        n = end - start
        for cache, fresh in zip(slot.keys + slot.values, keys + values):
            cache[:, length : length + n] = fresh[row, :, start:end]
        length += n
    seq.kv = CachedKV(seq.block, length, slot)


def exact_span(seq: Sequence) -> tuple[int, int]:
    """Absolute [start, end) a block-causal step runs: from the cached prefix's end to the end
    of the current block."""
    block = seq.block
    return seq.cached_len, min(seq.absolute_block_start(block + 1), seq.total_len)


def exact_store_end(seq: Sequence) -> int:
    """Where the exact prefix will end after this step: the current block's start."""
    return seq.absolute_block_start(seq.block)


def store_exact(seq: Sequence, keys, values, row: int) -> None:
    """Copy into the slot the exact prefix [0, current block start), the head of row `row` of
    a forward that began at position 0 (a prefill)."""
    slot = _slot(seq, keys)
    end = exact_store_end(seq)
    for cache, fresh in zip(slot.keys + slot.values, keys + values):
        cache[:, :end] = fresh[row, :, :end]
    seq.kv = CachedKV(seq.block, end, slot)


def commit_exact(seq: Sequence) -> None:
    """Extend the exact prefix to the current block's start after a step that ran against the
    cache: the K/V are in the slot already, written by the step's layers."""
    seq.kv = CachedKV(seq.block, exact_store_end(seq), seq.kv.slot)


def build_context(seqs: list[Sequence], query_lens: list[int]) -> KVContext:
    """The sequences' slots, each with its stored length and the number of tokens it queries."""
    return KVContext(
        [s.kv.slot for s in seqs],
        [s.kv.length for s in seqs],
        list(query_lens),
        [None] * len(seqs),
    )


def slot_bytes(keys, capacity: int) -> int:
    """Bytes of a slot of `capacity` positions shaped like a forward's per-layer keys (and as
    many values)."""
    per_position = sum(k.shape[1] * k.shape[3] for k in keys) * keys[0].element_size()
    return 2 * per_position * capacity


def _slot(seq: Sequence, keys) -> KVSlot:
    """The sequence's slot, allocated for its whole length at its first store."""
    if seq.kv is not None:
        return seq.kv.slot
    return KVSlot.like(keys, seq.total_len)
