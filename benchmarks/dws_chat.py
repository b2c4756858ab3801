"""DWS on chat: `dws.py`'s chat parts (see its docstring and docs/dws/results.md).

The workload (`chat_workload`): ShareGPT first turns, filtered as the paper does. MEASURED: each
prompt's text and its real answer's length (`first_response_chars`), which fixes its output
blocks N. MODELLED: the steps each block takes, drawn from the LLaDA-8B behaviour model of the
simulator (`ParametricBehaviour`'s law at threshold 0.9: a per-request difficulty, log-normal,
and per step 1 + Poisson(T(0.9) / difficulty - 1) tokens), since no chat dLLM runs here; and a
cell's ms, from a latency profile (`PROFILES`: the H200 profile measured on LLaDA-8B, and the
H100 preset). DWS and the scalar proxies are trained on the same prompts with each encoder
(`ENCODERS`: the dws extra's all-MiniLM-L6-v2, frozen, and the hashed fallback); the held-out
prompts are judged (`chat_cost`) and served in the simulator ordered by each (`chat_sjf`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
from sjf_sim import alone_step_ms, latency_row, simulate

BLOCK = 32
THRESHOLD = 0.9
DIFFICULTY_SIGMA = 0.35  # ParametricBehaviour's default
CHAT_HELD_OUT = 400  # chat prompts kept out of training: the judged and simulated requests
CHAT_PROBES = 400  # training requests the cost kernel and the proxies' ms maps are fitted on
PROFILES = ("llada-8b-h200", "llada-8b-h100")  # measured on H200; the H100 preset
SJF_PROFILE = "llada-8b-h200"
ENCODERS = ("minilm", "hashed")
CHAT_NOISE = (0.0, 0.4, 0.8)  # log-normal widths of the noisy true costs; 0: the true cost
LATENCY_PROMPTS = 200  # held-out prompts timed one at a time for the encoder latency


def behaviour_block_steps(num_blocks: int, difficulty: float, rng) -> np.ndarray:
    """Steps of each of `num_blocks` blocks under the simulator's LLaDA-8B unmasking law."""
    from dilaserve.sim.behaviour import llada_tokens_per_step

    extra = max(llada_tokens_per_step(THRESHOLD) / difficulty - 1.0, 0.0)
    steps = np.zeros(num_blocks, dtype=np.int64)
    for b in range(num_blocks):
        left = BLOCK
        while left > 0:
            left -= min(left, 1 + int(rng.poisson(extra)))
            steps[b] += 1
    return steps


def chat_workload(seed: int = 11):
    """ShareGPT first turns as DWS labels (see the module docstring)."""
    from dilaserve.dws.surface import Labels
    from dilaserve.sim import traces

    texts, prompts, outputs = traces.load_first_turns()
    keep = traces.kept_pairs(prompts, outputs, block_len=BLOCK)
    blocks = traces.rounded_outputs(outputs[keep], BLOCK) // BLOCK
    rng = np.random.default_rng(seed)
    difficulty = rng.lognormal(0.0, DIFFICULTY_SIGMA, len(keep))
    steps = np.zeros((len(keep), int(blocks.max())), dtype=np.int64)
    for i, (n, d) in enumerate(zip(blocks, difficulty)):
        steps[i, :n] = behaviour_block_steps(int(n), float(d), rng)
    return Labels([texts[i] for i in keep], prompts[keep], steps, BLOCK * blocks, BLOCK, THRESHOLD)


def _cached_minilm():
    """The packaged MiniLM encoder with its features memoised per text (it is frozen, so DWS
    and both proxies share it and every prompt is encoded once)."""
    from dilaserve.dws.encoders import MINILM, SentenceTransformerEncoder

    class Cached(SentenceTransformerEncoder):
        def __init__(self):
            super().__init__(MINILM)
            self.memo: dict[str, np.ndarray] = {}

        def features(self, texts: list[str]) -> list[np.ndarray]:
            missing = [t for t in dict.fromkeys(texts) if t not in self.memo]
            if missing:
                self.memo.update(zip(missing, super().features(missing)))
            return [self.memo[t] for t in texts]

    return Cached()


