"""The data plane against the hardware's limits: LLaDA-8B and LLaDA2.0-mini shapes on one GPU.

    bash benchmarks/gpu_dataplane.sh                       # the prepared run (one H200, < 8 min)
    python benchmarks/gpu_dataplane.py [--deadline 420] [--fastdllm-code DIR] [--llada2-code DIR]
    python benchmarks/gpu_dataplane.py --smoke             # the same path on the CPU, tiny shapes

For each model, built in memory with random bf16 weights (no checkpoint, no download):
1. step time by kind (LLaDA: dual-cache `cache` and `recompute`; LLaDA2: `block`, `commit`,
   `prefill`) at 1, 8, 32 and 128 requests, each request 768 cached tokens (`REF_CONTEXT`) and
   one 32-token block (a commit: two), whole-sequence steps over 800 tokens a request; eager, and
   for the cached kinds also replayed as a CUDA graph (what `--cuda-graphs` runs). Beside each:
   - the weight-read limit: the bytes of weights the step reads (all but the input embedding; of
     a MoE's routed experts only those its tokens chose, counted by hooks on the routers) over
     the copy bandwidth measured at start;
   - the matrix-rate limit: its FLOPs (2 x the parameters a token multiplies x tokens, plus
     attention) over the data sheet's dense bf16 peak (the measured matmul rate on a GPU
     without one), and the share of that rate the step reached (`gpu_dataplane_limits.py`);
2. tokens/s through `Engine.execute` (threshold 0.9, dual cache, CUDA graphs for as many
   requests as the batch; batch 1, also without graphs, then 8 and 32 as time allows): random
   weights commit one token a step (top-1 fallback); `steady_tokens_per_s` composes the median
   step times (no graph captures, no outliers); batch 1 runs before the published decoders;
3. when the published code is given, the same single request through Fast-dLLM's LLaDA
   generator and LLaDA2's published `generate` (`gpu_dataplane_published.py`); skipped with a
   note otherwise.

The run budgets its own time: each model gets an equal share of what is left of `--deadline`
seconds, and a setting that would not fit is skipped and named in the summary's `skipped`.
Writes a run folder under `--out`: config.json, summary.json (rewritten after every model, so a
killed run keeps what it measured), report.md, and `<model>-<gpu>-profile.json`, each model's
measured steps as a latency profile (`dilaserve.sim.profiles.load_profile` reads it; shipped as
dilaserve/assets/llada-8b-h200-profile.json and llada2-mini-h200-profile.json, it is what the
`llada-8b-h200` and `llada2-mini-h200` names load).
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_dataplane_limits as limits  # noqa: E402
import gpu_dataplane_published as published  # noqa: E402
import gpu_profile as gp  # noqa: E402

from dilaserve.control.profile import SCHEMA, LatencyProfile  # noqa: E402
from dilaserve.models.config import LLaDAConfig  # noqa: E402
from dilaserve.models.llada import LLaDAModelLM  # noqa: E402
from dilaserve.models.llada2 import LLaDA2Config, LLaDA2MoeModelLM  # noqa: E402
from dilaserve.models.tokenizer import SpecialIds  # noqa: E402
from dilaserve.runs import create_run_dir, environment, markdown_table, write_json  # noqa: E402
from dilaserve.sim.latency import REF_CONTEXT  # noqa: E402

BLOCK = gp.BLOCK
THRESHOLD = 0.9
# LLaDA2.0-mini's published config (sim/hardware.py's LLADA2_MINI; special ids of its tokenizer)
LLADA2_MINI = dict(
    hidden_size=2048, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4,
    head_dim=128, intermediate_size=5120, moe_intermediate_size=512, num_experts=256,
    num_experts_per_tok=8, n_group=8, topk_group=4, num_shared_experts=1,
    first_k_dense_replace=1, routed_scaling_factor=2.5, rope_theta=600000.0,
    partial_rotary_factor=0.5, rms_norm_eps=1e-6, vocab_size=157184, use_bias=False,
    max_position_embeddings=16384, mask_token_id=156895, eos_token_id=156892,
)  # fmt: skip
TINY_LLADA2 = dict(
    LLADA2_MINI, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
    num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, vocab_size=512,
    mask_token_id=511, eos_token_id=510,
)  # fmt: skip
# per model: family, config (full, smoke), the step kinds: (kind, queried tokens a request,
# or None for a whole-sequence step)
MODELS = {
    "llada-8b": ("llada", gp.LLADA_8B, gp.SHAPES["tiny"], (("cache", BLOCK), ("recompute", None))),
    "llada2-mini": (
        "llada2",
        LLADA2_MINI,
        TINY_LLADA2,
        (("block", BLOCK), ("commit", 2 * BLOCK), ("prefill", None)),
    ),
}
REQUESTS, SMOKE_REQUESTS = (1, 8, 32, 128), (1, 2)
ENGINE_BATCHES = (1, 8, 32)
COLUMNS = [
    "model", "kind", "num_requests", "batch_tokens", "eager_ms", "graph_ms",
    "weight_limit_ms", "over_weight_limit", "matrix_limit_ms", "pct_matrix_rate",
]  # fmt: skip


class Budget:
    """Seconds left until `end`; what was skipped for want of them."""

    def __init__(self, seconds: float, skipped: list[str] | None = None):
        self.end = time.monotonic() + seconds
        self.skipped = [] if skipped is None else skipped

    def left(self) -> float:
        return self.end - time.monotonic()

    def share(self, parts: int) -> Budget:
        """A sub-budget of 1/parts of what is left, recording skips in the same list."""
        return Budget(self.left() / parts, self.skipped)

    def allows(self, what: str, needs: float) -> bool:
        if self.left() >= needs:
            return True
        self.skipped.append(f"{what}: needs ~{needs:.0f} s, {max(self.left(), 0):.0f} s left")
        print(f"skipped {self.skipped[-1]}", flush=True)
        return False


def build(name: str, smoke: bool, device: torch.device, dtype: torch.dtype):
    family, full, tiny, _ = MODELS[name]
    raw = tiny if smoke else full
    if family == "llada":
        cfg, cls = LLaDAConfig(**raw), LLaDAModelLM
    else:
        cfg, cls = LLaDA2Config(**raw), LLaDA2MoeModelLM
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 on the GPU: no float32 copy of 16B weights
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.init_weights(0)
    getattr(model, "reset_buffers", lambda: model.model.rotary.reset())()
    special = SpecialIds(mask=raw["mask_token_id"], eos=raw["eos_token_id"], eot=None)
    return model.eval(), special


def make_step(model, kind: str, query: int | None, rows: int, device, kwargs: dict):
    """The step's closure, its batch tokens, the keys each query attends to (block-causal: half
    the sequence on average) and the tokens given logits (a whole-sequence step: its last
    block, as the engine's)."""
    if query is None:
        seq = REF_CONTEXT + BLOCK
        fn = gp.recompute_step(model, rows, seq, device, BLOCK, **kwargs)
        return fn, rows * seq, (seq // 2 if kind == "prefill" else seq), rows * BLOCK
    fn = gp.cache_step(model, rows, REF_CONTEXT, device, query, **kwargs)
    return fn, rows * query, REF_CONTEXT + query, rows * query


def timed_ms(fn, device, repeats: int) -> float:
    """Median ms; fewer repeats for a long step (at least 2)."""
    t0 = time.perf_counter()
    fn()
    gp.sync(device)
    first = time.perf_counter() - t0
    return gp.timed(fn, device, max(2, min(repeats, int(2.0 / max(first, 1e-3)))))


def measure(model, info: dict, rates: dict, kind, query, rows, device, repeats) -> dict:
    kwargs = {"block_len": BLOCK} if isinstance(model, LLaDA2MoeModelLM) else {}
    fn, tokens, keys, logits = make_step(model, kind, query, rows, device, kwargs)
    row = {"kind": kind, "num_requests": rows, "batch_tokens": tokens, "context_len": REF_CONTEXT}
    row["eager_ms"] = timed_ms(fn, device, repeats)
    row["graph_ms"] = None
    if query is not None and device.type == "cuda":
        try:
            row["graph_ms"] = gp.graph_ms(fn, device, repeats)
        except RuntimeError as err:  # a capture failure is a finding, not a crash
            row["graph_error"] = str(err).splitlines()[0]
    row["experts_touched"] = limits.touched_experts(model, fn)
    row["ms"] = row["graph_ms"] or row["eager_ms"]
    row.update(limits.limits(row, info, rates, tokens, keys, logits))
    return row


def step_grid(name, model, rates, device, budget: Budget, args) -> list[dict]:
    info = limits.accounting(model)
    rows_list = SMOKE_REQUESTS if args.smoke else REQUESTS
    out = []
    for rows in rows_list:  # small first: a short budget drops the largest settings
        for kind, query in MODELS[name][3]:
            what = f"{name} {kind} step, {rows} requests"
            if not budget.allows(what, 5 + rows / 4):
                continue
            try:
                with torch.inference_mode():
                    row = measure(model, info, rates, kind, query, rows, device, args.repeats)
                out.append({"model": name, **row})
                print({k: out[-1][k] for k in COLUMNS}, flush=True)
            except RuntimeError as err:  # out of memory, a kernel refusing a shape: noted
                failed(budget, what, err)
            free(device)
    return out


def failed(budget: Budget, what: str, err: Exception) -> None:
    budget.skipped.append(f"{what}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    print(f"failed {budget.skipped[-1]}", flush=True)


def engine_runs(name, model, special, device, budget: Budget, args, batches) -> list[dict]:
    """Tokens/s through `Engine.execute`, CUDA graphs on for as many requests as the batch
    (batch 1 also without): the first batch-1 run on an engine captures its graphs, the second
    is timed."""
    out = []
    graphed = device.type == "cuda"
    plan = [(b, b * graphed) for b in batches] + ([(1, 0)] if 1 in batches else [])
    for batch, cuda_graphs in dict.fromkeys(plan):
        what = f"{name} Engine.execute, batch {batch}, cuda_graphs {cuda_graphs}"
        if not budget.allows(what, 15 + batch):
            continue
        try:
            record = engine_record(model, special, device, batch, cuda_graphs, args)
            out.append({"model": name, **record})
            print({"engine": out[-1]}, flush=True)
        except RuntimeError as err:
            failed(budget, what, err)
        free(device)
    return out


def engine_record(model, special, device, batch: int, cuda_graphs: int, args) -> dict:
    engine = gp.make_engine(model, special, device, cuda_graphs)
    if batch == 1:
        gp.engine_run(engine, device, 1, args.prompt_len, args.gen)
    record, _ = gp.engine_run(engine, device, batch, args.prompt_len, args.gen)
    steady = sum(record["median_ms"][k] * n for k, n in record["steps"].items())
    record["steady_tokens_per_s"] = round(record["tokens"] / (steady / 1e3), 1)
    return record


def reference_run(name, model, special, device, budget: Budget, args) -> dict:
    """The published decoder on the single request, or why not."""
    family = MODELS[name][0]
    code = args.fastdllm_code if family == "llada" else args.llada2_code
    if not code:
        flag = "--fastdllm-code" if family == "llada" else "--llada2-code"
        return {"skipped": f"no published code given ({flag})"}
    # LLaDA2's published MoE loops over the experts after a host sync, with no cache: ~300
    # forwards of the whole sequence, the slowest part of the run (an estimate, not measured)
    if not budget.allows(f"{name} published decoder", 60 if family == "llada" else 150):
        return {"skipped": "out of time"}
    run = published.fastdllm if family == "llada" else published.llada2
    prompt = list(gp.random_prompt(args.prompt_len, special.mask, 0))
    try:
        return run(code, model, prompt, args.gen, BLOCK, THRESHOLD)
    except Exception as err:  # published code on this machine may not import or run
        return {"skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    finally:
        free(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def profile(name: str, steps: list[dict], rates: dict, dtype: torch.dtype) -> dict:
    """The measured steps as a latency profile (TP-1): a cached kind's graph replay where it
    was captured (what the engine runs with CUDA graphs), else its eager time."""
    block_causal = MODELS[name][0] == "llada2"
    entries = [
        {"tp": 1, **{k: r[k] for k in ("kind", "batch_tokens", "num_requests", "context_len")}}
        | {"ms": r["ms"]}
        for r in steps
    ]
    raw = {
        "schema": SCHEMA,
        "model": name,
        "dtype": str(dtype).removeprefix("torch."),
        "block_len": BLOCK,
        "hardware": rates["device"],
        "source": "benchmarks/gpu_dataplane.py, random weights; cached steps as CUDA graphs",
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
        **({"block_causal": True} if block_causal else {}),
        "ref_context": REF_CONTEXT,
        "entries": entries,
    }
    LatencyProfile.from_dict(raw)  # what the simulator will load: it must
    return raw


def gpu_tag(rates: dict) -> str:
    return re.sub(r"[^a-z0-9]+", "-", (rates["datasheet"] or rates["device"]).split()[0].lower())


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, fp32")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--models", default="llada-8b,llada2-mini")
    ap.add_argument(
        "--deadline", type=float, default=420.0, help="seconds for the whole run (inf: no bound)"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--fastdllm-code", help="Fast-dLLM's llada folder (generate.py, model/)")
    ap.add_argument("--llada2-code", help="folder of modeling_llada2_moe.py (LLaDA2 remote code)")
    ap.add_argument("--out", default="runs")
    args = ap.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    if args.smoke:
        args.prompt_len, args.gen = min(args.prompt_len, 40), min(args.gen, 2 * BLOCK)
    return args


def main(argv=None) -> Path:
    args = parse(argv)
    started, budget = time.monotonic(), Budget(args.deadline)
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    dtype = torch.float32 if args.smoke else torch.bfloat16
    run = create_run_dir(args.out, "gpu_dataplane")
    write_json(run / "config.json", {**vars(args), "environment": environment()})
    rates = limits.probe_rates(device, dtype, args.smoke)
    print({"rates": rates}, flush=True)
    summary = {"rates": rates, "steps": [], "engine": [], "published": {}, "profiles": {}}

    def save() -> None:  # after every part: a run stopped by `timeout` keeps what it measured
        summary["targets"] = limits.targets(summary["steps"], summary["engine"], refs)
        summary["skipped"] = budget.skipped
        summary["wall_s"] = round(time.monotonic() - started, 1)
        write_json(run / "summary.json", summary)

    refs, engine = summary["published"], summary["engine"]
    names = args.models.split(",")
    for i, name in enumerate(names):
        part = budget.share(len(names) - i)
        t0 = time.perf_counter()
        model, special = build(name, args.smoke, device, dtype)
        print(f"{name} built in {time.perf_counter() - t0:.1f} s", flush=True)
        mine = step_grid(name, model, rates, device, part, args)
        summary["steps"] += mine
        if mine:
            file = run / f"{name}-{gpu_tag(rates)}-profile.json"
            write_json(file, profile(name, mine, rates, dtype))
            summary["profiles"][name] = file.name
        save()
        engine += engine_runs(name, model, special, device, part, args, ENGINE_BATCHES[:1])
        refs[name] = reference_run(name, model, special, device, part, args)
        print({"published": refs[name]}, flush=True)
        save()
        more = ENGINE_BATCHES[1:2] if args.smoke else ENGINE_BATCHES[1:]
        engine += engine_runs(name, model, special, device, part, args, more)
        save()
        del model
        free(device)
    report(run, summary)
    return run


def report(run: Path, summary: dict) -> None:
    table = markdown_table(summary["steps"], COLUMNS)
    engine_table = markdown_table(
        summary["engine"], ["model", "batch", "cuda_graphs", "tokens_per_s", "steady_tokens_per_s"]
    )
    refs, targets, skipped = summary["published"], summary["targets"], summary["skipped"]
    (run / "report.md").write_text(
        f"# GPU data plane ({summary['rates']['device']})\n\n{table}\n\n{engine_table}\n\n"
        f"published: {refs}\n\ntargets: {targets}\n\nskipped: {skipped}\n"
    )
    print(table, engine_table, {"published": refs}, {"targets": targets}, sep="\n\n")
    print(f"skipped: {skipped or 'nothing'}\nrun folder: {run}", flush=True)


if __name__ == "__main__":
    main()
