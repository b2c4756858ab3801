"""Control-plane decision time per step-completion event.

    python benchmarks/control.py [--requests 100,1000,5000] [--instances 16,64]

Builds a scheduler (policy `dilaserve`, dual cache, block 32) over N TP-1 instances with a
synthetic latency profile and the bundled model's LightGBM step predictor (60 trees of up to
63 leaves), admits R requests (200-token prompts, 256-token outputs), then replays step
completions round-robin over instances: each completion commits two tokens per request of that
instance's batch, and the scheduler re-places them (refreshing predictions every 8 committed
tokens, re-running load control when they refresh or a request finishes). Prints and writes the
mean and p99 milliseconds per event, and the mean microseconds per request in the finished
batch, to a run folder.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dilaserve.config import BUNDLED_PREDICTOR
from dilaserve.control.policy import get_policy
from dilaserve.control.predictor import load_gbm
from dilaserve.control.profile import LatencyProfile
from dilaserve.control.scheduler import Scheduler, SchedulerConfig
from dilaserve.protocol import RequestStepResult, StepOutput
from dilaserve.request import Request
from dilaserve.runs import write_table_run

GEN, BLOCK, PROMPT = 256, 32, 200


def synthetic_profile() -> LatencyProfile:
    entries = [
        {"tp": 1, "kind": kind, "batch_tokens": n, "ms": base + n * per}
        for kind, base, per in (("recompute", 20.0, 0.004), ("cache", 10.0, 0.01))
        for n in (32, 256, 2048, 16384, 131072)
    ]
    return LatencyProfile.from_dict({"entries": entries, "block_len": BLOCK})


def step_results(s: Scheduler, batch) -> StepOutput:
    results = []
    for item in batch.items:
        r = s.requests[item.request_id].request
        masked = np.flatnonzero(~r.committed)[:2]
        block_done = masked.size and masked[-1] // BLOCK != masked[0] // BLOCK
        results.append(
            RequestStepResult(
                item.request_id,
                item.kind,
                masked.astype(np.int32),
                np.full(masked.size, 7, np.int32),
                np.full(r.gen_len, 0.8, np.float32),
                r.current_block,
                bool(block_done) or (masked.size and (masked[-1] + 1) % BLOCK == 0),
                False,
            )
        )
    return StepOutput(tuple(results), 0)


def run(num_requests: int, num_instances: int, events: int, predictor, profile) -> dict:
    s = Scheduler(
        get_policy("dilaserve"),
        profile,
        predictor,
        SchedulerConfig(kv_cache="dual", block_len=BLOCK, slo=30.0, max_requests_per_instance=256),
    )
    for i in range(num_instances):
        s.add_instance(f"i{i}", 1, 1 << 20)
    running = {}
    for i in range(num_requests):
        req = Request(
            f"r{i}", tuple(range(3, 3 + PROMPT)), GEN, BLOCK, 1, 0.9, arrival_time=i * 1e-3
        )
        for launch in s.on_arrival(req, req.arrival_time).launches:
            running[launch.instance_id] = launch.batch
    now, samples, batch_sizes = num_requests * 1e-3, [], []
    for e in range(events):
        instance = sorted(running)[e % len(running)]
        output = step_results(s, running.pop(instance))
        now += 0.03
        start = time.perf_counter()
        decisions = s.on_step_done(instance, output, now)
        samples.append(1e3 * (time.perf_counter() - start))
        batch_sizes.append(len(output.results))
        running.update({launch.instance_id: launch.batch for launch in decisions.launches})
    samples.sort()
    return {
        "requests": num_requests,
        "instances": num_instances,
        "events": events,
        "mean_batch": round(statistics.mean(batch_sizes), 1),
        "mean_ms": round(statistics.mean(samples), 3),
        "p99_ms": round(samples[int(0.99 * (len(samples) - 1))], 3),
        "us_per_request": round(1e3 * sum(samples) / sum(batch_sizes), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", default="100,1000,5000")
    ap.add_argument("--instances", default="16,64")
    ap.add_argument("--events", type=int, default=300)
    ap.add_argument("--out", default="runs")
    args = ap.parse_args()
    predictor, profile = load_gbm(BUNDLED_PREDICTOR), synthetic_profile()
    records = []
    for n in map(int, args.requests.split(",")):
        for m in map(int, args.instances.split(",")):
            records.append(run(n, m, args.events, predictor, profile))
            print(records[-1], flush=True)
    write_table_run(args.out, "control", vars(args), records, "control-plane decision time")


if __name__ == "__main__":
    main()