@dataclass
class ChatModels:
    """What both chat parts share: the labels, the split, and per encoder the trained DWS and
    the two proxies (texts -> predicted output tokens / total steps)."""

    labels: object
    held: np.ndarray
    rest: np.ndarray
    dws: dict
    proxies: dict
    train_seconds: dict


@functools.cache
def chat_models() -> ChatModels:
    from dilaserve.dws.surface import split
    from dilaserve.dws.train import DWSTrainConfig, train_dws, train_scalar

    labels = chat_workload()
    order = np.random.default_rng(0).permutation(len(labels))
    held, rest = order[:CHAT_HELD_OUT], order[CHAT_HELD_OUT:]
    train, val = split(labels.subset(rest), 0.1, 0)
    dws, proxies, seconds = {}, {}, {}
    for name in ENCODERS:
        start = time.perf_counter()
        encoder = _cached_minilm() if name == "minilm" else None
        cfg = DWSTrainConfig()
        dws[name] = train_dws(train, val, cfg, log=print, encoder=encoder)
        for proxy, target in (
            ("predicted output length", lambda lab: lab.output_tokens),
            ("predicted total steps", lambda lab: lab.steps.sum(axis=1)),
        ):
            proxies[name, proxy] = train_scalar(train, val, target, cfg, encoder=encoder)
        seconds[name] = round(time.perf_counter() - start, 1)
        print(f"{name}: DWS and proxies trained in {seconds[name]} s")
    return ChatModels(labels, held, rest, dws, proxies, seconds)


def _alone(labels, i: int, profile):
    """Request i alone on the instance, priced by the profile (`alone_step_ms`), as a probe."""
    from dilaserve.dws.cost import ProbeRun

    num_tokens = int(labels.prompt_tokens[i] + labels.output_tokens[i])
    step_ms = alone_step_ms(profile, num_tokens, labels.steps[i])
    return ProbeRun(int(labels.prompt_tokens[i]), labels.block_len, step_ms)


def _errors(name: str, predicted: np.ndarray, truth: np.ndarray) -> dict:
    relative = np.abs(predicted - truth) / truth
    return {
        "predictor": name,
        "mean_relative_error": round(float(relative.mean()), 4),
        "median_relative_error": round(float(np.median(relative)), 4),
        "mae_ms": round(float(np.mean(np.abs(predicted - truth))), 1),
    }


def _linear_ms(calib_x: np.ndarray, calib_ms: np.ndarray, x: np.ndarray) -> np.ndarray:
    a, b = np.polyfit(calib_x, calib_ms, 1)
    return a * x + b


def chat_kernel(models: ChatModels, profile):
    """The cost kernel fitted on the probes of `CHAT_PROBES` training requests (alone on the
    instance, priced by `profile`): one per deployment, whatever the predictor."""
    from dilaserve.dws.cost import fit_cost_kernel

    labels = models.labels
    probes = [_alone(labels, i, profile) for i in models.rest[:CHAT_PROBES]]
    return fit_cost_kernel(probes, labels.steps.shape[1], labels.block_len)


def dws_costs(models: ChatModels, kernel, encoder: str) -> np.ndarray:
    """The held-out prompts' DWS costs (ms): `encoder`'s surface x `kernel`, over the whole
    window (no request's length is known)."""
    from dilaserve.dws.estimate import DWSEstimator

    test = models.labels.subset(models.held)
    window = test.block_len * test.steps.shape[1]
    estimates = DWSEstimator(models.dws[encoder], kernel).estimate(
        test.texts, test.prompt_tokens.tolist(), window
    )
    return np.array([c for c, _ in estimates])


