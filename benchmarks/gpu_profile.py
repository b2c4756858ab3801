"""Step latencies of an LLaDA-8B-shaped model on a GPU, saved as a latency-profile file.

    python benchmarks/gpu_profile.py --out profiles/llada-8b-<gpu>-bf16.json
    python benchmarks/gpu_profile.py --shape tiny --device cpu --out /tmp/p.json   # smoke test

Builds the model with random bf16 weights (no download), then measures, with CUDA events:
- recompute steps (full sequences, K/V kept) for batch token counts 256..16384;
- dual-cache steps (one 32-token block per request against cached K/V) for 1..256 requests, at
  the simulator's reference context (`REF_CONTEXT` cached tokens per request), plus a sweep of
  the cached length at 1 and 32 requests;
- one request on a ~1000-token prompt with gen 256 (a 5-shot GSM8K-length request): its
  recompute and cache steps at the request's own length, composed into tokens/s for a given
  number of tokens per step, since random weights say nothing about how many tokens a step
  commits;
- launch overhead of small steps: the host's time to issue a step's kernels, and the step
  replayed as a CUDA graph.
Then it runs the real `Engine` (batch 1 and 32, early finish off) and times every step on the
wall clock: what the serving path adds to the model's forward passes; and batch 1 and 8 with and
without CUDA graphs for the cache steps (`--cuda-graphs 8`), comparing the tokens. Random
weights never reach threshold 0.9, so the engine commits one token a step (top-1 fallback).

The `entries` are the latency profile (`dilaserve.control.profile`); the other keys are kept as
metadata. `dilaserve.sim.profiles.load_profile` reads such a file; the package ships one
(`llada-8b-h200`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from dilaserve.config import EngineConfig
from dilaserve.control.profile import SCHEMA
from dilaserve.engine.engine import Engine
from dilaserve.models.common import KVContext, KVSlot
from dilaserve.models.config import LLaDAConfig
from dilaserve.models.llada import LLaDAModelLM
from dilaserve.models.tokenizer import SpecialIds
from dilaserve.protocol import StepBatch, StepKind
from dilaserve.request import Request
from dilaserve.runs import write_json
from dilaserve.sim.hardware import LLADA_8B as PUBLISHED
from dilaserve.sim.latency import REF_CONTEXT, TOKENS_PER_STEP_0_9

LLADA_8B = dict(  # the shapes the simulator's presets price, and LLaDA's special ids
    d_model=PUBLISHED.hidden,
    n_heads=PUBLISHED.n_heads,
    n_kv_heads=PUBLISHED.n_kv_heads,
    n_layers=PUBLISHED.n_layers,
    mlp_hidden_size=PUBLISHED.mlp_hidden,
    vocab_size=PUBLISHED.vocab,
    rope_theta=500000.0,
    mask_token_id=126336,
    eos_token_id=126081,
)
TINY = dict(d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=128, vocab_size=512)
SHAPES = {
    "llada-8b": LLADA_8B,
    "tiny": {**LLADA_8B, **TINY, "mask_token_id": 511, "eos_token_id": 510},
}
BLOCK = 32
RECOMPUTE_TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384)
CACHE_REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SWEEP_CONTEXTS = (256, 768, 1224, 2048, 4096)
ENGINE_BATCHES = (1, 32)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of fn() over `repeats` runs after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(1000 * (time.perf_counter() - t0))
    return round(statistics.median(samples), 4)


def enqueue_ms(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds the host spends issuing fn() (the GPU idle beforehand)."""
    samples = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        samples.append(1000 * (time.perf_counter() - t0))
    sync(device)
    return round(statistics.median(samples), 4)


def graph_ms(fn, device: torch.device, repeats: int) -> float | None:
    """Median milliseconds of fn() replayed as one CUDA graph (no per-kernel launch cost)."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(graph.replay, device, repeats)


def recompute_step(model, rows: int, seq: int, device, logit_tokens: int = 256, **model_kwargs):
    """A whole-sequence step storing its K/V, logits for the last `logit_tokens` positions;
    `model_kwargs` go to the forward (a block-causal model's `block_len`)."""
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), device=device)
    pos = torch.arange(seq, device=device).expand(rows, seq)

    def step():
        out = model(ids, pos, None, keep_kv=True, **model_kwargs)
        return model.logits(out.hidden[:, -logit_tokens:])

    return step


def recompute_ms(model, rows: int, seq: int, device, repeats: int) -> float:
    return timed(recompute_step(model, rows, seq, device), device, repeats)


