"""Step latencies of an LLaDA-8B-shaped model on a GPU, saved as a latency-profile file.

    python benchmarks/gpu_profile.py --out profiles/llada-8b-<gpu>-bf16.json
    python benchmarks/gpu_profile.py --shape tiny --device cpu --out /tmp/p.json   # smoke test

Builds the model with random bf16 weights (no download), then times with CUDA events:
- recompute steps (full sequence, K/V kept) for batch token counts 256..16384;
- dual-cache steps (one 32-token block per request against cached K/V) for 1..256 requests;
- one request's step mix at gen 256 with dual cache on a ~1000-token prompt (8 blocks, each a
  recompute step plus cache steps), reported as ms per block for a given number of steps per
  block, since random weights say nothing about how many tokens a step commits.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from dilaserve.control.profile import SCHEMA
from dilaserve.models.config import LLaDAConfig
from dilaserve.models.llada import KVContext, LLaDAModelLM

SHAPES = {
    "llada-8b": dict(
        d_model=4096,
        n_heads=32,
        n_layers=32,
        mlp_hidden_size=12288,
        vocab_size=126464,
        rope_theta=500000.0,
    ),
    "tiny": dict(d_model=64, n_heads=4, n_layers=2, mlp_hidden_size=128, vocab_size=512),
}
BLOCK = 32


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
    return sorted(samples)[len(samples) // 2]


def recompute_ms(model, rows: int, seq: int, device, repeats: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), device=device)
    pos = torch.arange(seq, device=device).expand(rows, seq)
    valid = torch.ones(rows, seq, dtype=torch.bool, device=device)
    return timed(
        lambda: model.logits(model(ids, pos, valid, keep_kv=True).hidden[:, -256:]), device, repeats
    )


def cache_ms(model, rows: int, context: int, device, repeats: int) -> float:
    cfg = model.config
    dtype = next(model.parameters()).dtype
    kv = [
        torch.randn(rows, cfg.num_kv_heads, context, cfg.head_dim, device=device, dtype=dtype)
        for _ in range(cfg.n_layers)
    ]
    ctx = KVContext(kv, kv, torch.ones(rows, context, dtype=torch.bool, device=device))
    ids = torch.randint(0, cfg.vocab_size, (rows, BLOCK), device=device)
    pos = (context + torch.arange(BLOCK, device=device)).expand(rows, BLOCK)
    valid = torch.ones(rows, BLOCK, dtype=torch.bool, device=device)
    return timed(lambda: model.logits(model(ids, pos, valid, context=ctx).hidden), device, repeats)


def build_model(shape: str, device: torch.device, dtype: torch.dtype) -> LLaDAModelLM:
    with torch.device(device):
        model = LLaDAModelLM(LLaDAConfig(**SHAPES[shape])).to(dtype)
    model.init_weights(0)
    model.model.rotary.reset()
    return model.eval()


def measure_grid(model, device, repeats: int, context: int) -> list[dict]:
    entries = []
    for tokens in (256, 512, 1024, 2048, 4096, 8192, 16384):
        seq = min(tokens, 1024)
        ms = recompute_ms(model, tokens // seq, seq, device, repeats)
        entries.append({"tp": 1, "kind": "recompute", "batch_tokens": tokens, "ms": ms})
        print(entries[-1], flush=True)
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        ms = cache_ms(model, rows, context, device, repeats)
        entries.append(
            {
                "tp": 1,
                "kind": "cache",
                "batch_tokens": rows * BLOCK,
                "num_requests": rows,
                "context_len": context,
                "ms": ms,
            }
        )
        print(entries[-1], flush=True)
    return entries


def single_request(model, device, repeats: int, prompt_len: int, gen: int) -> dict:
    recompute = recompute_ms(model, 1, prompt_len + gen, device, repeats)
    cache = cache_ms(model, 1, prompt_len + gen - BLOCK, device, repeats)
    blocks = gen // BLOCK
    per_s = {
        k: round(gen / (blocks * (recompute + (k - 1) * cache) / 1e3), 1)
        for k in (4, 8, 12, 16, 32)
    }
    return {
        "prompt_len": prompt_len,
        "gen": gen,
        "recompute_ms": recompute,
        "cache_ms": cache,
        "tokens_per_s_by_steps_per_block": per_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llada-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.shape, device, dtype)
    with torch.inference_mode():
        entries = measure_grid(model, device, args.repeats, args.prompt_len + args.gen - BLOCK)
        single = single_request(model, device, args.repeats, args.prompt_len, args.gen)
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    profile = {
        "schema": SCHEMA,
        "model": args.shape,
        "dtype": str(dtype).removeprefix("torch."),
        "block_len": BLOCK,
        "hardware": hardware,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
        "entries": entries,
        "single_request": single,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=2) + "\n")
    print(json.dumps(single, indent=2))


if __name__ == "__main__":
    main()