def chat_cost(args, log) -> tuple[list[dict], dict]:
    """Cost-prediction error on the held-out chat prompts, per profile: DWS (surface x kernel)
    against the scalar proxies (mapped to ms by a linear fit on the probes), each encoder; a
    constant (the probes' median), which knows nothing of the prompt; and the ceilings: each
    predictor fed the truth (the true surface x kernel; the true output length or total steps
    through the proxies' linear map)."""
    from dilaserve.sim.profiles import load_profile

    models = chat_models()
    labels, held, probes_at = models.labels, models.held, models.rest[:CHAT_PROBES]
    rows, summary = [], {"workload": workload_stats(labels)}
    for profile_name in PROFILES:
        profile = load_profile(profile_name)
        truth = np.array([_alone(labels, i, profile).total_ms for i in held])
        summary[profile_name] = {
            "held_out_true_ms_mean": round(float(truth.mean()), 1),
            "held_out_true_ms_cv": round(float(truth.std() / truth.mean()), 3),
            "held_out_true_ms_spread": round(float(truth.max() / truth.min()), 1),
        }
        calib_ms = np.array([_alone(labels, i, profile).total_ms for i in probes_at])
        kernel = chat_kernel(models, profile)
        table = []
        for encoder in ENCODERS:
            dws = dws_costs(models, kernel, encoder)
            table.append(_errors(f"DWS ({encoder})", dws, truth))
            for proxy in ("predicted output length", "predicted total steps"):
                predict = models.proxies[encoder, proxy]
                calib = predict([labels.texts[i] for i in probes_at])
                ms = _linear_ms(calib, calib_ms, predict([labels.texts[i] for i in held]))
                table.append(_errors(f"{proxy} ({encoder})", ms, truth))
        constant = np.full(len(held), np.median(calib_ms))  # knows nothing of the prompt
        table.append(_errors("constant: the probes' median ms", constant, truth))
        true_cost = np.array([kernel.cost_of_run(_alone(labels, i, profile)) for i in held])
        table.append(_errors("ceiling: true surface x kernel", true_cost, truth))
        for proxy, values in (
            ("output length", labels.output_tokens),
            ("total steps", labels.steps.sum(axis=1)),
        ):
            ms = _linear_ms(values[probes_at], calib_ms, values[held])
            table.append(_errors(f"ceiling: true {proxy}, linear ms map", ms, truth))
        for row in table:
            rows.append({"profile": profile_name, **row})
            log(rows[-1])
        rows.append(_ratio_row(profile_name, table))
        log(rows[-1])
    log(summary)
    return rows, summary


def workload_stats(labels) -> dict:
    blocks = (labels.steps > 0).sum(axis=1)
    return {
        "requests": len(labels),
        "blocks_mean": round(float(blocks.mean()), 2),
        "blocks_max": int(blocks.max()),
        "steps_mean": round(float(labels.steps.sum(axis=1).mean()), 1),
        "steps_per_block_mean": round(float(labels.steps.sum() / blocks.sum()), 2),
    }


def _ratio_row(profile_name: str, table: list[dict]) -> dict:
    """Best proxy's mean relative error over DWS's, per encoder (the 2x target)."""
    by_name = {r["predictor"]: r["mean_relative_error"] for r in table}
    ratios = []
    for encoder in ENCODERS:
        proxy = min(
            by_name[f"{p} ({encoder})"]
            for p in ("predicted output length", "predicted total steps")
        )
        ratios.append(f"{encoder} {proxy / by_name[f'DWS ({encoder})']:.2f}x")
    blank = dict.fromkeys(("mean_relative_error", "median_relative_error", "mae_ms"), "")
    return {"profile": profile_name, "predictor": "best proxy / DWS: " + ", ".join(ratios), **blank}


def aging_bound(costs: np.ndarray, aging: float = 0.10, period: float = 30.0) -> dict:
    """The aging rule's bound on overtaking: after waiting W = period * (K + 1) seconds, with
    K = ceil(ln(max cost / min cost) / ln(1 / (1 - aging))), no request that arrives later can
    be served before a waiting request (its aged cost is below any newcomer's)."""
    k = int(np.ceil(np.log(costs.max() / costs.min()) / np.log(1.0 / (1.0 - aging))))
    return {
        "cost_spread": round(float(costs.max() / costs.min()), 1),
        "periods": k,
        "overtaking_bound_s": period * (k + 1),
    }


