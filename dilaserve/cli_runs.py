"""`dilaserve keep`: a run folder's summary for the docs (dilaserve/keep.py); `dilaserve
dashboard`: a run folder's dashboard, served or written as one page (dilaserve/dashboard/)."""

from __future__ import annotations


def cmd_keep(args) -> None:
    from dilaserve.keep import keep_run

    for run in args.runs:
        kept = keep_run(run, args.to and f"{args.to}/{run.rstrip('/').split('/')[-1]}")
        print(
            f"{kept.source} -> {kept.dest}: {len(kept.copied)} files kept "
            f"({kept.copied_bytes / 1e3:.0f} kB), {len(kept.left_out)} left out"
        )


def cmd_dashboard(args) -> None:
    from dilaserve.dashboard.page import read_data, write_report
    from dilaserve.dashboard.serve import create_server

    if args.html:
        page = write_report(read_data(args.run), args.html)
        print(
            f"{args.run} -> {page}: one page, its data inside ({page.stat().st_size / 1e3:.0f} kB)"
        )
        return
    server = create_server(args.run, args.port)
    print(f"the dashboard of {args.run}: {server.url} (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print()
    finally:
        server.server_close()


def add_run_commands(sub) -> None:
    kp = sub.add_parser(
        "keep",
        help="copy a run folder's config, summary, report and figures beside the docs",
        description="Copies the small files of each RUN (config, summary, report, timings, "
        "top-level figures) to docs/results/<run>/ and gives it a section of the KEPT.md "
        "beside it naming the command that made it. Records, logs and dashboards stay in the "
        "run folder.",
    )
    kp.add_argument("runs", nargs="+", metavar="RUN", help="run folder(s), e.g. runs/eval-...")
    kp.add_argument("--to", default=None, help="folder to keep them in (default docs/results)")
    kp.set_defaults(func=cmd_keep)

    db = sub.add_parser(
        "dashboard",
        help="show a simulated run's dashboard in a browser",
        description="Serves the dashboard page with RUN's dashboard-data.js on 127.0.0.1 and "
        "prints its URL (Ctrl-C stops it); or, with --html, writes one self-contained page "
        "holding the run's data, to share.",
    )
    db.add_argument("run", metavar="RUN", help="a run folder, e.g. runs/simulate-...")
    db.add_argument("--port", type=int, default=8765, help="port to serve on (0: any free one)")
    db.add_argument("--html", metavar="OUT.html", default=None, help="write one page instead")
    db.set_defaults(func=cmd_dashboard)
