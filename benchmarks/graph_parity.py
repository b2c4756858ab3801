"""Where graphed cache steps and eager ones part ways: the graph, or the padded context?

    python benchmarks/graph_parity.py --out $OUT/graph_parity.json            # on a GPU
    python benchmarks/graph_parity.py --shape tiny --device cpu --out /tmp/p.json   # smoke test

With random bf16 weights an engine run with `--cuda-graphs` committed other tokens than the
eager run (docs/engine.md). A graphed cache step differs from an eager one in two ways: it runs
as a CUDA graph, and its context is padded to the graph's bucket (a multiple of 256 tokens,
the padding masked). This script runs one cache step three ways on the same inputs, with K/V
from a real recompute forward of random prompts:

- `exact`: eager, the context exactly as long as the cache (the engine without graphs);
- `padded`: eager on the graphs' static buffers (`CacheStepGraphs` with capture off);
- `graph`: the captured graph's replay (CUDA only).

`padded` against `graph` isolates the graph; `exact` against `padded` isolates the padding. For
each pair it reports the largest hidden-state difference, how many positions pick another top-1
token, and the top-1 probability margin at those positions. Writes one JSON file.
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch
from gpu_profile import BLOCK, SHAPES, build_model, write_result

from dilaserve.engine.graphs import CacheStepGraphs
from dilaserve.engine.sequence import CachedKV
from dilaserve.models.common import KVContext, KVSlot

MAX_CONTEXT = 2048


def cached_requests(model, rows: int, context: int, seed: int):
    """`rows` requests whose first `context` positions are cached by a recompute forward of a
    random prompt; returns them (objects with `.kv`) and the last block's query inputs."""
    cfg, device = model.config, next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    total = context + BLOCK
    ids = torch.randint(0, cfg.vocab_size, (rows, total), generator=generator).to(device)
    pos = torch.arange(total, device=device).expand(rows, total)
    out = model(ids, pos, None, keep_kv=True)
    seqs = []
    for r in range(rows):
        keys = [k[r].clone() for k in out.keys]  # [kv_heads, total, hd]: the slot's capacity
        values = [v[r].clone() for v in out.values]
        seqs.append(SimpleNamespace(kv=CachedKV(0, context, KVSlot(keys, values))))
    query = ids[:, context:].clone()
    query[:, BLOCK // 2 :] = cfg.mask_token_id  # half the block still masked
    return seqs, query, pos[:, context:].contiguous()


def exact_hidden(model, seqs, ids, pos) -> torch.Tensor:
    """The engine's own cache step: each row against its slot, in place."""
    n = len(seqs)
    slots = [s.kv.slot for s in seqs]
    context = KVContext(slots, [s.kv.length for s in seqs], [BLOCK] * n, [None] * n)
    return model(ids, pos, None, context=context).hidden


def compare(model, a: torch.Tensor, b: torch.Tensor) -> dict:
    """Largest hidden difference, positions whose top-1 token differs, and their top-1 margin
    (top-1 minus top-2 probability under `a`)."""
    pa = torch.softmax(model.logits(a).float(), dim=-1)
    pb = torch.softmax(model.logits(b).float(), dim=-1)
    top2 = pa.topk(2, dim=-1).values
    differ = pa.argmax(-1) != pb.argmax(-1)
    margins = (top2[..., 0] - top2[..., 1])[differ]
    return {
        "max_hidden_diff": float((a.float() - b.float()).abs().max()),
        "positions": int(differ.numel()),
        "top1_differs": int(differ.sum()),
        "largest_margin_where_differs": float(margins.max()) if margins.numel() else None,
        "median_margin_everywhere": float((top2[..., 0] - top2[..., 1]).median()),
    }


def run(model, rows: int, context: int) -> dict:
    seqs, ids, pos = cached_requests(model, rows, context, seed=rows)
    exact = exact_hidden(model, seqs, ids, pos)
    padded_graphs = CacheStepGraphs(model, rows, MAX_CONTEXT, BLOCK)
    padded_graphs.capture = False
    padded = padded_graphs.hidden(seqs, ids, pos).clone()
    del padded_graphs
    record = {"rows": rows, "context": context, "exact_vs_padded": compare(model, exact, padded)}
    if next(model.parameters()).device.type == "cuda":
        graphs = CacheStepGraphs(model, rows, MAX_CONTEXT, BLOCK)
        graphs.hidden(seqs, ids, pos)  # captures, then replays
        graph = graphs.hidden(seqs, ids, pos).clone()  # a second replay
        record["padded_vs_graph"] = compare(model, padded, graph)
        record["exact_vs_graph"] = compare(model, exact, graph)
    print(json.dumps(record), flush=True)
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llada-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--contexts", default="1224,1280")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    t0 = time.perf_counter()
    model = build_model(args.shape, device, getattr(torch, args.dtype))
    with torch.inference_mode():
        records = [
            run(model, int(rows), int(context))
            for rows in args.rows.split(",")
            for context in args.contexts.split(",")
        ]
    result = {
        "shape": args.shape,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "records": records,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
