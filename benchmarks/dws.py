"""DWS evaluation: cost-prediction error against scalar proxies, and DWS-SJF against FCFS.

    python benchmarks/dws.py [--prompts 300] [--rates 20,40,60,80] [--chat-rates 1.0,1.5]
                             [--skip chat-cost,chat,latency,minilm,cost,sim,prior] [--live]
                             [--model FOLDER --labels NPZ --dws FOLDER --dws-cost JSON]

`--model` is the model the minilm, cost and sim parts judge on the bundled arithmetic task:
the bundled LLaDA (`tiny-llada`) by default, with its bundled DWS, kernel and labels; another
(e.g. the bundled block-diffusion `tiny-llada2`) names its own train-dws labels, DWS predictor
and `profile --dws` kernel, and its latency profile is read from its calibration folder
(`--profile` to choose another). The engine runs it in the cache mode its family resolves
(`block`, the exact cache, for LLaDA2), and the simulator replays its steps in that mode. The
chat parts model LLaDA-8B whatever `--model` is; prior and live serve the bundled model only.

0. On real prompts (`dws_chat.py`, needs the `dws` extra): ShareGPT first turns with their real
   answer lengths, DWS and the proxies with the packaged all-MiniLM-L6-v2 and with the hashed
   encoder: cost error with ceilings (`chat-cost`), SJF in the simulator (`chat`), and each
   predictor's latency per prompt (`latency`). `minilm` trains a MiniLM DWS on `--labels`,
   judged beside the `--dws` one by the cost and sim parts and used by the prior and live parts.

1. Cost prediction on held-out prompts of the bundled task. Each prompt runs alone (batch 1) on
   the engine at threshold 0.9; its measured ms is the truth. DWS predicts the cost from the
   prompt alone: the predictor's surface times the cost kernel, as is and with the kernel
   rescaled by one factor fitted on the calibration probes (this machine's speed today: the
   kernel's shape is kept, its scale follows the machine, as the proxies' linear fits do). The
   scalar proxies the paper compares against are trained on the same labels with the same
   encoder as each DWS predictor: predicted output length and predicted total steps, each mapped
   to ms by a linear fit on probes of training prompts; and a constant, the calibration
   probes' median ms, which knows nothing of the prompt. Two floors no prompt-only predictor can
   beat are reported beside them: the kernel applied to each run's true steps (a perfect
   surface; rescaled on the calibration probes' true steps), and a second timing of the same
   held-out runs (the measurement's own noise). Reported: mean relative error and MAE of each.
2. DWS-SJF against FCFS in the simulator: other held-out prompts' true steps per block, measured
   on the engine (`collect_labels`) and replayed (`BlockStepsBehaviour`), their DWS costs as the
   SJF order, the model's CPU latency profile, one TP-1 instance taking at most `--batch`
   requests per step, Poisson load swept upward. A last row, `oracle-sjf`, runs the same policy
   ordered by each request's true cost (its replayed steps priced by the profile at batch 1):
   the most any cost predictor could gain on this workload. Reported: mean and p99 latency and
   mean time to first block per policy and load, and each SJF's mean-latency ratio over FCFS.
3. The DWS step prior: `dilaserve` on an in-process cluster with and without DWS's expected
   steps as the step predictor's prior before the first step (SLO attainment).
4. With `--live`: DWS-SJF against FCFS on `dilaserve serve` (each variant's server up once,
   the load run A B C then C B A per rate).

The parts live beside it: the chat parts in `dws_chat.py`, minilm and cost in `dws_cost.py`,
sim, prior and live in `dws_scheduling.py`; `dws_target.py` holds the model they judge.

Writes one run folder with every table and the report.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dws_chat import chat_cost, chat_sjf, encoder_latency
from dws_cost import cost_error, minilm_dws
from dws_scheduling import live_sjf, simulated_sjf, step_prior

from dilaserve.config import BUNDLED_DWS, BUNDLED_DWS_COST, BUNDLED_MODEL, BUNDLED_PROFILE
from dilaserve.runs import create_run_dir, environment, markdown_table, write_json, write_records

BUNDLED_LABELS = "docs/results/train-dws-20261129-161600/labels.npz"  # the bundled DWS's labels
# the parts that serve the bundled model (its step predictor, its server): not with --model
BUNDLED_ONLY = ("prior", "live")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=str(BUNDLED_MODEL),
        help="the model the cost, sim and minilm parts judge (default: the bundled LLaDA); "
        "another needs --labels, --dws and --dws-cost",
    )
    parser.add_argument(
        "--labels", default=None, help=f"train-dws labels.npz (bundled: {BUNDLED_LABELS})"
    )
    parser.add_argument("--dws", default=None, help="its DWS predictor folder (train-dws --out)")
    parser.add_argument("--dws-cost", default=None, help="its cost kernel (profile --dws)")
    parser.add_argument(
        "--profile",
        default=None,
        help="its latency profile for the simulator (default: the model's "
        "dilaserve-calibration/cpu-float32/profile.json)",
    )
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--calibration", type=int, default=100)
    parser.add_argument("--rates", default="20,40,60,80")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--batch", type=int, default=4, help="requests per step batch")
    parser.add_argument("--slo", type=float, default=0.3)
    parser.add_argument("--prior-rps", type=float, default=44.0)
    parser.add_argument("--live", action="store_true")
    parser.add_argument(
        "--minilm-dws",
        default=None,
        help="a MiniLM DWS folder for the bundled model (else the minilm part trains one)",
    )
    parser.add_argument("--live-rates", default="10,20,30")
    parser.add_argument("--chat-rates", default="0.5,1,1.5,2")
    parser.add_argument("--chat-seconds", type=float, default=1200.0)
    parser.add_argument(
        "--skip", default="", help="parts to skip: chat-cost,chat,latency,minilm,cost,sim,prior"
    )
    parser.add_argument("--out", default="runs")
    args = parser.parse_args(argv)
    for name in ("rates", "live_rates", "chat_rates"):
        setattr(args, name, [float(r) for r in getattr(args, name).split(",")])
    bundled = Path(args.model).resolve() == BUNDLED_MODEL.resolve()
    if bundled:
        args.model = str(BUNDLED_MODEL)
        args.labels = args.labels or BUNDLED_LABELS
        args.dws = args.dws or str(BUNDLED_DWS)
        args.dws_cost = args.dws_cost or str(BUNDLED_DWS_COST)
    else:
        needed = {"--labels": args.labels, "--dws": args.dws, "--dws-cost": args.dws_cost}
        missing = [name for name, value in needed.items() if not value]
        if missing:
            parser.error(f"--model {args.model} needs {', '.join(missing)} (its own DWS)")
        running = [p for p in BUNDLED_ONLY if _runs(args, p)]
        if running:
            parser.error(f"parts {running} serve the bundled model only: --skip them")
    default_profile = Path(args.model) / "dilaserve-calibration" / "cpu-float32" / "profile.json"
    args.profile = args.profile or str(BUNDLED_PROFILE if bundled else default_profile)
    args.target = None
    return args


# the report's parts: (name, what runs it, its records file, its heading); `--skip NAME`
# leaves one out, and the live part runs only with `--live`
PARTS = (
    ("chat-cost", chat_cost, "chat_cost.csv", "Cost prediction on chat prompts"),
    ("chat", chat_sjf, "chat_sjf.csv", "SJF on chat prompts (simulator)"),
    ("latency", encoder_latency, "encoder_latency.csv", "Predictor latency per prompt"),
    ("minilm", minilm_dws, "minilm_dws.csv", "MiniLM DWS on the labels"),
    ("cost", cost_error, "cost_error.csv", "Cost prediction"),
    ("sim", simulated_sjf, "sim_sjf.csv", "DWS-SJF vs FCFS (simulator)"),
    ("prior", step_prior, "prior.csv", "The DWS step prior (live cluster)"),
    ("live", live_sjf, "live_sjf.csv", "DWS-SJF vs FCFS (live server)"),
)


def _runs(args, part: str) -> bool:
    """Whether `part` runs: not named in `--skip`; the live part only with `--live`."""
    return args.live if part == "live" else part not in args.skip.split(",")


def main() -> None:
    args = parse_args()
    folder = create_run_dir(args.out, "dws")
    args.folder = folder
    write_json(
        folder / "config.json",
        {**{k: v for k, v in vars(args).items() if k != "target"}, "environment": environment()},
    )
    lines, summary = ["# DWS evaluation", ""], {}
    for name, run, records, heading in PARTS:
        if not _runs(args, name):
            continue
        rows = run(args, print)
        lines += [f"## {heading}", ""]
        if isinstance(rows, tuple):  # the cost part also returns its summary
            rows, summary[name] = rows
            lines += [str(summary[name]), ""]
        write_records(folder / records, rows)
        lines += [markdown_table(rows, list(rows[0])), ""]
    write_json(folder / "summary.json", summary)
    (folder / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"run folder: {folder}")


if __name__ == "__main__":
    main()