def cache_step(model, rows: int, context: int, device, query: int = BLOCK, **model_kwargs):
    """One step of `query` tokens a row against each row's slot of `context` cached tokens, in
    place; every layer of a row reads the same slot tensors (each is far larger than L2).
    `model_kwargs` go to the forward (a block-causal model's `block_len`)."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    shape = (cfg.num_kv_heads, context + query, cfg.head_dim)
    slots = []
    for _ in range(rows):
        k = torch.randn(shape, device=device, dtype=dtype)
        v = torch.randn(shape, device=device, dtype=dtype)
        slots.append(KVSlot([k] * cfg.num_layers, [v] * cfg.num_layers))
    ctx = KVContext(slots, [context] * rows, [query] * rows, [None] * rows)
    ids = torch.randint(0, cfg.vocab_size, (rows, query), device=device)
    pos = (context + torch.arange(query, device=device)).expand(rows, query)
    return lambda: model.logits(model(ids, pos, None, context=ctx, **model_kwargs).hidden)


def cache_ms(model, rows: int, context: int, device, repeats: int) -> float:
    return timed(cache_step(model, rows, context, device), device, repeats)


def launch_overhead(model, device, repeats: int) -> list[dict]:
    """Where small steps go: GPU time as run (eager), the host's time to issue the kernels, and
    the same step replayed as a CUDA graph. Eager time near the issue time means launch-bound."""
    steps = [("cache", rows, cache_step(model, rows, REF_CONTEXT, device)) for rows in (1, 8, 32)]
    steps += [("recompute", 1, recompute_step(model, 1, REF_CONTEXT, device))]
    out = []
    for kind, rows, fn in steps:
        row = {"kind": kind, "num_requests": rows, "eager_ms": timed(fn, device, repeats)}
        row["issue_ms"] = enqueue_ms(fn, device, repeats)
        try:
            row["graph_ms"] = graph_ms(fn, device, repeats)
        except RuntimeError as err:  # a capture failure is a finding, not a crash
            row["graph_error"] = str(err).splitlines()[0]
        out.append(row)
        print({"launch": row}, flush=True)
    return out


def build_model(shape: str, device: torch.device, dtype: torch.dtype) -> LLaDAModelLM:
    with torch.device(device):
        model = LLaDAModelLM(LLaDAConfig(**SHAPES[shape])).to(dtype)
    model.init_weights(0)
    model.model.rotary.reset()
    return model.eval()


def measure_grid(model, device, repeats: int) -> list[dict]:
    entries = []
    for tokens in RECOMPUTE_TOKENS:
        seq = min(tokens, 1024)
        ms = recompute_ms(model, tokens // seq, seq, device, repeats)
        entries.append({"tp": 1, "kind": "recompute", "batch_tokens": tokens, "ms": ms})
        print(entries[-1], flush=True)
    for rows in CACHE_REQUESTS:
        ms = cache_ms(model, rows, REF_CONTEXT, device, repeats)
        entries.append(
            {
                "tp": 1,
                "kind": "cache",
                "batch_tokens": rows * BLOCK,
                "num_requests": rows,
                "context_len": REF_CONTEXT,
                "ms": ms,
            }
        )
        print(entries[-1], flush=True)
    return entries


def context_sweep(model, device, repeats: int) -> list[dict]:
    out = []
    for rows in (1, 32):
        for context in SWEEP_CONTEXTS:
            ms = cache_ms(model, rows, context, device, repeats)
            out.append({"num_requests": rows, "context_len": context, "ms": ms})
            print({"cache_context_sweep": out[-1]}, flush=True)
    return out


def tokens_per_s(gen: int, recompute: float, cache: float, tokens_per_step: float) -> float:
    """One dual-cache request: a recompute step per block, the rest cache steps (ms in)."""
    blocks = gen // BLOCK
    steps = max(gen / tokens_per_step, blocks)
    return round(gen / ((blocks * recompute + (steps - blocks) * cache) / 1e3), 1)


def single_request(model, device, repeats: int, prompt_len: int, gen: int) -> dict:
    recompute = recompute_ms(model, 1, prompt_len + gen, device, repeats)
    cache = cache_ms(model, 1, prompt_len + gen - BLOCK, device, repeats)
    per_s = {k: tokens_per_s(gen, recompute, cache, k) for k in (1, 2, TOKENS_PER_STEP_0_9, 4, 8)}
    return {
        "prompt_len": prompt_len,
        "gen": gen,
        "recompute_ms": recompute,
        "cache_ms": cache,
        "tokens_per_s_by_tokens_per_step": per_s,
        "tokens_per_step_at_0.9": TOKENS_PER_STEP_0_9,
    }


def special_ids(shape: str) -> SpecialIds:
    cfg = SHAPES[shape]
    return SpecialIds(mask=cfg["mask_token_id"], eos=cfg["eos_token_id"], eot=None)


def make_engine(model, special: SpecialIds, device, graphs: int = 0) -> Engine:
    """An engine on `model`: dual cache (a block-causal model's exact one), early finish off."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    config = EngineConfig(
        "dual", dtype=dtype, device=str(device), early_finish=False, cuda_graphs=graphs
    )
    return Engine(model, special, config)


