"""The simulator's commands of `dilaserve`: plan (capacity questions for a trace) and simulate.

Kept apart from `cli.py` (the offline commands and the entry point), which registers them.
"""

from __future__ import annotations

import argparse
import sys

from dilaserve.cli_args import config_option, spec_options


def cmd_plan(args) -> None:
    from dilaserve.control.planner import PlannerConfig
    from dilaserve.control.step_costs import StepCosts
    from dilaserve.runs import create_run_dir, write_json, write_records
    from dilaserve.sim import capacity
    from dilaserve.sim.profiles import load_profile
    from dilaserve.sim.traces import load_trace

    progress = _elapsed_lines()
    profile = load_profile(args.profile)
    trace = load_trace(args.trace)
    tokens_per_step = args.tokens_per_step or _predicted_tokens_per_step(args.predictor, progress)
    cfg = PlannerConfig(
        capacity.nodes_for(args.gpus, args.gpus_per_node),
        tokens_per_step,
        tp_degrees=args.tp,
        costs=StepCosts(args.kv_cache, args.block),
        period=args.window,
    )
    classes = capacity.workload_classes(trace, args.slo, args.block, args.window, args.safety)
    progress(f"workload: {len(classes)} classes in the busiest {args.window:g} s of the trace")
    ans = capacity.answer(classes, profile, cfg, args.gpus_per_node, progress)
    source = f"busiest {args.window:g} s of {trace.source}"
    text = capacity.report(ans, cfg, args.slo, source)
    folder = create_run_dir(args.out, "plan")
    write_json(folder / "config.json", {**vars(args), "func": None})
    write_records(folder / "records.csv", capacity.class_rows(ans))
    summary = {
        "instances": ans.plan.counts(),
        "feasible": ans.plan.feasible,
        "mean_threshold": ans.plan.mean_threshold,
        "capacity_multiple": ans.multiple,
        "smallest_gpus": ans.smallest_gpus,
    }
    write_json(folder / "summary.json", summary)
    (folder / "report.md").write_text(text)
    print(text + f"run folder: {folder}")


def _elapsed_lines():
    """A progress function printing each line to stderr with the seconds since it was made."""
    import time

    start = time.monotonic()

    def progress(text: str) -> None:
        print(f"[{time.monotonic() - start:5.1f} s] {text}", file=sys.stderr, flush=True)

    return progress


def _predicted_tokens_per_step(predictor: str, progress) -> dict[float, float]:
    """Tokens per step at each threshold from a step predictor's report, named on the log."""
    from pathlib import Path

    from dilaserve.config import BUNDLED_PREDICTOR
    from dilaserve.sim import capacity

    rates = capacity.tokens_per_step_from_predictor(predictor)
    whose = ""
    if Path(predictor).resolve() == Path(BUNDLED_PREDICTOR).resolve():
        whose = " (the bundled tiny model's: --predictor or --tokens-per-step for yours)"
    shown = ", ".join(f"{c:g}:{t:.2f}" for c, t in sorted(rates.items()))
    progress(f"tokens per step {shown} from step predictor {predictor}{whose}")
    return rates


def _tokens_per_step(text: str) -> dict[float, float]:
    try:
        pairs = (item.split(":") for item in text.replace(" ", "").split(","))
        return {float(c): float(t) for c, t in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--tokens-per-step: expected THRESHOLD:TOKENS,... (e.g. 0.5:4,0.9:2), got {text!r}"
        ) from None


def _add_plan_command(sub) -> None:
    from dilaserve.config import BUNDLED_PREDICTOR, DEFAULT_BLOCK_LEN

    pl = sub.add_parser("plan", help="which cluster configuration serves a trace at an SLO")
    pl.add_argument(
        "--profile", required=True, help="latency profile JSON or preset (e.g. llada-8b-h100)"
    )
    pl.add_argument("--trace", required=True, help="trace CSV (see dilaserve/sim/traces.py)")
    pl.add_argument("--gpus", type=int, required=True)
    pl.add_argument("--gpus-per-node", type=int, default=8)
    pl.add_argument("--slo", type=float, required=True, help="seconds per request")
    pl.add_argument(
        "--tp", type=lambda t: tuple(int(x) for x in t.split(",")), default=(1, 2, 4, 8)
    )
    pl.add_argument(
        "--kv-cache",
        choices=["none", "dual", "block"],
        default="dual",
        help="block: a block-diffusion model's exact cache (an llada2-* profile)",
    )
    pl.add_argument("--block", type=int, default=DEFAULT_BLOCK_LEN)
    pl.add_argument("--window", type=float, default=300.0, help="seconds of the busiest window")
    pl.add_argument("--safety", type=float, default=1.1, help="rate buffer above the observed")
    pl.add_argument(
        "--tokens-per-step",
        type=_tokens_per_step,
        default=None,
        help="mean tokens committed per step at each threshold, e.g. 0.5:4,0.9:2; "
        "default: from --predictor",
    )
    pl.add_argument("--predictor", default=str(BUNDLED_PREDICTOR), help="step predictor folder")
    pl.add_argument("--out", default="runs", help="folder for run folders")
    pl.set_defaults(func=cmd_plan)


def cmd_simulate(args) -> None:
    from dataclasses import asdict, fields

    from dilaserve.runs import create_run_dir, write_json
    from dilaserve.sim.run import SimulationSpec, simulate, write_run

    names = {f.name for f in fields(SimulationSpec)}
    spec = SimulationSpec(**{k: v for k, v in vars(args).items() if k in names})
    folder = create_run_dir(args.out, "simulate")  # at once, so that a long run can be watched
    write_json(folder / "config.json", asdict(spec))
    run = simulate(spec, progress=_progress(folder, show=not args.quiet))
    write_run(run, args.out, folder=folder)
    (folder / "progress.json").unlink(missing_ok=True)  # summary.json now says it all
    print(file=sys.stderr)
    for key, value in {**run.summary, **run.timing}.items():
        print(f"{key}: {value}")
    print(f"run folder: {folder}")


def _progress(folder, show: bool, every: float = 30.0):
    """Every `every` simulated seconds: the run folder's progress.json (simulated time,
    requests done, wall time, and the wall time left at the pace so far; removed when the run
    is written), and a stderr line."""
    import json
    import time

    start, last = time.monotonic(), [-every]

    def update(now: float, done: int, total: int) -> None:
        if now - last[0] < every:
            return
        last[0] = now
        wall = time.monotonic() - start
        left = wall / done * (total - done) if done else None
        state = {"simulated_s": round(now, 1), "requests_done": done, "requests": total}
        state |= {"wall_s": round(wall, 1), "wall_s_left": left and round(left, 1)}
        (folder / "progress.json").write_text(json.dumps(state) + "\n")
        if show:
            line = f"\rsimulated {now:8.0f} s  {done}/{total} requests done"
            print(line, end="", file=sys.stderr, flush=True)

    return update


def _add_simulate_command(sub) -> None:
    """Every field of `SimulationSpec` is an option (its help declared beside the field)."""
    from dilaserve.sim.spec import SimulationSpec

    si = sub.add_parser("simulate", help="trace-driven cluster simulation (same control plane)")
    config_option(si)
    spec_options(si, SimulationSpec)
    si.add_argument("--out", default="runs", help="folder for run folders")
    si.add_argument("--quiet", action="store_true", help="no progress line")
    si.set_defaults(func=cmd_simulate)


def add_simulation_commands(sub) -> None:
    _add_plan_command(sub)
    _add_simulate_command(sub)
