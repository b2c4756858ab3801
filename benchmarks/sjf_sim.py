"""One TP-1 instance in the simulator serving requests in an order set by their costs: the
shared half of `dws.py`'s SJF experiments (bundled task and chat prompts)."""

from __future__ import annotations

import numpy as np


def simulate(
    profile, policy: str, requests, steps, batch: int, kv_cache="dual", **overrides
) -> list:
    """`requests` (with their costs) on one TP-1 instance under `policy` (with `overrides` of
    its fields, e.g. aging), each block taking `steps[request_id][block]` steps, the instance's
    steps of the kinds `kv_cache` runs (dual: recompute and cache steps; block, a block-causal
    model's exact cache: prefill, block and commit steps): the finished requests."""
    from dilaserve.control.decisions import InstanceSpec, SchedulerConfig
    from dilaserve.control.policy import get_policy
    from dilaserve.control.scheduler import Scheduler
    from dilaserve.sim.behaviour import BlockStepsBehaviour
    from dilaserve.sim.simulator import SimConfig, Simulator

    config = SchedulerConfig(
        kv_cache=kv_cache, block_len=profile.block_len, slo=1e6, max_batch_requests=batch
    )
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


def alone_step_ms(
    profile, num_tokens: int, block_steps, kv_cache="dual", prompt_len: int = 0
) -> list[tuple[int, int, float]]:
    """A request's steps alone on the instance, (block, step, ms), priced by the latency
    profile. With an approximate (dual) cache: each block's recompute step over the whole
    sequence of `num_tokens`, then its cache steps over one block. With a block-causal model's
    exact cache (`kv_cache="block"`; `prompt_len` then needed): a prefill over the prompt up to
    the end of its first block (blocks at absolute positions), a commit step of two blocks at
    each later block's start, and block steps over one block. Blocks with no steps are not run."""
    from dilaserve.control.step_costs import StepCosts
    from dilaserve.protocol import KVCacheMode, StepKind, block_offset

    costs = StepCosts(KVCacheMode(kv_cache), profile.block_len)

    def ms(kind: StepKind, tokens: int) -> float:
        return 1e3 * profile.step_latency(1, tokens, kind)

    if costs.exact:
        start = prompt_len - block_offset(prompt_len, costs.block_len, True)  # block 0's start
        first = ms(StepKind.PREFILL, min(start + costs.block_len, num_tokens))
        boundary = ms(StepKind.COMMIT, costs.tokens(StepKind.COMMIT, num_tokens))
    else:
        first = boundary = ms(costs.sequence_kind, num_tokens)
    inner = ms(costs.inner_kind, costs.inner_tokens(num_tokens))
    cells = [(b, s) for b, n in enumerate(block_steps) for s in range(int(n))]
    return [(b, s, inner if s else first if b == 0 else boundary) for b, s in cells]


def alone_ms(profile, num_tokens: int, block_steps, kv_cache="dual", prompt_len: int = 0) -> float:
    """The request's time alone on the instance (`alone_step_ms`, summed)."""
    return sum(
        ms for _, _, ms in alone_step_ms(profile, num_tokens, block_steps, kv_cache, prompt_len)
    )
