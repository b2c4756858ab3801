"""One model instance: executes a denoising step for a heterogeneous `StepBatch`.

Requests in one batch may differ in prompt length, output window, current block, threshold and
step kind. Rows are grouped into forwards without a cache (FULL, RECOMPUTE and PREFILL steps) and
forwards against cached K/V (CACHE, BLOCK and COMMIT steps); each group runs as padded, batched
forward passes. What a step runs, stores and commits follows the model family's semantics
(`models/family.py`): its logit shift, an approximate cache (bidirectional attention) or an
exact one (block-causal attention), and its decoding rule, which `decide.StepDecider` applies
to each step's top-1 tokens. The engine owns its requests' token state and K/V caches;
it knows nothing about SLOs, other instances or the wall clock.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from dilaserve.config import EngineConfig
from dilaserve.engine import kv_cache
from dilaserve.engine.decide import Row, StepDecider
from dilaserve.engine.graphs import GRAPHED_KINDS, CacheStepGraphs, graph_query_lens
from dilaserve.engine.kv_budget import KVBudget
from dilaserve.engine.sequence import Sequence
from dilaserve.models import registry
from dilaserve.models.family import ModelFamily
from dilaserve.models.tokenizer import SpecialIds
from dilaserve.protocol import (
    APPROXIMATE_KINDS,
    EosStop,
    KVCacheMode,
    RequestStepResult,
    StepBatch,
    StepItem,
    StepKind,
    StepOutput,
)

STORING_KINDS = (StepKind.RECOMPUTE, StepKind.PREFILL, StepKind.COMMIT)  # store K/V


class Engine:
    """`config.kv_cache` is resolved by the family (`ModelFamily.cache_mode`): a block-causal
    model runs its exact cache for any cache mode but none."""

    def __init__(
        self,
        model: torch.nn.Module,
        special: SpecialIds,
        config: EngineConfig,
        family: ModelFamily | None = None,
    ):
        self.model = model
        self.family = family or registry.family_of(model.config)
        self.special = special
        self.config = replace(config, kv_cache=self.family.cache_mode(config.kv_cache))
        self.decoding = self.family.decoding_for(model.config, config.editing)
        self.eos_stop = _eos_stop(config, self.decoding.eos_stop)
        self.stop_ids = frozenset((special.eos,)) if self.decoding.eos_only else special.stop_ids
        self.device = torch.device(config.device)
        self.shift = self.family.logit_shift
        # a cache step reads the position before its block only if that block's first position
        # may still be masked there (a block opened by its first position never is)
        self.cache_shift = 0 if self.decoding.first_opens_block else self.shift
        self.budget = self.decoding.budget_for(
            self.config.kv_cache, config.step_budget, config.block_len
        )  # a whole-window rule's step budget (None: block by block)
        self.whole_window = self.budget is not None
        self.step_budget = self.budget or config.block_len
        self.decider = StepDecider(
            self.decoding,
            self.config,
            special.mask,
            self.stop_ids,
            self.eos_stop,
            self.whole_window,
            self.step_budget,
        )
        block_causal = self.family.is_block_causal
        self._model_kwargs = {"block_len": config.block_len} if block_causal else {}
        self._seqs: dict[str, Sequence] = {}
        self._graphs = None
        # a step against the cache that queries whole blocks: a dual- or prefix-cache step
        # (LLaDA's; Dream's, whose blocks open by their first position) or an exact cache's
        # block or commit step
        mode = self.config.kv_cache
        approximate = mode in (KVCacheMode.DUAL, KVCacheMode.PREFIX)
        graphable = (approximate and self.cache_shift == 0) or block_causal
        if config.cuda_graphs and graphable and _single_gpu(model):
            self._graphs = CacheStepGraphs(
                model,
                config.cuda_graphs,
                config.cuda_graph_context,
                config.block_len,
                self._model_kwargs,
                graph_query_lens(mode, config.block_len, block_causal),
            )
        reserved = 0 if self._graphs is None else self._graphs.static_bytes
        self.kv_budget = KVBudget(config.kv_memory, reserved)
        self._stepping: set[str] = set()  # the requests of the step running: never dropped

    @classmethod
    def from_checkpoint(cls, path: str | Path, config: EngineConfig = EngineConfig()) -> Engine:
        from dilaserve.models.checkpoint import load_model
        from dilaserve.models.tokenizer import special_ids

        model = load_model(path, config.dtype, device=config.device)
        return cls(model, special_ids(path, model.config), config)

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._seqs

    def release(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        self.kv_budget.release(request_id)

    # -- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepOutput:
        self._validate(batch)
        self._stepping = {item.request_id for item in batch.items}
        self.kv_budget.stepped(self._stepping)
        self._dropped: list[str] = []
        rows = [self._plan_row(item) for item in batch.items]
        results: dict[str, RequestStepResult] = {}
        for cached in (False, True):
            group = [r for r in rows if r.attends_cache == cached]
            for part in self._graph_parts(group) if cached else (group,):
                for chunk in self._chunks(part):
                    results.update(self._run(chunk, cached))
        num_tokens = sum(r.q_end - r.q_start for r in rows)
        results = tuple(results[i.request_id] for i in batch.items)
        return StepOutput(results, num_tokens, tuple(self._dropped))

    def _validate(self, batch: StepBatch) -> None:
        seen: set[str] = set()
        for item in batch.items:
            if item.request_id in seen:
                raise ValueError(f"request {item.request_id} appears twice in one step batch")
            seen.add(item.request_id)
            if not 0.0 < item.threshold <= 1.0:
                raise ValueError(
                    f"request {item.request_id}: threshold={item.threshold} must be in (0, 1]"
                )
            if item.spec is None and item.request_id not in self._seqs:
                raise KeyError(
                    f"request {item.request_id} is not on this instance and its step "
                    "carries no sequence spec"
                )

    def _plan_row(self, item: StepItem) -> Row:
        if item.spec is not None:
            self._seqs[item.request_id] = Sequence(
                item.request_id,
                item.spec.prompt_ids,
                item.spec.output_ids,
                item.spec.output_conf,
                self.config.block_len,
                self.special.mask,
                aligned_blocks=self.family.is_block_causal,
                block_step=item.spec.block_step,
                edit_block=item.spec.edit_block,
                post_steps=item.spec.post_steps,
                num_steps=item.spec.num_steps,
                block=item.spec.block,
            )
        seq = self._seqs[item.request_id]
        kind = self._actual_kind(item.kind, seq)
        return Row(seq, item, kind, *self._span(kind, seq), self.shift)

    def _actual_kind(self, requested: StepKind, seq: Sequence) -> StepKind:
        """Without a cache mode every step is FULL; a cache step with no valid cache recomputes.
        With the exact block cache, the cache's state decides: a prefill stores the first K/V
        (the prompt and the blocks before the current one), a commit adds a finished block, and
        a block step stores nothing; a prompt that ends inside the first block thus starts with
        block steps, before any cache exists."""
        mode = self.config.kv_cache
        if mode is KVCacheMode.NONE:
            return StepKind.FULL
        if mode is KVCacheMode.BLOCK:
            store_end = kv_cache.exact_store_end(seq)
            if store_end == seq.cached_len:
                return StepKind.BLOCK
            return StepKind.PREFILL if seq.cached_len == 0 else StepKind.COMMIT
        if requested not in APPROXIMATE_KINDS:
            raise ValueError(
                f"request {seq.request_id}: a {requested.value} step needs an exact block cache; "
                f"this engine's cache is {mode.value}"
            )
        if requested is StepKind.CACHE and not seq.has_cache_for_current_block():
            return StepKind.RECOMPUTE
        return requested

    def _span(self, kind: StepKind, seq: Sequence) -> tuple[int, int]:
        """Absolute [start, end) this step runs through the model. Block-causal models never
        need what follows the current block."""
        if kind is StepKind.CACHE:
            return kv_cache.query_span(self.config.kv_cache, seq, self.cache_shift)
        if not self.family.is_block_causal:
            return 0, seq.total_len
        start, end = kv_cache.exact_span(seq)
        return (0 if kind is StepKind.FULL else start), end

    def _graph_parts(self, rows: list[Row]) -> list[list[Row]]:
        """Cached rows by how many tokens they query, when steps may run on graphs (a graph
        runs rows of one query length: an exact cache's commit steps apart from its block
        steps); else all of them."""
        if self._graphs is None:
            return [rows]
        parts: dict[int, list[Row]] = {}
        for row in rows:
            parts.setdefault(row.q_end - row.q_start, []).append(row)
        return list(parts.values())

    def _chunks(self, rows: list[Row]):
        chunk, tokens = [], 0
        for row in rows:
            size = row.q_end - row.q_start
            if chunk and tokens + size > self.config.max_forward_tokens:
                yield chunk
                chunk, tokens = [], 0
            chunk.append(row)
            tokens += size
        if chunk:
            yield chunk

    def _run(self, rows: list[Row], cached: bool) -> dict[str, RequestStepResult]:
        ids, positions, valid = self._inputs(rows)
        seqs, query_lens = [r.seq for r in rows], [r.q_end - r.q_start for r in rows]
        graphs = self._graphs
        graphed = graphs is not None and all(r.kind in GRAPHED_KINDS for r in rows)
        if cached and graphed and graphs.fits(seqs, query_lens):
            commits = [i for i, row in enumerate(rows) if row.kind is StepKind.COMMIT]
            hidden = graphs.hidden(seqs, ids, positions, commits)
        elif cached:
            hidden = self._forward_cached(rows, ids, positions, valid, query_lens)
        else:
            hidden = self._forward(rows, ids, positions, valid)
        conf, top = self._top1(rows, hidden)
        results = self.decider.decide(rows, conf, top)
        for request_id, result in results.items():
            if result.is_finished:
                self.release(request_id)
        return results

    def _forward(self, rows: list[Row], ids, positions, valid) -> torch.Tensor:
        """Forward pass with no cache; recompute and prefill rows store their K/V."""
        keep_kv = any(r.kind in STORING_KINDS for r in rows)
        out = self.model(ids, positions, valid, keep_kv=keep_kv, **self._model_kwargs)
        for i, row in enumerate(rows):
            if row.kind in STORING_KINDS:
                self._store(row.seq, out.keys, out.values, i)
        return out.hidden

    def _forward_cached(self, rows: list[Row], ids, positions, valid, query_lens):
        """Forward pass against each row's slot, in place; a commit step's stored block is
        already there."""
        context = kv_cache.build_context([r.seq for r in rows], query_lens)
        out = self.model(ids, positions, valid, context=context, **self._model_kwargs)
        for row in rows:
            if row.kind is StepKind.COMMIT:
                kv_cache.commit_exact(row.seq)
        return out.hidden

    def _store(self, seq: Sequence, keys, values, row: int) -> None:
        mode = self.config.kv_cache
        exact = mode is KVCacheMode.BLOCK
        if exact and kv_cache.exact_store_end(seq) == seq.cached_len:
            return  # nothing before the current block to store
        if seq.kv is None and not self._room_for_slot(seq, keys):
            self._dropped.append(seq.request_id)  # no room even after dropping the others'
            return
        if exact:
            kv_cache.store_exact(seq, keys, values, row)
        else:
            kv_cache.store(mode, seq, keys, values, row, self.cache_shift)

    def _room_for_slot(self, seq: Sequence, keys) -> bool:
        size = kv_cache.slot_bytes(keys, seq.total_len)
        return self.kv_budget.take(seq.request_id, size, self._stepping, self._drop_cache)

    def _drop_cache(self, request_id: str) -> None:
        self._seqs[request_id].kv = None  # its next step recomputes or prefills
        self._dropped.append(request_id)

    def _inputs(self, rows: list[Row]):
        """ids, positions and valid [rows, longest query], right-padded; valid None when no row
        is padded."""
        lengths = [r.q_end - r.q_start for r in rows]
        longest = max(lengths)
        ids = torch.full((len(rows), longest), self.special.eos, dtype=torch.long)
        positions = torch.zeros(len(rows), longest, dtype=torch.long)
        valid = torch.zeros(len(rows), longest, dtype=torch.bool)
        for i, r in enumerate(rows):
            n = lengths[i]
            ids[i, :n] = r.seq.ids[r.q_start : r.q_end]
            positions[i, :n] = torch.arange(r.q_start, r.q_end)
            valid[i, :n] = True
        valid = None if min(lengths) == longest else valid.to(self.device)
        return ids.to(self.device), positions.to(self.device), valid

    def _top1(self, rows: list[Row], hidden: torch.Tensor):
        """Top-1 token and probability for each row's logit window, [rows, longest window]."""
        longest = max(r.window_len for r in rows)
        index = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, r in enumerate(rows):
            offset = r.seq.prompt_len + r.window_start - r.shift - r.q_start
            index[i, : r.window_len] = torch.arange(offset, offset + r.window_len)
        index = index.to(hidden.device)
        picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = self.model.logits(picked).float()
        if self.decoding.mask_in_softmax:
            probs = torch.softmax(logits, dim=-1)
            block_len = self.config.block_len
            barred = [not self.decoding.picks_mask(block_len, r.seq.block_step) for r in rows]
            probs[torch.tensor(barred, device=probs.device), :, self.special.mask] = 0.0
        else:
            logits[..., self.special.mask] = float("-inf")
            probs = torch.softmax(logits, dim=-1)
        conf, top = probs.max(dim=-1)
        return conf.cpu(), top.cpu()


def _eos_stop(config: EngineConfig, family_default: EosStop) -> EosStop:
    """The early-stop rule an engine runs: none without early finish, else the configured one,
    else the family's published one."""
    if not config.early_finish:
        return EosStop.NONE
    return config.eos_stop or family_default


def _single_gpu(model: torch.nn.Module) -> bool:
    """Whether the model is whole on this device (no tensor-parallel shards)."""
    tp = getattr(model, "tp", None)
    return tp is None or tp.size == 1
