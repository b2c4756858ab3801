"""Run folders: every eval, benchmark, profile and training run writes one (DESIGN section 6).

A run folder holds the resolved config (`config.json`), raw per-item records (`records.csv`),
a summary (`summary.json`) and, where there is one, a markdown report.
"""

from __future__ import annotations

import csv
import functools
import json
import platform
import subprocess
import sys
import time
from pathlib import Path


def create_run_dir(root: str | Path, kind: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    Path(root).mkdir(parents=True, exist_ok=True)
    for suffix in range(1, 1000):
        folder = Path(root) / (f"{kind}-{stamp}" + (f"-{suffix}" if suffix > 1 else ""))
        try:
            folder.mkdir()  # atomic: two runs started in the same second get two folders
            return folder
        except FileExistsError:
            continue
    raise FileExistsError(f"no free run folder name for {kind}-{stamp} in {root}")


def environment() -> dict:
    import torch

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "command": " ".join(sys.argv),
        "compiled": control_plane_compiled(),
        **loaded_from(),
    }


def control_plane_compiled() -> bool:
    """Whether the control plane runs as mypyc built it (`make compile`): the same decisions,
    but a live run's controller takes less of the host's time."""
    import dilaserve.control.scheduler

    return not dilaserve.control.scheduler.__file__.endswith(".py")


def source_commit() -> dict:
    """The commit of the checkout this package runs from, and whether its tracked files had
    uncommitted changes (empty outside a git checkout)."""

    def git(*args: str) -> str:
        here = str(Path(__file__).parent)
        try:
            done = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True)
        except OSError:  # no git on this machine
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "HEAD")
    return {"commit": head, "dirty": bool(head and git("status", "--porcelain", "-uno"))}


@functools.cache
def loaded_from() -> dict:
    """What `environment()` records: the checkout as first asked, not at import (importing
    runs no subprocess). A long run that wants the checkout as it started calls this early,
    as the CLI does, so that edits made while it runs are not recorded as its code."""
    return source_commit()


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def write_records(path: Path, records: list[dict]) -> None:
    if not records:
        path.write_text("")
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_table_run(
    root: str | Path, kind: str, config: dict, records: list[dict], title: str
) -> Path:
    """A run folder for a benchmark that produces one table: config (with the environment),
    records.csv, summary.json and report.md. Prints the table and the folder."""
    folder = create_run_dir(root, kind)
    write_json(folder / "config.json", {**config, "environment": environment()})
    write_records(folder / "records.csv", records)
    write_json(folder / "summary.json", {"records": records})
    table = markdown_table(records, list(records[0]))
    (folder / "report.md").write_text(f"# {title}\n\n{table}\n")
    print(table)
    print(f"run folder: {folder}")
    return folder
