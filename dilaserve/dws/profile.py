"""`dilaserve profile --dws`: probe this machine's engine and fit its DWS cost kernel.

The kernel (`dws.cost.CostKernel`) belongs to a deployment (model, hardware, threads); the DWS
predictor does not, so a new machine runs this command and keeps its predictor. `run_probes`
times batch-1 runs on the engine, step by step, as `cost.ProbeRun`s; `profile_dws` probes,
fits the kernel to them (`cost.fit_cost_kernel`) and writes it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from dilaserve.config import DEFAULT_THRESHOLD
from dilaserve.dws.cost import MIN_PROBES, CostKernel, ProbeRun, fit_cost_kernel
from dilaserve.dws.surface import window_blocks
from dilaserve.protocol import StepBatch, StepKind, block_offset


@dataclass(frozen=True)
class DWSProfileConfig:
    """`dilaserve profile --dws`: probe the engine on held-out bundled-task problems, fit a kernel.

    Half the probes are natural (at the serving threshold), half canvas (the whole window) at
    thresholds spread from 0.5 to 1.0, interleaved so that both kinds land in the training and
    the held-out probes. A step costs the same whatever its threshold, but at one threshold
    the probes' step counts per block vary too little to tell cells apart (block 0 at 0.9 never
    ends in one step, so only W[0,0] + W[0,1] is identified); at 1.0 every cell runs.
    """

    model: str
    num_probes: int = 48
    gen_len: int = 64
    threshold: float = DEFAULT_THRESHOLD
    dtype: str = "float32"
    device: str = "cpu"
    cuda_graphs: int = 0  # EngineConfig.cuda_graphs
    seed: int = 0
    out: str = "runs"
    kernel_out: str = "dws-cost.json"
    canvas_thresholds: tuple[float, ...] = (0.5, 0.7, 0.9, 1.0)

    def __post_init__(self):
        if self.num_probes < MIN_PROBES:
            raise ValueError(f"num_probes={self.num_probes} must be at least {MIN_PROBES}")


def run_probes(
    engine_or_llm,
    prompts: list[list[int]],
    gen_len: int,
    natural: bool = True,
    threshold: float = DEFAULT_THRESHOLD,
) -> list[ProbeRun]:
    """Run each prompt (token ids) alone through the engine, timing every step.

    Batch 1, so a step's time is the request's own (papers.md 2.7: probes run one at a time).
    Each `engine.execute` is timed with `time.perf_counter`, so the figure includes the engine's
    per-step post-processing. The first prompt runs once, untimed, to warm up. Natural
    probes end where the engine ends them (EOS); canvas probes (natural=False) decode the whole
    window, through an engine copy with early_finish off, so the fit sees late blocks too.
    """
    engine = getattr(engine_or_llm, "engine", engine_or_llm)
    if not prompts:
        raise ValueError("run_probes needs at least one prompt")
    if not natural and engine.config.early_finish:
        engine = type(engine)(
            engine.model, engine.special, replace(engine.config, early_finish=False)
        )
    _decode(engine, prompts[0], gen_len, threshold, "dws-warmup")
    return [
        _probe(
            len(prompt),
            engine.config.block_len,
            natural,
            _decode(engine, prompt, gen_len, threshold, f"dws-probe-{i}"),
        )
        for i, prompt in enumerate(prompts)
    ]


def _probe(prompt_tokens: int, block_len: int, natural: bool, steps) -> ProbeRun:
    """A probe from its steps ((block, step in block, ms, kind) each). An exact cache's prefill
    and commit steps fuse a separate phase with a block's denoising step: what they take beyond
    the probe's median block step is its prefill (resp. refresh) time, and the cell is charged
    that median."""
    block_ms = [ms for _, _, ms, kind in steps if kind is StepKind.BLOCK]
    cell = float(np.median(block_ms)) if block_ms else 0.0
    extra = {StepKind.PREFILL: 0.0, StepKind.COMMIT: 0.0}
    step_ms = []
    for b, s, ms, kind in steps:
        if kind in extra and block_ms:
            extra[kind] += max(ms - cell, 0.0)
            ms = min(ms, cell)
        step_ms.append((b, s, ms))
    return ProbeRun(
        prompt_tokens,
        block_len,
        step_ms,
        prefill_ms=extra[StepKind.PREFILL],
        refresh_ms=extra[StepKind.COMMIT],
        natural=natural,
    )


def _decode(engine, prompt: list[int], gen_len: int, threshold: float, request_id: str):
    """Decode one request to the end; (block, step in block, ms, kind) of each step."""
    from dilaserve.request import Request

    offset = block_offset(len(prompt), engine.config.block_len, engine.family.is_block_causal)
    request = Request(
        request_id,
        tuple(prompt),
        gen_len,
        engine.config.block_len,
        engine.special.mask,
        threshold,
        block_offset=offset,
    )
    steps, block, step = [], -1, 0
    on_engine = False
    while not request.is_finished:
        batch = StepBatch((request.step_item(engine.config.kv_cache, on_engine),))
        start = time.perf_counter()
        result = engine.execute(batch).results[0]
        ms = 1e3 * (time.perf_counter() - start)
        on_engine = True
        request.apply(result)
        step = step + 1 if result.block_index == block else 0
        block = result.block_index
        steps.append((block, step, ms, result.kind))
    engine.release(request_id)
    return steps


def _interleave(natural: list[ProbeRun], canvas: list[ProbeRun]) -> list[ProbeRun]:
    out = []
    for i in range(max(len(natural), len(canvas))):
        out += natural[i : i + 1] + canvas[i : i + 1]
    return out


def _record(i: int, probe: ProbeRun, kernel: CostKernel) -> dict:
    predicted = kernel.cost_of_run(probe)
    return {
        "probe": i,
        "kind": "natural" if probe.natural else "canvas",
        "split": "val" if i % 5 == 4 else "train",
        "prompt_tokens": probe.prompt_tokens,
        "prompt_blocks": probe.prompt_blocks,
        "output_blocks": probe.output_blocks,
        "block_steps": ";".join(map(str, probe.block_steps)),
        "steps": probe.total_steps,
        "measured_ms": round(probe.total_ms, 3),
        "predicted_ms": round(predicted, 3),
        "error_pct": round(100 * (predicted - probe.total_ms) / probe.total_ms, 2),
    }


def profile_dws(cfg: DWSProfileConfig, log=print) -> CostKernel:
    """Probe, fit, and write the kernel to `cfg.kernel_out` and a run folder."""
    import platform

    import torch

    from dilaserve.config import EngineConfig
    from dilaserve.engine.llm import LLM
    from dilaserve.runs import create_run_dir, environment, write_json, write_records
    from dilaserve.tasks import arith

    engine = EngineConfig("dual", dtype=cfg.dtype, device=cfg.device, cuda_graphs=cfg.cuda_graphs)
    llm = LLM(cfg.model, engine)
    problems = arith.generate(cfg.num_probes, seed=cfg.seed, split="test")
    prompts = [llm.encode_prompt(p.question, chat=True) for p in problems]
    half = (len(prompts) + 1) // 2
    log(f"running {half} natural and {len(prompts) - half} canvas probes at batch 1")
    canvas = prompts[half:]
    spread = len(cfg.canvas_thresholds)
    canvas_runs = [
        run_probes(llm, canvas[k::spread], cfg.gen_len, False, threshold)
        for k, threshold in enumerate(cfg.canvas_thresholds)
        if canvas[k::spread]
    ]
    probes = _interleave(
        run_probes(llm, prompts[:half], cfg.gen_len, True, cfg.threshold),
        [p for runs in canvas_runs for p in runs],
    )
    meta = {
        "model": str(cfg.model),
        "threshold": cfg.threshold,
        "gen_len": cfg.gen_len,
        "dtype": cfg.dtype,
        "kv_cache": llm.engine.config.kv_cache.value,
        "hardware": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    block_len = llm.config.block_len
    # blocks at absolute positions (block diffusion) spread a window over one more block
    blocks = window_blocks(cfg.gen_len, block_len, llm.engine.family.is_block_causal)
    kernel = fit_cost_kernel(probes, blocks, block_len, meta=meta)
    kernel.save(cfg.kernel_out)
    run = create_run_dir(cfg.out, "profile-dws")
    write_json(run / "config.json", {**asdict(cfg), "environment": environment()})
    records = [_record(i, p, kernel) for i, p in enumerate(probes)]
    write_records(run / "records.csv", records)
    errors = np.abs([r["error_pct"] for r in records])
    summary = {"kernel": kernel.to_dict(), "mean_abs_error_pct": round(float(errors.mean()), 2)}
    write_json(run / "summary.json", summary)
    _report(kernel, log)
    log(f"mean |error| of the kernel's cost of each probe's grid: {errors.mean():.1f}%")
    log(f"kernel written to {cfg.kernel_out}; run folder: {run}")
    return kernel


def _report(kernel: CostKernel, log) -> None:
    for b in range(min(2, kernel.max_blocks)):
        log(f"W[{b}] (ms): " + " ".join(f"{x:.2f}" for x in kernel.W[b]))
    log(
        f"delta={kernel.delta:.4f} ms/cell/prompt-block (m_bar={kernel.m_bar:.2f}) "
        f"alpha={kernel.alpha:.3f} beta={kernel.beta:.3f} "
        f"lambda_s={kernel.lambda_s:g} lambda_b={kernel.lambda_b:g} "
        f"val_mse={kernel.val_mse:.3f} train_mse={kernel.train_mse:.3f} ms^2 "
        f"({kernel.num_probes} probes)"
    )
