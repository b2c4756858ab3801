"""Planner solve time: Stage 1 + Stage 2 on HiGHS for growing clusters.

    python benchmarks/planner.py [--gpus 16,64,256] [--repeats 3]

The problem has the size the issue names: 8 workload classes (2 prompt x 4 output sizes), 5
thresholds, TP degrees 1/2/4/8 on 8-GPU nodes, and 8 batch sizes per TP degree and step kind,
with the approximate KV cache on (the cache-aware model, the larger one). The latency profile is
synthetic but sized like LLaDA-8B on an H100: 20 ms per step (reading 16 GB of bf16 weights,
launch overhead) plus 32 us per token (2 x 8e9 FLOPs at half of 989 TFLOP/s; 40 us for
cache-step tokens, which also read the context's K/V), TP-d latency scaled by the paper's
factors (TP-2 -25%, TP-4 -55%; TP-8 extrapolated to -65%). Class rates
grow with the cluster so that the load stays near 60% of what all-TP-1 could carry, and Stage 2
starts from every GPU running a TP-1 instance, so it has real moves to plan. Prints and writes
the median seconds per stage to a run folder, with the profile used (`profile.json`).
"""

from __future__ import annotations

import argparse
import statistics
import time

from dilaserve.control.layout import InstanceSlot, launch_order, plan_layout
from dilaserve.control.monitor import WorkloadClass
from dilaserve.control.planner import PlannerConfig, plan_capacity
from dilaserve.control.profile import LatencyProfile
from dilaserve.runs import write_json, write_table_run

TP_FACTOR = {1: 1.0, 2: 0.75, 4: 0.45, 8: 0.35}
BATCH_TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
CACHE_BATCH_TOKENS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
TOKENS_PER_STEP = {0.5: 5.0, 0.6: 4.4, 0.7: 3.8, 0.8: 3.3, 0.9: 2.4}
GPUS_PER_NODE = 8


def synthetic_profile() -> LatencyProfile:
    entries = []
    for tp, factor in TP_FACTOR.items():
        for kind, sizes, base_ms, per_token_ms in (
            ("recompute", BATCH_TOKENS, 20.0, 0.032),
            ("cache", CACHE_BATCH_TOKENS, 20.0, 0.040),
        ):
            for n in sizes:
                ms = (base_ms + per_token_ms * n) * factor
                entries.append({"tp": tp, "kind": kind, "batch_tokens": n, "ms": round(ms, 3)})
    meta = {"model": "synthetic LLaDA-8B-like", "hardware": "synthetic", "dtype": "bfloat16"}
    return LatencyProfile.from_dict({**meta, "block_len": 32, "entries": entries})


def workload(gpus: int) -> list[WorkloadClass]:
    shapes = [(p, o) for p in (256, 1024) for o in (64, 128, 256, 512)]
    per_gpu = 0.01  # requests per second per GPU and class
    return [WorkloadClass(p, o, per_gpu * gpus * 64 / o, slo=20.0) for p, o in shapes]


def all_tp1(gpus: int) -> list[InstanceSlot]:
    return [
        InstanceSlot(f"old-{g}", g // GPUS_PER_NODE, 1, (g % GPUS_PER_NODE,)) for g in range(gpus)
    ]


def run(gpus: int, repeats: int, profile: LatencyProfile) -> dict:
    cfg = PlannerConfig((GPUS_PER_NODE,) * (gpus // GPUS_PER_NODE), TOKENS_PER_STEP)
    classes, running = workload(gpus), all_tp1(gpus)
    stage1, stage2 = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_capacity(classes, profile, cfg)
        stage1.append(time.perf_counter() - start)
        start = time.perf_counter()
        layout = plan_layout(plan.counts(), cfg.gpus_per_node, running)
        move = launch_order(layout, running, plan, "bench")
        stage2.append(time.perf_counter() - start)
    s1, s2 = statistics.median(stage1), statistics.median(stage2)
    return {
        "gpus": gpus,
        "feasible": plan.feasible,
        "instances": " ".join(f"{n}xTP{tp}" for tp, n in plan.counts().items()),
        "kept": sum(1 for p in layout if p.keep),
        "launches": len(move.steps),
        "stage1_s": round(s1, 3),
        "stage2_s": round(s2, 3),
        "total_s": round(s1 + s2, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gpus", default="16,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs")
    args = ap.parse_args()
    profile = synthetic_profile()
    records = []
    for gpus in map(int, args.gpus.split(",")):
        records.append(run(gpus, args.repeats, profile))
        print(records[-1], flush=True)
    folder = write_table_run(args.out, "planner", vars(args), records, "planner solve time")
    write_json(folder / "profile.json", profile.to_dict())


if __name__ == "__main__":
    main()
