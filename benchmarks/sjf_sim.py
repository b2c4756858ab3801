"""One TP-1 instance in the simulator serving requests in an order set by their costs: the
shared half of `dws.py`'s SJF experiments (bundled task and chat prompts)."""

from __future__ import annotations

import numpy as np


def simulate(profile, policy: str, requests, steps, batch: int) -> list:
    """`requests` (with their costs) on one TP-1 instance under `policy`, each block taking
    `steps[request_id][block]` steps: the finished requests."""
    from dilaserve.control.decisions import InstanceSpec, SchedulerConfig
    from dilaserve.control.policy import get_policy
    from dilaserve.control.scheduler import Scheduler
    from dilaserve.sim.behaviour import BlockStepsBehaviour
    from dilaserve.sim.simulator import SimConfig, Simulator

    config = SchedulerConfig(slo=1e6, max_batch_requests=batch)
    scheduler = Scheduler(get_policy(policy), profile, None, config)
    spec = InstanceSpec("i0", 0, 1, (0,), 65536)
    sim = Simulator(scheduler, profile, BlockStepsBehaviour(steps), [spec], SimConfig())
    return sim.run(requests).requests


def latency_row(rate: float, name: str, done: list, fcfs_mean: float | None) -> dict:
    latency = np.array([r.finish_time - r.arrival_time for r in done])
    first = np.array([r.first_block_time - r.arrival_time for r in done])
    mean = float(latency.mean())
    return {
        "rps": rate,
        "policy": name,
        "finished": len(done),
        "latency_mean": round(mean, 4),
        "latency_p99": round(float(np.percentile(latency, 99)), 4),
        "first_block_mean": round(float(first.mean()), 4),
        "fcfs_over_this": round((fcfs_mean or mean) / mean, 3),
    }
