"""What a doc quotes from a run: a small summary of its folder, committed beside the docs.

Run folders live in an ignored folder (`runs/` by default): they hold raw records, decision logs,
dashboards and per-interval series that nobody reads in review and that would make the repository
grow with every reproduction. `keep_run` copies the small files that say what a run was and what
it printed (its resolved config, summary, report, timings, and the figures at its top level) into
`docs/results/<run>/`, and gives the run a section of `docs/results/KEPT.md` (one index beside
the kept folders, not a note in each: the tree has a file budget) naming the command that made
the run and what was left out. The JSON files of nested run folders (a reproduction's
simulations: config, summary, timings) are gathered into one `nested.json`, one line per file
keyed by its path, so that a kept run stays a handful of files; a nested report.md repeats its
summary.json beside per-interval rows, and a nested .txt is a fitted model, so both stay behind.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

DOCS_RESULTS = Path("docs/results")
# what says what a run was and what it printed; anything else (records, logs, dashboards,
# per-interval series, weights) stays in the run folder
KEPT_SUFFIXES = (".json", ".md", ".txt")
# at the run's top level (nested runs keep only their JSON files)
FIGURE_SUFFIXES = (".png", ".svg")
MAX_FILE_BYTES = 200_000
MAX_TABLE_BYTES = 50_000  # a short table; per-request records are longer
KEPT_NOTE = "KEPT.md"  # the index of kept runs, beside their folders: a section each
NESTED = "nested.json"


@dataclass
class Kept:
    source: Path
    dest: Path
    copied: list[Path] = field(default_factory=list)
    left_out: list[tuple[Path, int]] = field(default_factory=list)  # (relative path, bytes)

    @property
    def copied_bytes(self) -> int:
        return sum((self.dest / path).stat().st_size for path in self.copied)


def _wanted(relative: Path, size: int) -> bool:
    if size > MAX_FILE_BYTES or relative.name == KEPT_NOTE:
        return False
    if len(relative.parts) > 1:
        return relative.suffix == ".json"
    if relative.suffix in FIGURE_SUFFIXES:
        return True
    if relative.suffix == ".csv":
        return size <= MAX_TABLE_BYTES
    return relative.suffix in KEPT_SUFFIXES


def run_command(run: Path) -> str | None:
    """The command that made `run`, as its config.json (or command.txt) recorded it."""
    config = run / "config.json"
    if config.is_file():
        try:
            recorded = json.loads(config.read_text()).get("environment", {}).get("command")
        except (json.JSONDecodeError, AttributeError):
            recorded = None
        if recorded:
            return recorded
    command = run / "command.txt"
    return command.read_text().strip() if command.is_file() else None


def keep_run(run: str | Path, dest: str | Path | None = None) -> Kept:
    """Copy `run`'s small files to `dest` (default `docs/results/<run name>`), replacing what was
    kept there before, and give it a section of the KEPT.md beside `dest`."""
    run = Path(run)
    if not run.is_dir():
        raise FileNotFoundError(f"no run folder {run}")
    dest = Path(dest) if dest is not None else DOCS_RESULTS / run.name
    if dest.resolve() == run.resolve():
        raise ValueError(f"{run} is already where it would be kept")
    if dest.exists():
        shutil.rmtree(dest)
    kept = Kept(run, dest)
    dest.mkdir(parents=True)
    nested: dict[str, object] = {}
    for path in sorted(p for p in run.rglob("*") if p.is_file()):
        relative = path.relative_to(run)
        size = path.stat().st_size
        if not _wanted(relative, size):
            kept.left_out.append((relative, size))
        elif len(relative.parts) > 1:
            nested[relative.as_posix()] = _content(path)
        else:
            shutil.copy2(path, dest / relative)
            kept.copied.append(relative)
    if nested:
        (dest / NESTED).write_text(nested_json(nested))
        kept.copied.append(Path(NESTED))
    for path in kept.copied:
        if path.suffix == ".md":
            _unlink_left_out(dest / path)
    index = dest.parent / KEPT_NOTE
    sections = read_sections(index.read_text() if index.is_file() else "")
    sections[dest.name] = _note(kept, dest.name, run_command(run), len(nested))
    index.write_text(write_sections(sections))
    return kept


INDEX_HEAD = (
    "# Kept runs\n\n"
    "What `dilaserve keep` copied from each run folder beside this file, the command that made "
    "the run, and what stayed behind.\n\n"
)


def read_sections(text: str) -> dict[str, str]:
    """The index's sections by run name (each from its `## name` line to the next)."""
    sections: dict[str, str] = {}
    for part in re.split(r"^(?=## )", text, flags=re.M)[1:]:
        name = part.splitlines()[0][3:].strip()
        sections[name] = part.rstrip("\n") + "\n"
    return sections


def write_sections(sections: dict[str, str]) -> str:
    return INDEX_HEAD + "\n".join(sections[name] for name in sorted(sections))


LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s:#]+)\)")


def _unlink_left_out(markdown: Path) -> None:
    """A kept report's links to files left in the run folder become plain names, so that every
    link under docs/ resolves."""
    text = markdown.read_text()

    def plain(link: re.Match) -> str:
        label, target = link.groups()
        return link.group(0) if (markdown.parent / target).exists() else f"{label} (not kept)"

    markdown.write_text(LINK.sub(plain, text))


def nested_json(nested: dict[str, object]) -> str:
    """One JSON object, one line per nested file: small, and a diff names the files it touches."""
    lines = [f"{json.dumps(path)}: {json.dumps(content)}" for path, content in nested.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _content(path: Path) -> object:
    text = path.read_text(errors="replace")
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def _note(kept: Kept, name: str, command: str | None, nested: int) -> str:
    made_by = f"`{command}`" if command else "a command its folder did not record"
    lines = [
        f"## {name}",
        "",
        f"The small files of the run folder `{kept.source.name}`, kept by `dilaserve keep`.",
        f"The run was made by {made_by}; running it again writes a new run folder under `runs/`.",
        "",
    ]
    if nested:
        lines += [f"{NESTED} holds {nested} small files of the nested run folders, by path.", ""]
    if kept.left_out:
        total = sum(size for _, size in kept.left_out)
        kinds = Counter(relative.name for relative, _ in kept.left_out)
        named = ", ".join(f"{name} ({count})" for name, count in sorted(kinds.items()))
        lines += [
            f"Left out: {len(kept.left_out)} file(s), {total / 1e6:.1f} MB in all: {named}.",
            "",
        ]
    return "\n".join(lines)