def chat_sjf(args, log) -> tuple[list[dict], dict]:
    """Shortest-cost-first on the chat workload in the simulator (`SJF_PROFILE`, one TP-1
    instance taking `--batch` requests per step): FCFS; DWS-SJF with each encoder's costs (and
    with aging off, to show what aging bounds); SJF on true costs times log-normal noise."""
    from dilaserve.request import Request
    from dilaserve.sim.profiles import load_profile

    models = chat_models()
    labels, held = models.labels, models.held
    profile = load_profile(SJF_PROFILE)
    true = np.array([_alone(labels, i, profile).total_ms for i in held])
    kernel = chat_kernel(models, profile)
    dws = {e: dws_costs(models, kernel, e) for e in ENCODERS}
    orders = [("fcfs", "fcfs", true, {})]
    orders += [(f"dws-sjf ({e})", "dws-sjf", dws[e], {}) for e in ENCODERS]
    orders.append(("dws-sjf (minilm), no aging", "dws-sjf", dws["minilm"], {"aging": 0.0}))
    for sigma in CHAT_NOISE:
        noise = np.random.default_rng(7).lognormal(0.0, sigma, len(held))
        orders.append((f"sjf, true cost, sigma {sigma}", "dws-sjf", true * noise, {}))
    summary = {"aging_bound_minilm_costs": aging_bound(dws["minilm"])}
    log(summary)
    rows = []
    for rate in args.chat_rates:
        rng = np.random.default_rng(5)
        n = int(rate * args.chat_seconds)
        arrivals = np.cumsum(rng.exponential(1 / rate, n)).tolist()
        picks = rng.integers(0, len(held), n).tolist()
        steps = {f"r{i}": labels.steps[held[k]] for i, k in enumerate(picks)}
        fcfs_mean = None
        for name, policy, costs, overrides in orders:
            requests = [
                Request(
                    f"r{i}",
                    (3,) * int(labels.prompt_tokens[held[k]]),
                    int(labels.output_tokens[held[k]]),
                    BLOCK,
                    1,
                    THRESHOLD,
                    t,
                    cost=float(costs[k]),
                )
                for i, (t, k) in enumerate(zip(arrivals, picks))
            ]
            done = simulate(profile, policy, requests, steps, args.batch, **overrides)
            row = latency_row(rate, name, done, fcfs_mean)
            error = np.mean(np.abs(costs / true - 1.0))
            row["cost_error"] = "" if policy == "fcfs" else round(float(error), 3)
            fcfs_mean = fcfs_mean or row["latency_mean"]
            rows.append(row)
            log(row)
    return rows, summary


def encoder_latency(args, log) -> list[dict]:
    """ms per prompt, one prompt at a time on one thread, p50 and p99, on held-out chat
    prompts: the MiniLM DWS in PyTorch and exported to ONNX (FP32, INT8), and the hashed one."""
    from dilaserve.dws.onnx_export import export_onnx
    from dilaserve.dws.onnx_predictor import ONNXDWSPredictor

    models = chat_models()
    test = models.labels.subset(models.held[:LATENCY_PROMPTS])
    texts, tokens = test.texts, test.prompt_tokens.tolist()
    folder = args.folder / "dws-chat-minilm"
    minilm = models.dws["minilm"]
    minilm.model.encoder.memo.clear()  # time the encoder, not the memo
    minilm.save(folder)
    export_onnx(minilm, folder)
    hashed_folder = args.folder / "dws-chat-hashed"
    models.dws["hashed"].save(hashed_folder)
    export_onnx(models.dws["hashed"], hashed_folder)
    candidates = {
        "minilm, pytorch": minilm,
        "minilm, onnx fp32": ONNXDWSPredictor.load(folder, int8=False),
        "minilm, onnx int8": ONNXDWSPredictor.load(folder, int8=True),
        "hashed, pytorch": models.dws["hashed"],
        "hashed, onnx int8": ONNXDWSPredictor.load(hashed_folder, int8=True),
    }
    rows = []
    for name, predictor in candidates.items():
        times = _times_ms(predictor, texts, tokens)
        rows.append(
            {
                "predictor": name,
                "p50_ms": round(float(np.percentile(times, 50)), 2),
                "p99_ms": round(float(np.percentile(times, 99)), 2),
                "mean_ms": round(float(np.mean(times)), 2),
            }
        )
        log(rows[-1])
    return rows


def _times_ms(predictor, texts: list[str], tokens: list[int]) -> np.ndarray:
    """Each prompt's predict time alone, on one torch thread (ONNX sessions use one)."""
    from dilaserve.dws.encoders import one_thread

    predictor.predict(texts[:2], tokens[:2])  # warm up
    times = []
    with one_thread():
        for text, n in zip(texts, tokens):
            start = time.perf_counter()
            predictor.predict([text], [n])
            times.append(1e3 * (time.perf_counter() - start))
    return np.array(times)
