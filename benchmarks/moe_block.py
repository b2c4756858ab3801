"""LLaDA2's MoE block: routed experts as one grouped matmul against one expert at a time.

    OMP_NUM_THREADS=1 python benchmarks/moe_block.py [--experts 64] [--tokens 32,128,512]

Times `SparseMoeBlock` (random weights, fp32, one thread) both ways on the same weights and
input: the grouped path (`torch._grouped_mm`, no host sync) and the per-expert path the bank
falls back to (a Python loop after a device-to-host copy of the counts), best of 7 rounds of 10.
Prints a table and writes a run folder under `--out`.
"""

from __future__ import annotations

import argparse
import time

import torch

from dilaserve.models import moe
from dilaserve.models.layers import TPGroup
from dilaserve.models.llada2 import LLaDA2Config
from dilaserve.runs import write_table_run


def block(experts: int, top_k: int, hidden: int, width: int) -> moe.SparseMoeBlock:
    cfg = LLaDA2Config.from_dict(
        dict(
            hidden_size=hidden,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=2 * hidden,
            vocab_size=64,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=width,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            n_group=8,
            topk_group=4,
            num_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            max_position_embeddings=64,
        )
    )
    torch.manual_seed(0)
    b = moe.SparseMoeBlock(cfg, TPGroup())
    for p in b.parameters():
        p.data.normal_(0, 0.05)
    return b


def best_ms(b: moe.SparseMoeBlock, x: torch.Tensor) -> float:
    with torch.no_grad():
        for _ in range(3):
            b(x)
        rounds = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(10):
                b(x)
            rounds.append((time.perf_counter() - start) / 10)
    return min(rounds) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--width", type=int, default=128, help="each expert's intermediate size")
    ap.add_argument("--tokens", default="32,128,512")
    ap.add_argument("--out", default="runs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    b = block(args.experts, args.top_k, args.hidden, args.width)
    grouped_fits = moe._grouped_mm_fits
    records = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(1, tokens, args.hidden)
        moe._grouped_mm_fits = grouped_fits
        grouped = best_ms(b, x)
        moe._grouped_mm_fits = lambda *a: False
        per_expert = best_ms(b, x)
        records.append(
            {
                "tokens": tokens,
                "grouped_ms": round(grouped, 2),
                "per_expert_ms": round(per_expert, 2),
                "speed_up": round(per_expert / grouped, 2),
            }
        )
    moe._grouped_mm_fits = grouped_fits
    title = (
        f"MoE block, {args.experts} experts (top {args.top_k}), hidden {args.hidden}, "
        f"expert width {args.width}, fp32, one thread"
    )
    write_table_run(args.out, "moe-block", vars(args), records, title)


if __name__ == "__main__":
    main()
