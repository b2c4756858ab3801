"""`dilaserve keep`: a run folder's summary for the docs (dilaserve/keep.py)."""

from __future__ import annotations


def cmd_keep(args) -> None:
    from dilaserve.keep import keep_run

    for run in args.runs:
        kept = keep_run(run, args.to and f"{args.to}/{run.rstrip('/').split('/')[-1]}")
        print(
            f"{kept.source} -> {kept.dest}: {len(kept.copied)} files kept "
            f"({kept.copied_bytes / 1e3:.0f} kB), {len(kept.left_out)} left out"
        )


def add_run_commands(sub) -> None:
    kp = sub.add_parser(
        "keep",
        help="copy a run folder's config, summary, report and figures beside the docs",
        description="Copies the small files of each RUN (config, summary, report, timings, "
        "top-level figures) to docs/results/<run>/ and writes KEPT.md naming the command "
        "that made it. Records, logs and dashboards stay in the run folder.",
    )
    kp.add_argument("runs", nargs="+", metavar="RUN", help="run folder(s), e.g. runs/eval-...")
    kp.add_argument("--to", default=None, help="folder to keep them in (default docs/results)")
    kp.set_defaults(func=cmd_keep)
