"""DWS on chat-shaped work: `dws.py`'s chat part (see its docstring and docs/dws.md).

ShareGPT first turns (real prompt texts and answer lengths; per-block steps from the simulator's
LLaDA model, since no chat dLLM runs here) train DWS, and the held-out prompts are served in the
simulator ordered by DWS and by noisy true costs.
"""

from __future__ import annotations

import numpy as np
from sjf_sim import alone_step_ms, latency_row, simulate

# lognormal widths of the chat experiment's noisy true costs; 0 is the true cost itself
CHAT_NOISE = (0.0, 0.17, 0.4, 0.8)
CHAT_HELD_OUT = 400  # chat prompts kept out of DWS's training, the simulated requests
CHAT_PROBES = 400  # training requests the cost kernel is fitted on
BLOCK = 32


def chat_workload(seed: int = 11):
    """ShareGPT first turns as DWS labels: real prompt texts and answer lengths (filtered as the
    paper does), each block taking the steps the simulator's LLaDA model gives at threshold 0.9
    for a drawn difficulty (log-normal, as in `ParametricBehaviour`): no chat dLLM runs here to
    label the steps themselves."""
    from dilaserve.dws.train import Labels
    from dilaserve.sim import traces
    from dilaserve.sim.behaviour import llada_tokens_per_step

    texts, prompts, outputs = traces.load_first_turns()
    keep = traces.kept_pairs(prompts, outputs, block_len=BLOCK)
    blocks = traces.rounded_outputs(outputs[keep], BLOCK) // BLOCK
    difficulty = np.random.default_rng(seed).lognormal(0.0, 0.35, len(keep))
    per_block = np.maximum(np.round(BLOCK * difficulty / llada_tokens_per_step(0.9)), 1)
    steps = np.zeros((len(keep), int(blocks.max())), dtype=np.int64)
    for i, (n, t) in enumerate(zip(blocks, per_block.astype(np.int64))):
        steps[i, :n] = t
    return Labels([texts[i] for i in keep], prompts[keep], steps, BLOCK * blocks, BLOCK, 0.9)


def _chat_probe(labels, i: int, profile):
    """Request i alone on the instance, priced by the profile (`alone_step_ms`)."""
    from dilaserve.dws.cost import ProbeRun

    num_tokens = int(labels.prompt_tokens[i] + labels.output_tokens[i])
    step_ms = alone_step_ms(profile, num_tokens, labels.steps[i])
    return ProbeRun(int(labels.prompt_tokens[i]), labels.block_len, step_ms)


def chat_costs(labels, profile, log):
    """DWS (hashed encoder) trained on all but `CHAT_HELD_OUT` chat prompts, its kernel fitted
    on `CHAT_PROBES` training probes priced by the profile: (held-out indices, their DWS costs,
    their true costs)."""
    from dilaserve.dws.cost import fit_cost_kernel
    from dilaserve.dws.estimate import DWSEstimator
    from dilaserve.dws.train import DWSTrainConfig, split, train_dws

    order = np.random.default_rng(0).permutation(len(labels))
    held, rest = order[:CHAT_HELD_OUT], order[CHAT_HELD_OUT:]
    predictor = train_dws(*split(labels.subset(rest), 0.1, 0), DWSTrainConfig(), log=log)
    probes = [_chat_probe(labels, i, profile) for i in rest[:CHAT_PROBES]]
    kernel = fit_cost_kernel(probes, labels.steps.shape[1], labels.block_len)
    test = labels.subset(held)
    window = labels.block_len * labels.steps.shape[1]
    estimates = DWSEstimator(predictor, kernel).estimate(
        test.texts, test.prompt_tokens.tolist(), window
    )
    true = np.array([_chat_probe(labels, i, profile).total_ms for i in held])
    return held, np.array([c for c, _ in estimates]), true


def chat_sjf(args, log) -> list[dict]:
    """Shortest-cost-first on chat-shaped work, with DWS's costs and with noisy true costs.

    `chat_workload`'s held-out prompts arrive as Poisson requests at one TP-1 LLaDA-8B instance
    on the H100 preset taking `--batch` requests per step. `dws-sjf` orders them by DWS trained
    on the other chat prompts; `sjf, sigma s` by each request's true cost (alone on the
    instance) times log-normal noise of width s (sigma 0.17 errs about as much as DWS does on
    the bundled task): how much ordering by cost can win here, and how much error it bears."""
    from dilaserve.request import Request
    from dilaserve.sim.latency import load_profile

    profile = load_profile("llada-8b-h100")
    labels = chat_workload()
    held, dws, true = chat_costs(labels, profile, log)
    orders = [("fcfs", "fcfs", None), ("dws-sjf", "dws-sjf", dws)]
    for sigma in CHAT_NOISE:
        noise = np.random.default_rng(7).lognormal(0.0, sigma, len(held))
        orders.append((f"sjf, sigma {sigma}", "dws-sjf", true * noise))
    rows = []
    for rate in args.chat_rates:
        rng = np.random.default_rng(5)
        n = int(rate * args.chat_seconds)
        arrivals = np.cumsum(rng.exponential(1 / rate, n)).tolist()
        picks = rng.integers(0, len(held), n).tolist()
        steps = {f"r{i}": labels.steps[held[k]] for i, k in enumerate(picks)}
        fcfs_mean = None
        for name, policy, costs in orders:
            order = dws if costs is None else costs  # fcfs reads no cost
            requests = [
                Request(
                    f"r{i}",
                    (3,) * int(labels.prompt_tokens[held[k]]),
                    int(labels.output_tokens[held[k]]),
                    BLOCK,
                    1,
                    0.9,
                    t,
                    cost=float(order[k]),
                )
                for i, (t, k) in enumerate(zip(arrivals, picks))
            ]
            row = latency_row(
                rate, name, simulate(profile, policy, requests, steps, args.batch), fcfs_mean
            )
            error = None if costs is None else np.mean(np.abs(costs / true - 1.0))
            row["cost_error"] = "" if error is None else round(float(error), 3)
            fcfs_mean = fcfs_mean or row["latency_mean"]
            rows.append(row)
            log(row)
    return rows
