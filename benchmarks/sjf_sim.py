"""One TP-1 instance in the simulator serving requests in an order set by their costs: the
shared half of `dws.py`'s SJF experiments (bundled task and chat prompts)."""

from __future__ import annotations

import numpy as np


def simulate(profile, policy: str, requests, steps, batch: int, **overrides) -> list:
    """`requests` (with their costs) on one TP-1 instance under `policy` (with `overrides` of
    its fields, e.g. aging), each block taking `steps[request_id][block]` steps: the finished
    requests."""
    from dilaserve.control.decisions import InstanceSpec, SchedulerConfig
    from dilaserve.control.policy import get_policy
    from dilaserve.control.scheduler import Scheduler
    from dilaserve.sim.behaviour import BlockStepsBehaviour
    from dilaserve.sim.simulator import SimConfig, Simulator

    config = SchedulerConfig(slo=1e6, max_batch_requests=batch)
    scheduler = Scheduler(get_policy(policy, **overrides), profile, None, config)
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
        "first_block_p99": round(float(np.percentile(first, 99)), 4),
        "latency_max": round(float(latency.max()), 4),
        "fcfs_over_this": round((fcfs_mean or mean) / mean, 3),
    }


def alone_step_ms(profile, num_tokens: int, block_steps) -> list[tuple[int, int, float]]:
    """A request's steps alone on the instance, (block, step, ms): each block's recompute step
    over the whole sequence of `num_tokens`, then its cache steps over one block, priced by the
    latency profile. Blocks with no steps are not run."""
    from dilaserve.protocol import StepKind

    recompute = 1e3 * profile.step_latency(1, num_tokens, StepKind.RECOMPUTE)
    cache = 1e3 * profile.step_latency(1, profile.block_len, StepKind.CACHE)
    cells = [(b, s) for b, n in enumerate(block_steps) for s in range(int(n))]
    return [(b, s, recompute if s == 0 else cache) for b, s in cells]


def alone_ms(profile, num_tokens: int, block_steps) -> float:
    """The request's time alone on the instance (`alone_step_ms`, summed)."""
    return sum(ms for _, _, ms in alone_step_ms(profile, num_tokens, block_steps))
