"""A simulation's workload: its trace, its requests (with SLOs and, for DWS-SJF, oracle costs),
the behaviour model that decides what each step commits, and the step predictor trained on that
behaviour. `sim/run.py` runs them through the control plane.

The SLO, unless given in seconds, is `slo_multiple` times the mean latency of the trace's
requests each running alone on a TP-1 instance at the spec's threshold, 0.9 unless set
(papers.md 1.3): one recompute step per block at the whole sequence, cache steps of one block
for the rest. A block-causal
model (a profile whose meta says `block_causal`, e.g. `llada2-mini-h200`) runs with its exact
cache (`kv_cache="block"`): its requests' blocks sit at absolute positions (`block_offset`), the
parametric behaviour takes the model's tokens per step, and the isolated latency is a prefill,
a commit step per later block and block steps, on the smallest TP degree that holds the model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dilaserve.config import DEFAULT_THRESHOLD, MEASURED_THRESHOLDS
from dilaserve.control.features import FEATURE_NAMES, PROGRESS_FEATURES
from dilaserve.control.policy import Order
from dilaserve.control.profile import LatencyProfile
from dilaserve.control.step_costs import StepCosts
from dilaserve.protocol import KVCacheMode, block_offset
from dilaserve.request import Request
from dilaserve.sim import synthetic, traces
from dilaserve.sim.behaviour import ParametricBehaviour, ReplayBehaviour, tokens_per_step_for
from dilaserve.sim.spec import SimulationSpec


def make_trace(spec: SimulationSpec) -> traces.Trace:
    rng = np.random.default_rng(spec.seed)
    if spec.trace == "paper":
        trace = synthetic.paper_trace(
            seed=spec.seed,
            peak_rps=spec.peak_rps,
            minutes_per_hour=spec.minutes_per_hour,
            block_len=spec.block_len,
        )
    elif spec.trace.startswith(("poisson:", "bursty:", "code:", "fixed:")):
        trace = synthetic_trace(spec.trace, spec.block_len, rng)
    else:
        trace = traces.load_trace(spec.trace)
    if spec.duration is not None:
        trace = trace.window(0.0, spec.duration)
    if spec.rate_scale != 1.0:
        trace = dataclasses.replace(trace, arrival=trace.arrival / spec.rate_scale)
    if len(trace) == 0:
        raise ValueError(f"trace {spec.trace!r} has no requests in the first {spec.duration} s")
    return trace


def synthetic_trace(name: str, block_len: int, rng: np.random.Generator) -> traces.Trace:
    """`poisson:RPS:SECONDS` (ShareGPT lengths), `bursty:RPS:SECONDS[:CV]` (the same lengths,
    gamma arrivals), `code:RPS:SECONDS[:CV]` (code-like lengths, gamma arrivals) or
    `fixed:RPS:SECONDS:PROMPT:OUTPUT` (Poisson arrivals, every request the same lengths: the
    paper's Fig. 12 and 13 settings; `OUTPUT/OUTPUT...`: each request draws one of these)."""
    if name.startswith("fixed:"):
        rate, seconds, prompt_len, outputs = synthetic.parse_fixed(name)
        arrivals = synthetic.poisson_arrivals(rate, seconds, rng)
        prompts = np.full(len(outputs), prompt_len)
        lengths = prompts, traces.rounded_outputs(list(outputs), block_len)
        return synthetic.synthesize_trace(arrivals, *lengths, rng, source=name)
    if name.startswith("poisson:"):
        rate, seconds = synthetic.parse_poisson(name)
        arrivals = synthetic.poisson_arrivals(rate, seconds, rng)
    else:
        rate, seconds, cv = synthetic.parse_bursty(name)
        arrivals = synthetic.gamma_arrivals(rate, cv, seconds, rng)
    if name.startswith("code:"):
        prompt, output = synthetic.code_lengths(max(len(arrivals), 1), rng)
    else:
        prompt, output = traces.filter_lengths(
            *traces.load_first_turn_lengths(), block_len=block_len
        )
    return synthetic.synthesize_trace(arrivals, prompt, output, rng, source=name)


def isolated_latency(
    profile: LatencyProfile,
    prompt: int,
    output: int,
    block: int,
    tokens_per_step: float,
    costs: StepCosts | None = None,
) -> float:
    """One request alone on the profile's smallest TP degree (TP-1 unless the model needs more):
    a boundary step per block and inner steps for the rest, the first step a sequence step
    (a prefill where the cache is exact). An approximate cache or none is priced as the paper's
    dual cache (recompute and cache steps), which is what the SLO multiple refers to."""
    costs = costs if costs is not None and costs.exact else StepCosts(KVCacheMode.DUAL, block)
    tp = profile.tp_degrees[0]
    blocks = -(-output // block)
    steps = max(output / tokens_per_step, blocks)
    tokens = prompt + blocks * block
    boundary = profile.step_latency(tp, costs.boundary_batch_tokens(tokens), costs.boundary_kind)
    inner = profile.step_latency(tp, costs.inner_tokens(tokens), costs.inner_kind)
    first = profile.step_latency(tp, tokens, costs.sequence_kind) - boundary  # 0 with recompute
    return first + blocks * boundary + (steps - blocks) * inner


def slo_for(
    spec: SimulationSpec, profile: LatencyProfile, requests: list[Request], rate: float
) -> float:
    """The spec's SLO in seconds, or its multiple of the requests' mean isolated latency at
    the spec's threshold (`rate` tokens committed per step)."""
    if spec.slo is not None:
        return spec.slo
    costs = spec.costs
    isolated = [
        isolated_latency(profile, r.prompt_len, r.gen_len, spec.block_len, rate, costs)
        for r in requests
    ]
    return spec.slo_multiple * float(np.mean(isolated))


def requests_from(
    trace: traces.Trace,
    block: int,
    aligned: bool = False,
    threshold: float = DEFAULT_THRESHOLD,
) -> list[Request]:
    """The trace's requests, outputs rounded up to whole blocks; a per-request SLO in the trace
    becomes its deadline (the others get the scheduler's). `aligned`: a block-causal model's
    blocks start at absolute multiples of `block` (`Request.block_offset`)."""
    out = []
    for i in range(len(trace)):
        output = -(-max(int(trace.output_tokens[i]), 1) // block) * block
        arrival = float(trace.arrival[i])
        own = float(trace.slo[i]) if trace.slo is not None else None
        prompt = int(trace.prompt_tokens[i])
        out.append(
            Request(
                f"r{i}",
                (3,) * prompt,
                output,
                block,
                1,
                threshold,
                arrival,
                deadline=None if own is None else arrival + own,
                block_offset=block_offset(prompt, block, aligned),
            )
        )
    return out


def with_unit_costs(requests: list[Request], rate) -> None:
    """DWS's unit cost (papers.md 2.6: prompt blocks + output blocks + steps) with each
    request's TRUE lengths in place of the predicted surface: an oracle DWS, for `dws-sjf`."""
    for r in requests:
        steps = max(r.gen_len / rate(r.threshold), r.num_blocks)
        r.cost = r.prompt_len // r.block_len + r.num_blocks + steps


def workload(spec: SimulationSpec, trace: traces.Trace, policy, model: str | None = None):
    """(behaviour, requests, step predictor): parametric behaviour (at `model`'s tokens per
    step) with the trace's lengths and a predictor trained on it, or recorded trajectories
    replayed (each arrival takes a recorded prompt's lengths) with the predictor trained on
    those trajectories."""
    if not spec.behaviour.startswith("replay:"):
        rate = tokens_per_step_for(model)
        behaviour = ParametricBehaviour(seed=spec.seed + 2, tokens_per_step=rate)
        aligned = spec.costs.exact
        requests = requests_from(trace, spec.block_len, aligned, spec.threshold)
        if policy.order is Order.COST:
            with_unit_costs(requests, rate)
        return behaviour, requests, make_predictor(spec, policy, trace, rate)
    from dilaserve.config import BUNDLED_PREDICTOR
    from dilaserve.control.predictor import OraclePredictor, create_predictor
    from dilaserve.trajectory import load_trajectories

    behaviour = ReplayBehaviour(load_trajectories(spec.behaviour.removeprefix("replay:")))
    rng = np.random.default_rng(spec.seed + 5)
    requests = []
    for i, arrival in enumerate(trace.arrival.tolist()):
        t = behaviour.assign(f"r{i}", int(rng.choice(behaviour.prompts)))
        requests.append(
            Request(
                f"r{i}",
                (3,) * t.prompt_len,
                t.gen_len,
                t.block_len,
                1,
                0.9,
                arrival,
                block_offset=t.block_offset,  # blocks at absolute positions (block diffusion)
                edits=t.edits,  # its blocks' edit phases are replayed
            )
        )
    if policy.predictor == "oracle":
        return behaviour, requests, OraclePredictor(MEASURED_THRESHOLDS, behaviour.remaining_steps)
    folder = spec.predictor_path or BUNDLED_PREDICTOR
    return behaviour, requests, create_predictor(policy.predictor, folder)


def make_predictor(spec: SimulationSpec, policy, trace: traces.Trace, rate=None):
    """The policy's step predictor for parametric behaviour (at `rate` tokens per step):
    trained on simulated runs of sample requests of the trace at MEASURED_THRESHOLDS and the
    policy's candidates (full or progress features), or the one-shot rates."""
    from dilaserve.sim.predictor import simulated_trajectories, train_sim_predictor

    name = policy.predictor
    thresholds = tuple(sorted(set(MEASURED_THRESHOLDS) | set(policy.candidates)))
    rng = np.random.default_rng(spec.seed + 3)
    picks = rng.integers(0, len(trace), min(spec.predictor_prompts, len(trace)))
    shapes = [
        (
            int(trace.prompt_tokens[i]),
            -(-int(trace.output_tokens[i]) // spec.block_len) * spec.block_len,
        )
        for i in picks
    ]
    if name in ("full", "progress"):
        features = FEATURE_NAMES if name == "full" else PROGRESS_FEATURES
        behaviour = ParametricBehaviour(seed=spec.seed + 4, tokens_per_step=rate)
        block_len, mode = spec.block_len, spec.costs.mode
        return train_sim_predictor(
            behaviour, shapes, thresholds, block_len=block_len, mode=mode, features=features
        )
    if name == "oracle":
        raise ValueError(
            "the oracle step predictor knows true remaining steps only for replayed "
            "trajectories: use --behaviour replay:TRAJECTORIES.npz"
        )
    if name == "one-shot":
        from dilaserve.control.predictor import OneShotPredictor
        from dilaserve.training.train_predictor import one_shot_rates

        behaviour = ParametricBehaviour(seed=spec.seed + 4, tokens_per_step=rate)
        trajs = simulated_trajectories(
            behaviour, shapes, thresholds, block_len=spec.block_len, mode=spec.costs.mode
        )
        return OneShotPredictor(thresholds, one_shot_rates(trajs))
    raise ValueError(f"no simulated step predictor {name!r}")
