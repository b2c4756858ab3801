"""The approximate KV-cache policy: what a recompute step stores and what a cache step computes.

- none: nothing is stored; every step is a full forward.
- prefix: a recompute step stores the prompt and the finished blocks; a cache step recomputes the
  current block and everything after it.
- dual: a recompute step stores everything outside the current block (prefix and the still-masked
  suffix); a cache step recomputes only the current block's `block_len` tokens.
The stored K/V are approximations (Fast-dLLM): they are refreshed at each block's first step.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from dilaserve.engine.sequence import CachedKV, Sequence
from dilaserve.models.llada import KVContext
from dilaserve.protocol import KVCacheMode


def query_span(mode: KVCacheMode, seq: Sequence) -> tuple[int, int]:
    """Absolute [start, end) of the positions a cache step runs through the model."""
    start, end = seq.block_span(seq.block)
    if mode is KVCacheMode.PREFIX:
        end = seq.gen_len
    return seq.prompt_len + start, seq.prompt_len + end


def cached_positions(mode: KVCacheMode, seq: Sequence) -> torch.Tensor:
    """Absolute positions whose K/V a recompute step keeps for the following cache steps."""
    q_start, q_end = query_span(mode, seq)
    prefix = torch.arange(0, q_start)
    if mode is KVCacheMode.PREFIX:
        return prefix
    return torch.cat((prefix, torch.arange(q_end, seq.total_len)))


def store(mode: KVCacheMode, seq: Sequence, keys, values, row: int) -> None:
    """Keep row `row` of a recompute forward's per-layer K/V [batch, kv_heads, seq, hd]."""
    pos = cached_positions(mode, seq)
    idx = pos.to(keys[0].device)
    seq.kv = CachedKV(
        block=seq.block,
        positions=pos,
        keys=[k[row].index_select(1, idx).transpose(0, 1).contiguous() for k in keys],
        values=[v[row].index_select(1, idx).transpose(0, 1).contiguous() for v in values],
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