def engine_run(engine: Engine, device, batch: int, prompt_len: int, gen: int):
    """The serving path: `Engine.execute` on `batch` requests (random prompts, seeded), each
    step timed; the record and every request's output tokens."""
    special = engine.special
    mode = engine.config.kv_cache  # a block-causal model's exact cache
    requests = [
        Request(f"r{i}", random_prompt(prompt_len, special.mask, i), gen, BLOCK, special.mask, 0.9)
        for i in range(batch)
    ]
    finished = list(requests)
    ms: dict[str, list[float]] = {}
    committed = 0
    total = time.perf_counter()
    while requests:
        items = tuple(r.step_item(mode, engine.has_request(r.request_id)) for r in requests)
        sync(device)
        t0 = time.perf_counter()
        out = engine.execute(StepBatch(items))
        sync(device)
        ms.setdefault(out.results[0].kind.value, []).append(1000 * (time.perf_counter() - t0))
        for r, res in zip(requests, out.results):
            r.apply(res)
            committed += len(res.positions)
        requests = [r for r in requests if not r.is_finished]
    seconds = time.perf_counter() - total
    for i in range(batch):
        engine.release(f"r{i}")
    record = {
        "batch": batch,
        "cuda_graphs": engine.config.cuda_graphs,
        "prompt_len": prompt_len,
        "gen": gen,
        "steps": {k: len(v) for k, v in ms.items()},
        "median_ms": {k: round(statistics.median(v[1:] or v), 3) for k, v in ms.items()},
        "tokens": committed,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(committed / seconds, 1),
    }
    return record, [r.output_ids for r in finished]


def random_prompt(length: int, vocab: int, seed: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab, (length,), generator=generator).tolist())


def graph_section(model, shape, device, prompt_len: int, gen: int) -> list[dict]:
    """The engine with and without CUDA graphs for its cache steps (engine/graphs.py)."""
    rows = []
    for batch in (1, 8):
        eager_engine, graphed_engine = (
            make_engine(model, special_ids(shape), device, graphs) for graphs in (0, 8)
        )
        eager, eager_out = engine_run(eager_engine, device, batch, prompt_len, gen)
        graphed, graphed_out = engine_run(graphed_engine, device, batch, prompt_len, gen)
        same = sum(np.array_equal(a, b) for a, b in zip(eager_out, graphed_out))
        rows.append(
            {
                "batch": batch,
                "eager_cache_ms": eager["median_ms"][StepKind.CACHE.value],
                "graphed_cache_ms": graphed["median_ms"][StepKind.CACHE.value],
                "eager_tokens_per_s": eager["tokens_per_s"],
                "graphed_tokens_per_s": graphed["tokens_per_s"],
                "requests_with_identical_tokens": f"{same}/{batch}",
            }
        )
        print({"cuda_graphs": rows[-1]}, flush=True)
    return rows


def engine_section(model, shape, device, prompt_len: int, gen: int) -> list[dict]:
    special = special_ids(shape)
    engine_run(make_engine(model, special, device), device, 1, prompt_len, 2 * BLOCK)  # warm-up
    runs = []
    for batch in ENGINE_BATCHES:
        run, _ = engine_run(make_engine(model, special, device), device, batch, prompt_len, gen)
        med = run["median_ms"]
        run["request_tokens_per_s_at_0.9"] = tokens_per_s(
            gen, med[StepKind.RECOMPUTE.value], med[StepKind.CACHE.value], TOKENS_PER_STEP_0_9
        )
        runs.append(run)
        print({"engine": run}, flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llada-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--no-engine", action="store_true", help="skip the Engine.execute runs")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = build_model(args.shape, device, dtype)
    print(f"model built in {time.perf_counter() - t0:.1f} s", flush=True)
    with torch.inference_mode():
        entries = measure_grid(model, device, args.repeats)
        sweep = context_sweep(model, device, args.repeats)
        single = single_request(model, device, args.repeats, args.prompt_len, args.gen)
    print(json.dumps(single), flush=True)
    engine, graphs = [], []
    if not args.no_engine:
        engine = engine_section(model, args.shape, device, args.prompt_len, args.gen)
        graphs = graph_section(model, args.shape, device, args.prompt_len, args.gen)
    with torch.inference_mode():
        launch = launch_overhead(model, device, args.repeats)  # last: it captures CUDA graphs
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    profile = {
        "schema": SCHEMA,
        "model": args.shape,
        "dtype": str(dtype).removeprefix("torch."),
        "block_len": BLOCK,
        "hardware": hardware,
        "source": "benchmarks/gpu_profile.py, random weights",
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
        "entries": entries,
        "cache_context_sweep": sweep,
        "launch_overhead": launch,
        "single_request": single,
        "engine": engine,
        "cuda_graphs": graphs,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_result(args.out, profile)


def write_result(out: str, result: dict) -> None:
    """A benchmark's JSON file (its folder made if needed), announced with its wall time."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(out), result)
    print(f"wrote {out} after {result['wall_s']} s", flush=True)


if __name__ == "__main__":
    main()
