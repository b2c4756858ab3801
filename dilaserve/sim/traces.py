"""Request traces: arrival times with prompt and output lengths.

A trace is a CSV file with a header; columns are found by name, so these layouts all load:

- dilaserve's own: `arrival_time` (seconds), `prompt_tokens`, `output_tokens`, optional `slo`
  (seconds; a per-request SLO overrides the run's);
- the Azure LLM inference trace 2023: `TIMESTAMP` (date and time), `ContextTokens`,
  `GeneratedTokens`;
- BurstGPT: `Timestamp` (seconds), `Request tokens`, `Response tokens`.

Arrival times are shifted so that the first request arrives at 0 and sorted.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

LAYOUTS = (  # (arrival, prompt, output) column names
    ("arrival_time", "prompt_tokens", "output_tokens"),
    ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    ("Timestamp", "Request tokens", "Response tokens"),
)


@dataclass(frozen=True)
class Trace:
    arrival: np.ndarray  # seconds, ascending, first at 0
    prompt_tokens: np.ndarray  # int
    output_tokens: np.ndarray  # int
    slo: np.ndarray | None = None  # seconds per request, if the trace carries them
    source: str = ""

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def duration(self) -> float:
        return float(self.arrival[-1]) if len(self) else 0.0

    def window(self, start: float, end: float) -> Trace:
        """The requests arriving in [start, end), times shifted to start at 0."""
        keep = (self.arrival >= start) & (self.arrival < end)
        return Trace(
            self.arrival[keep] - start,
            self.prompt_tokens[keep],
            self.output_tokens[keep],
            None if self.slo is None else self.slo[keep],
            f"{self.source}[{start:g}s, {end:g}s)",
        )

    def busiest_window(self, seconds: float) -> Trace:
        """The `seconds`-long stretch with the most arrivals (a planner sizes for the peak)."""
        ends = np.searchsorted(self.arrival, self.arrival + seconds, side="left")
        first = int(np.argmax(ends - np.arange(len(self))))
        start = float(self.arrival[first])
        return self.window(start, start + seconds)


def _time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    stamp, _, fraction = text.strip().partition(".")
    seconds = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp()
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


def load_trace(path: str | Path) -> Trace:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace file {path} does not exist")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        columns = reader.fieldnames or []
        layout = next((lay for lay in LAYOUTS if set(lay) <= set(columns)), None)
        if layout is None:
            raise ValueError(
                f"trace {path}: columns {columns} match no known layout; expected one of "
                + "; ".join(", ".join(lay) for lay in LAYOUTS)
            )
        times, prompts, outputs, slos = [], [], [], []
        for line, row in enumerate(reader, start=2):
            try:
                times.append(_time(row[layout[0]]))
                prompts.append(int(row[layout[1]]))
                outputs.append(int(row[layout[2]]))
                if "slo" in columns:
                    slos.append(float(row["slo"]))
            except (TypeError, ValueError) as err:
                raise ValueError(f"trace {path}, line {line}: {err}") from None
    if not times:
        raise ValueError(f"trace {path} has no requests")
    order = np.argsort(times, kind="stable")
    arrival = np.asarray(times)[order]
    return Trace(
        arrival - arrival[0],
        np.asarray(prompts, dtype=np.int64)[order],
        np.asarray(outputs, dtype=np.int64)[order],
        np.asarray(slos)[order] if slos else None,
        str(path),
    )
