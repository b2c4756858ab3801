"""The repository stays a codebase, not a store of run output (docs/results/README.md).

Run folders go to the ignored `runs/`; what a doc quotes is a summary under docs/results/ made
by `dilaserve keep`.
"""

import json
import re
import subprocess
from pathlib import Path

import pytest

from dilaserve.keep import keep_run, read_sections

ROOT = Path(__file__).resolve().parents[1]
MAX_FILES = 1500
MAX_BYTES = 30_000_000
LINK = re.compile(r"\]\(([^)\s]+)\)")


def tracked() -> list[Path]:
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [Path(name) for name in done.stdout.decode().split("\0") if name]


def test_no_run_folder_is_tracked():
    assert not [p for p in tracked() if p.parts[0] == "runs"]
    assert not [p for p in tracked() if p.parts[:2] == ("benchmarks", "results")]


def test_the_tree_stays_under_its_file_count():
    assert len(tracked()) < MAX_FILES


def test_the_tree_stays_under_its_size():
    size = sum((ROOT / p).stat().st_size for p in tracked() if (ROOT / p).is_file())
    assert size < MAX_BYTES, f"{size / 1e6:.1f} MB tracked"


def markdown_files() -> list[Path]:
    return [
        ROOT / p for p in tracked() if p.suffix == ".md" and p.parts[0] in ("docs", "README.md")
    ]


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for doc in markdown_files():
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#")[0]
            if path and not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "\n".join(broken)


def test_keep_copies_the_small_files_and_names_the_command(tmp_path):
    run = tmp_path / "simulate-20260101-000000"
    (run / "sub-1").mkdir(parents=True)
    (run / "config.json").write_text('{"environment": {"command": "dilaserve simulate"}}')
    (run / "summary.json").write_text('{"attainment": 0.9}')
    (run / "report.md").write_text("[summary](summary.json), [records](records.csv) ![p](p.png)")
    (run / "records.csv").write_text("x\n" * 60_000)  # per-request records stay behind
    (run / "dashboard-data.js").write_text("window.DASHBOARD = {};")
    (run / "sub-1" / "summary.json").write_text('{"attainment": 0.8}')
    (run / "sub-1" / "run.png").write_bytes(b"\x89PNG")
    (run / "sub-1" / "report.md").write_text("- attainment: 0.8\n| start | ... |")  # repeats it

    kept = keep_run(run, tmp_path / "kept")

    names = sorted(p.name for p in kept.dest.iterdir())
    assert names == ["config.json", "nested.json", "report.md", "summary.json"]
    report = (kept.dest / "report.md").read_text()  # links to what stayed behind are names
    assert report == "[summary](summary.json), records (not kept) p (not kept)"
    nested = (kept.dest / "nested.json").read_text()
    assert json.loads(nested) == {"sub-1/summary.json": {"attainment": 0.8}}
    assert '"sub-1/summary.json": {"attainment": 0.8}' in nested.splitlines()
    [note] = read_sections((tmp_path / "KEPT.md").read_text()).values()  # the index beside it
    assert note.startswith("## kept\n") and "`dilaserve simulate`" in note
    assert "records.csv (1)" in note and "dashboard-data.js (1)" in note and "run.png (1)" in note
    assert "report.md (1)" in note


def test_the_index_of_kept_runs_has_a_section_a_run_sorted_and_replaced(tmp_path):
    for name in ("b-run", "a-run"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text("{}")
        keep_run(tmp_path / name, tmp_path / "kept" / name)
    (tmp_path / "a-run" / "command.txt").write_text("python again.py")
    keep_run(tmp_path / "a-run", tmp_path / "kept" / "a-run")  # kept again: replaced
    text = (tmp_path / "kept" / "KEPT.md").read_text()
    assert text.startswith("# Kept runs") and text.count("## ") == 2
    assert text.index("## a-run") < text.index("## b-run") and "`python again.py`" in text
    assert "did not record" in read_sections(text)["b-run"]


def test_keep_refuses_a_missing_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run folder"):
        keep_run(tmp_path / "nothing")
