"""Both bundled models served side by side: what an exact (block-diffusion) cache changes.

    python benchmarks/block_diffusion.py [--models PATH,PATH] [--rates 4,8,12] [--seconds 30]
        [--slo 1.0] [--instances 2] [--seed 0]

The bundled LLaDA (approximate dual cache: a recompute step over the whole sequence starts every
block) and the bundled LLaDA2 MoE (exact block cache: one prefill, then block steps, and a
commit step of two blocks starting each block) serve the same arrivals of the same held-out
problems (`run-trace`'s load: Poisson, every request with the same SLO), each on its own
cluster built from its own bundled calibration, under the `dilaserve` policy. Per model and
rate: SLO attainment, accuracy, steps and whole-sequence steps per request, the engine's step
time, migrations; per model, its profile's step latencies at one request, and what a migration
costs: nothing extra with an approximate cache (a request moves only before a recompute step,
which it runs anyway), a prefill instead of a block step with an exact one. Writes a run folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dilaserve.cli_serving import run_trace_config
from dilaserve.config import BUNDLED_LLADA2_MODEL, BUNDLED_MODEL
from dilaserve.runs import create_run_dir, environment, markdown_table, write_json, write_records

RUN_COLUMNS = (
    "model",
    "cache",
    "rps",
    "requests",
    "slo_attainment",
    "accuracy",
    "steps_per_request",
    "sequence_steps_per_request",
    "step_engine_ms_mean",
    "latency_p50",
    "migrations",
)


def step_prices(config, profile_path: str, seq_tokens: float) -> dict:
    """The profile's step latencies (ms, one request, TP-1) and a migration's extra cost."""
    from dilaserve.control.profile import LatencyProfile

    profile = LatencyProfile.from_file(profile_path)
    costs = config.control.scheduler.costs
    tokens = int(round(seq_tokens))

    def ms(kind) -> float:
        return round(1e3 * profile.step_latency(1, costs.tokens(kind, tokens), kind), 3)

    sequence, boundary, inner = (
        ms(costs.sequence_kind),
        ms(costs.boundary_kind),
        ms(costs.inner_kind),
    )
    return {
        "cache": costs.mode.value,
        "sequence_step": f"{costs.sequence_kind.value} {sequence} ms",
        "boundary_step": f"{costs.boundary_kind.value} {boundary} ms",
        "inner_step": f"{costs.inner_kind.value} {inner} ms",
        # an approximate cache moves only before a recompute step, which runs anyway
        "migration_extra_ms": round(sequence - inner, 3) if costs.exact else 0.0,
    }


def run_model(model: Path, args) -> tuple[list[dict], list[dict], dict]:
    from dilaserve.cluster.trace_run import TraceRunSpec, run_trace

    config, inputs = run_trace_config(
        model=str(model), instances=args.instances, slo=args.slo, max_tokens=args.max_tokens
    )
    rows, records = [], []
    for rate in args.rates:
        spec = TraceRunSpec(f"poisson:{rate}:{args.seconds}", slo=args.slo, seed=args.seed)
        run = run_trace(config, spec)
        s, done = run["summary"], run["rows"]
        records += [{"model": model.name, "rps": rate, **row} for row in done]
        rows.append(
            {
                "model": model.name,
                "cache": config.control.scheduler.kv_cache.value,
                "rps": rate,
                "requests": s["requests"],
                "slo_attainment": s["slo_attainment_of_arrivals"],
                "accuracy": s["accuracy"],
                "steps_per_request": round(float(np.mean([r["steps"] for r in done])), 2),
                "sequence_steps_per_request": round(
                    float(np.mean([r["sequence_steps"] for r in done])), 2
                ),
                "step_engine_ms_mean": s["step_engine_ms_mean"],
                "latency_p50": s["latency_p50"],
                "migrations": s["migrations"],
            }
        )
        print(rows[-1], flush=True)
    seq_tokens = float(np.mean([r["prompt_tokens"] + r["output_tokens"] for r in records]))
    prices = {"model": model.name, **step_prices(config, inputs.profile, seq_tokens)}
    return rows, records, prices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=f"{BUNDLED_MODEL},{BUNDLED_LLADA2_MODEL}")
    parser.add_argument(
        "--rates", default="4,8,12", type=lambda t: [float(r) for r in t.split(",")]
    )
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--slo", type=float, default=1.0)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64, help="every request's window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs")
    args = parser.parse_args()
    folder = create_run_dir(args.out, "block-diffusion")
    write_json(folder / "config.json", {**vars(args), "environment": environment()})
    rows, records, prices = [], [], []
    for model in (Path(m) for m in args.models.split(",")):
        model_rows, model_records, model_prices = run_model(model, args)
        rows, records, prices = rows + model_rows, records + model_records, prices + [model_prices]
    write_records(folder / "records.csv", records)
    write_json(folder / "summary.json", {"runs": rows, "step_prices": prices})
    report = (
        f"# Both bundled models, equal load\n\n{markdown_table(rows, list(RUN_COLUMNS))}\n\n"
        f"## Step prices (TP-1, one request)\n\n{markdown_table(prices, list(prices[0]))}\n"
    )
    (folder / "report.md").write_text(report)
    print(report)
    print(f"run folder: {folder}")


if __name__ == "__main__":
    main()
