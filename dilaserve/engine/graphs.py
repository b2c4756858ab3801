"""CUDA graphs for small steps against the cache (`GRAPHED_KINDS`: LLaDA's and Dream's
dual- and prefix-cache steps, LLaDA2's block and commit steps): one replay instead of thousands
of kernel launches.

A dual-cache step of a few requests is launch-bound on a GPU: an LLaDA-8B-shaped model takes
~21 ms issuing kernels for a step whose weights read in ~4 ms, and the same step replayed as a
CUDA graph takes ~10.5 ms (one H200, docs/engine.md). A graph replays fixed kernels on fixed
addresses, so the step's inputs live in static buffers sized for `max_requests` requests of
at most `max(query_lens)` query tokens (a block; two for a commit step; up to
`PREFIX_GRAPH_BLOCKS` for a prefix-cache step) against at most
`max_context` cached tokens each; a step runs on the graph captured for its bucket (requests
rounded up to a power of two, context to a multiple of `CONTEXT_STEP`, its query length),
capturing it the first time the bucket is seen. Each static row is the slot
(`KVSlot`) of the request it serves: its cached K/V at the head, the block's written in place at
the bucket's context length, the positions between masked. Padding rows attend to one valid
position and their outputs are dropped.

A request's cached K/V is copied into its static row only when that row last held something
else: between two stores (a recompute or prefill step) a request's cache does not change, so a
request stepping on the same row copies nothing, and a commit step's store writes its
block into the row as well as into the request's slot.

Graphs are captured only on CUDA, and only for single-GPU instances (the engine does not use them
under tensor parallelism, whose all-reduces it does not capture). On a CPU the same static-buffer
path runs eagerly, which is how the tests check it against the plain path.
"""

from __future__ import annotations

import weakref

import torch

from dilaserve.engine import kv_cache
from dilaserve.models.common import KVContext, KVSlot
from dilaserve.protocol import KVCacheMode, StepKind

CONTEXT_STEP = 256  # cached-length bucket (tokens)
# the steps that run against a request's cached K/V: one block (a dual-cache step, an exact
# cache's block step), or the block just finished and the next one (a commit step, which then
# stores the finished block's K/V in the request's slot: `_store`)
GRAPHED_KINDS = frozenset((StepKind.CACHE, StepKind.BLOCK, StepKind.COMMIT))
# a prefix-cache step queries its block and every block after it: graphed up to this many
PREFIX_GRAPH_BLOCKS = 8  # (256 tokens at LLaDA's block of 32: the papers' answer length)


def graph_query_lens(mode: KVCacheMode, block_len: int, block_causal: bool) -> tuple[int, ...]:
    """The tokens a graphed step queries per request: one block (a dual-cache step, an exact
    cache's block step), two (an exact cache's commit step), or, for a prefix-cache step, the
    block and the blocks after it, up to `PREFIX_GRAPH_BLOCKS`."""
    if block_causal:
        return (block_len, 2 * block_len)
    if mode is KVCacheMode.PREFIX:
        return tuple(block_len * n for n in range(1, PREFIX_GRAPH_BLOCKS + 1))
    return (block_len,)


class CacheStepGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        max_requests: int,
        max_context: int,
        block_len: int,
        model_kwargs: dict | None = None,
        query_lens: tuple[int, ...] | None = None,
    ):
        if max_requests < 1 or max_context < 1:
            raise ValueError(f"{max_requests=} and {max_context=} must be positive")
        cfg = model.config
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        self.model = model
        self.model_kwargs = model_kwargs or {}  # a block-causal model's block length
        self.max_requests = max_requests
        self.max_context = max_context
        self.block_len = block_len
        self.query_lens = query_lens or (block_len,)  # a step's queried tokens, per row
        query = max(self.query_lens)
        self.capture = device.type == "cuda"
        rows, ctx = _bucket_rows(max_requests), self.max_context
        kv_shape = (rows, cfg.num_kv_heads, ctx + query, cfg.head_dim)
        self.ids = torch.zeros(rows, query, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, query, dtype=torch.long, device=device)
        self.keys = [
            torch.zeros(kv_shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.key_valid = torch.ones(rows, ctx + query, dtype=torch.bool, device=device)
        self._resident: list[weakref.ref | None] = [None] * rows  # the CachedKV each row holds
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph | None, object]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def static_bytes(self) -> int:
        """Bytes of the static K/V buffers (what `EngineConfig.kv_memory` reserves for them)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def fits(self, seqs, query_lens) -> bool:
        """Whether a cache step of these sequences can run on a graph."""
        return (
            len(seqs) <= self.max_requests
            and query_lens[0] in self.query_lens
            and all(n == query_lens[0] for n in query_lens)
            and all(s.kv.length <= self.max_context for s in seqs)
        )

    def hidden(self, seqs, ids, positions, stores=()) -> torch.Tensor:
        """The model's final hidden states [len(seqs), query, d] for this step (each row
        queries the same number of tokens); the rows in `stores` ran commit steps, whose
        finished blocks are then stored (`_store`)."""
        n, query = ids.shape
        rows = _bucket_rows(n)
        longest = max(s.kv.length for s in seqs)
        ctx = min(-(-longest // CONTEXT_STEP) * CONTEXT_STEP, self.max_context)
        self.ids[:n, :query].copy_(ids)
        self.positions[:n, :query].copy_(positions)
        for i, seq in enumerate(seqs):
            self._load(i, seq)
        for i in range(n, rows):  # padding rows: one valid key, outputs dropped
            self.key_valid[i, : self.max_context].zero_()
            self.key_valid[i, 0] = True
            self._resident[i] = None
        graph, out = self._graphs.get((rows, ctx, query)) or self._make(rows, ctx, query)
        if graph is None:
            out = self._forward(rows, ctx, query)
        else:
            graph.replay()
        for i in stores:
            self._store(i, seqs[i], ctx)
        return out[:n]

    def _store(self, row: int, seq, ctx: int) -> None:
        """After a commit step on static row `row`: the finished block's K/V (the first
        queried tokens, written at the bucket's context length `ctx`) go to the end of the
        request's stored prefix, in its slot and in the static row, which then still holds its
        cache."""
        start, end = seq.cached_len, kv_cache.exact_store_end(seq)
        n = end - start
        for static, cached in zip(self.keys + self.values, seq.kv.slot.keys + seq.kv.slot.values):
            block = static[row, :, ctx : ctx + n].clone()  # the two spans may overlap
            cached[:, start:end].copy_(block)
            static[row, :, start:end].copy_(block)
        self.key_valid[row, start:end] = True
        kv_cache.commit_exact(seq)
        self._resident[row] = weakref.ref(seq.kv)

    def _load(self, row: int, seq) -> None:
        kv = seq.kv
        held = self._resident[row]
        if held is not None and held() is kv:
            return
        length = kv.length
        for static, cached in zip(self.keys + self.values, kv.slot.keys + kv.slot.values):
            static[row, :, :length].copy_(cached[:, :length])
        self.key_valid[row, :length] = True
        self.key_valid[row, length : self.max_context] = False
        self._resident[row] = weakref.ref(kv)  # not a reference: a released cache is freed

    def _forward(self, rows: int, ctx: int, query: int) -> torch.Tensor:
        """The step on static rows 0..rows-1: each attends to its first `ctx` static positions
        (the valid ones) and to its `query` tokens, written at `ctx`."""
        context = KVContext(
            [KVSlot([k[r] for k in self.keys], [v[r] for v in self.values]) for r in range(rows)],
            [ctx] * rows,
            [query] * rows,
            [self._row_mask(r, ctx, query) for r in range(rows)],
        )
        ids, positions = self.ids[:rows, :query], self.positions[:rows, :query]
        return self.model(ids, positions, None, context, **self.model_kwargs).hidden

    def _row_mask(self, row: int, ctx: int, query: int) -> torch.Tensor:
        """[1, 1, 1, ctx + query]: the row's valid cached positions, then its queried ones."""
        if ctx == self.max_context:
            return self.key_valid[row, : ctx + query].view(1, 1, 1, ctx + query)
        tail = self.key_valid[row, self.max_context : self.max_context + query]
        return torch.cat((self.key_valid[row, :ctx], tail))[None, None, None]

    def _make(self, rows: int, ctx: int, query: int):
        if not self.capture:
            return None, None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (workspaces, autotuning)
            self._forward(rows, ctx, query)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(rows, ctx, query)
        self._graphs[rows, ctx, query] = (graph, out)
        return graph, out


def _bucket_rows(n: int) -> int:
    return 1 << (n - 1).bit_length()
