"""Engine throughput: generated tokens/s, steps/s and ms per step by model, batch size, KV-cache
mode and prompt.

    python benchmarks/engine.py [--models PATH,...] [--batches 1,8,32,128] [--prompts 64,512]

`steps_per_cpu_s` counts steps per second of this process's CPU time: on a shared machine it
moves less with the other tenants' load than `steps_per_s` (wall time), which is what a user
sees; `cache_step_cpu_ms` is the median CPU time of the steps in which every row ran against the
cache. `--models` defaults to the bundled models (tiny-llada, tiny-llada2; LLaDA2 runs its exact
block cache for `prefix` and `dual`). `benchmarks/engine_compare.py` sets runs of two code
versions side by side.

Each configuration starts `batch` requests at once (prompt of exactly P tokens, output window
`--gen` tokens, threshold 0.9, early finish off so every request generates the whole window) and
steps them together. A configuration stops once `--budget` seconds have passed and every request
has finished at least one whole block (so the mix of recompute and cache steps is the steady
one), or when all are done; tokens/s is committed output tokens over wall time. Writes a run
folder (config, records, summary, report) under `--out`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

from dilaserve.config import BUNDLED_MODEL, EngineConfig
from dilaserve.engine.engine import Engine
from dilaserve.models.tokenizer import Tokenizer
from dilaserve.protocol import CACHED_KINDS, StepBatch
from dilaserve.request import Request
from dilaserve.runs import create_run_dir, environment, markdown_table, write_json, write_records
from dilaserve.tasks import arith

COLUMNS = [
    "model",
    "kv_cache",
    "prompt_len",
    "batch",
    "steps",
    "tokens",
    "seconds",
    "ms_per_step",
    "steps_per_s",
    "steps_per_cpu_s",
    "cache_step_cpu_ms",
    "tokens_per_s",
    "request_s",
]


def make_prompt(tok: Tokenizer, length: int) -> tuple[int, ...]:
    ids: list[int] = []
    for p in arith.generate(200, seed=5):
        ids += tok.encode(p.question + " " + p.target)
        if len(ids) >= length:
            return tuple(ids[:length])
    raise ValueError(f"could not build a prompt of {length} tokens")


def run_config(
    engine: Engine, tok: Tokenizer, prompt: tuple[int, ...], batch: int, gen: int, budget: float
) -> dict:
    requests = [
        Request(f"r{i}", prompt, gen, engine.config.block_len, tok.special.mask, 0.9)
        for i in range(batch)
    ]
    for r in requests:
        engine.release(r.request_id)
    steps, tokens, start, cpu_start = 0, 0, time.perf_counter(), time.process_time()
    cache_cpu_ms: list[float] = []  # steps whose every row ran against the cache
    active = requests
    while active and (
        time.perf_counter() - start < budget or any(r.current_block == 0 for r in active)
    ):
        mode = engine.config.kv_cache
        items = tuple(r.step_item(mode, engine.has_request(r.request_id)) for r in active)
        step_cpu = time.process_time()
        out = engine.execute(StepBatch(items))
        if all(res.kind in CACHED_KINDS for res in out.results):
            cache_cpu_ms.append(1000 * (time.process_time() - step_cpu))
        for r, res in zip(active, out.results):
            r.apply(res)
            tokens += len(res.positions)
        steps += 1
        active = [r for r in active if not r.is_finished]
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    for r in active:
        engine.release(r.request_id)
    per_request_tokens_s = tokens / batch / seconds
    return {
        "kv_cache": engine.config.kv_cache.value,
        "prompt_len": len(prompt),
        "batch": batch,
        "steps": steps,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "ms_per_step": round(1000 * seconds / steps, 2),
        "steps_per_s": round(steps / seconds, 2),
        "steps_per_cpu_s": round(steps / cpu_seconds, 2),
        "cache_step_cpu_ms": round(statistics.median(cache_cpu_ms), 2) if cache_cpu_ms else None,
        "tokens_per_s": round(tokens / seconds, 1),
        "request_s": round(gen / per_request_tokens_s, 3),
        "complete": not active,
    }


BUNDLED = ",".join(str(Path(BUNDLED_MODEL).parent / name) for name in ("tiny-llada", "tiny-llada2"))


def ratios(records: list[dict], gen: int) -> dict:
    """The first model's batching and cache gains."""
    first = records[0]["model"]
    key = {(r["kv_cache"], r["prompt_len"], r["batch"]): r for r in records if r["model"] == first}
    out = {}
    for mode, prompt, _ in key:
        if (mode, prompt, 1) in key and (mode, prompt, 32) in key:
            out[f"batch32_over_batch1[{mode},P={prompt}]"] = round(
                key[mode, prompt, 32]["tokens_per_s"] / key[mode, prompt, 1]["tokens_per_s"], 2
            )
    for prompt in {p for _, p, _ in key}:
        if ("none", prompt, 1) in key and ("dual", prompt, 1) in key:
            out[f"dual_speedup_per_request[P={prompt},gen={gen}]"] = round(
                key["none", prompt, 1]["request_s"] / key["dual", prompt, 1]["request_s"], 2
            )
    return out


def run_model(path: str, args) -> list[dict]:
    base = Engine.from_checkpoint(path, EngineConfig(early_finish=False))
    tok = Tokenizer(path, base.model.config)
    records = []
    for mode in args.modes.split(","):
        engine = Engine(base.model, base.special, replace(base.config, kv_cache=mode))
        for prompt_len in map(int, args.prompts.split(",")):
            prompt = make_prompt(tok, prompt_len)
            run_config(engine, tok, prompt, 1, args.gen, 2.0)  # warm-up
            for batch in map(int, args.batches.split(",")):
                record = run_config(engine, tok, prompt, batch, args.gen, args.budget)
                records.append({"model": Path(path).name, **record})
                print(records[-1], flush=True)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--models", "--model", default=BUNDLED, help="checkpoint folders, comma-separated"
    )
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--prompts", default="64,512")
    ap.add_argument("--modes", default="none,prefix,dual")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--budget", type=float, default=20.0, help="seconds per configuration")
    ap.add_argument("--out", default="runs")
    args = ap.parse_args()
    run = create_run_dir(args.out, "engine")
    write_json(run / "config.json", {**vars(args), "environment": environment()})
    records = []
    for model in args.models.split(","):
        records += run_model(model, args)
    write_records(run / "records.csv", records)
    summary = {"ratios": ratios(records, args.gen), "records": records}
    write_json(run / "summary.json", summary)
    report = markdown_table(records, COLUMNS)
    (run / "report.md").write_text(f"# engine benchmark\n\n{report}\n\n{summary['ratios']}\n")
    print(report)
    print(summary["ratios"])
    print(f"run folder: {run}")


if __name__ == "__main__":
    main()
