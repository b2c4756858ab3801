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
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from dilaserve.engine.sequence import CachedKV, Sequence
from dilaserve.models.common import KVContext
from dilaserve.protocol import KVCacheMode


def query_span(mode: KVCacheMode, seq: Sequence, shift: int = 0) -> tuple[int, int]:
    """Absolute [start, end) of the positions a cache step runs through the model."""
    start, end = seq.block_span(seq.block)
    if mode is KVCacheMode.PREFIX:
        end = seq.gen_len
    return seq.prompt_len + start - shift, seq.prompt_len + end


def cached_positions(mode: KVCacheMode, seq: Sequence, shift: int = 0) -> torch.Tensor:
    """Absolute positions whose K/V a recompute step keeps for the following cache steps."""
    q_start, q_end = query_span(mode, seq, shift)
    prefix = torch.arange(0, q_start)
    if mode is KVCacheMode.PREFIX:
        return prefix
    return torch.cat((prefix, torch.arange(q_end, seq.total_len)))


def store(mode: KVCacheMode, seq: Sequence, keys, values, row: int, shift: int = 0) -> None:
    """Keep row `row` of a recompute forward's per-layer K/V [batch, kv_heads, seq, hd]."""
    pos = cached_positions(mode, seq, shift)
    idx = pos.to(keys[0].device)
    seq.kv = CachedKV(
        block=seq.block,
        positions=pos,
        keys=[k[row].index_select(1, idx).transpose(0, 1).contiguous() for k in keys],
        values=[v[row].index_select(1, idx).transpose(0, 1).contiguous() for v in values],
    )


def exact_span(seq: Sequence) -> tuple[int, int]:
    """Absolute [start, end) a block-causal step runs: from the cached prefix's end to the end
    of the current block."""
    block = seq.block
    return seq.cached_len, min(seq.absolute_block_start(block + 1), seq.total_len)


def exact_store_end(seq: Sequence) -> int:
    """Where the exact prefix will end after this step: the current block's start."""
    return seq.absolute_block_start(seq.block)


def store_exact(seq: Sequence, keys, values, row: int) -> None:
    """Append to the exact prefix the K/V of [cached_len, current block start), the head of row
    `row` of a forward that began at cached_len."""
    start, end = seq.cached_len, exact_store_end(seq)
    new_k = [k[row, :, : end - start].transpose(0, 1) for k in keys]
    new_v = [v[row, :, : end - start].transpose(0, 1) for v in values]
    if seq.kv is not None:
        new_k = [torch.cat((old, k)) for old, k in zip(seq.kv.keys, new_k)]
        new_v = [torch.cat((old, v)) for old, v in zip(seq.kv.values, new_v)]
    seq.kv = CachedKV(
        block=seq.block,
        positions=torch.arange(end),
        keys=[k.contiguous() for k in new_k],
        values=[v.contiguous() for v in new_v],
    )


def build_context(seqs: list[Sequence]) -> KVContext:
    """Stack the sequences' cached K/V, right-padded to a common length, with a validity mask."""
    num_layers = len(seqs[0].kv.keys)
    keys = [_stack([s.kv.keys[layer] for s in seqs]) for layer in range(num_layers)]
    values = [_stack([s.kv.values[layer] for s in seqs]) for layer in range(num_layers)]
    lengths = torch.tensor([s.kv.positions.numel() for s in seqs])
    valid = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    return KVContext(keys, values, valid.to(keys[0].device))


def _stack(per_seq: list[torch.Tensor]) -> torch.Tensor:
    """[n_i, kv_heads, hd] each -> [batch, kv_heads, max n_i, hd], zero-padded."""
    return pad_sequence(per_seq, batch_first=True).transpose(1, 2)
