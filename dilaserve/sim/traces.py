"""Request traces: arrival times with prompt and output lengths, loaded or synthesized.

A trace is a CSV file with a header; columns are found by name, so these layouts all load:

- dilaserve's own (what `save_trace` writes; bring your own traces in this layout):

      arrival_time,prompt_tokens,output_tokens,slo
      0.0,28,224,2.5
      0.07310842187,344,544,2.5
      1.5,12,96,10.0

  `arrival_time` is seconds (any float Python can parse; `save_trace` writes the shortest text
  that reads back as the same float, so a saved trace loads back bit for bit), `prompt_tokens`
  and `output_tokens` are integers, and the optional `slo` column is seconds per request (a
  per-request SLO overrides the run's). Rows need not be sorted. Other columns are ignored;
- the Azure LLM inference trace 2023: `TIMESTAMP` (date and time), `ContextTokens`,
  `GeneratedTokens`;
- BurstGPT: `Timestamp` (seconds), `Request tokens`, `Response tokens`.

Arrival times are shifted so that the first request arrives at 0 and sorted.

Length tables (`load_lengths`, `load_first_turn_lengths`, `filter_lengths`) feed synthetic
traces, which `sim/synthetic.py` builds.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from dilaserve.config import DEFAULT_BLOCK_LEN

LAYOUTS = (  # (arrival, prompt, output) column names
    ("arrival_time", "prompt_tokens", "output_tokens"),
    ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    ("Timestamp", "Request tokens", "Response tokens"),
)

LENGTH_LAYOUTS = (  # (prompt, output) column names of a length table
    ("num_prefill_tokens", "num_decode_tokens"),  # ShareGPT stats from Sarathi-Serve / etalon
    ("prompt_tokens", "output_tokens"),  # dilaserve's own trace layout
)

# Found from the repository, not the working directory, so it works wherever a checkout runs.
SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
SHAREGPT_LENGTHS = SHARED_DATA / "lengths" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
SHAREGPT_FIRST_TURNS = SHARED_DATA / "prompts" / "sharegpt_first_turn_sample2000.jsonl"
CHARS_PER_TOKEN = 4.0  # a common estimate for English text under Llama-style tokenizers


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


def _read_csv(path: Path, layouts, what: str) -> tuple[tuple[str, ...], list[str], list[dict]]:
    """(the layout found, all columns, rows) of a CSV whose header holds one of `layouts`."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        columns = list(reader.fieldnames or [])
        layout = next((lay for lay in layouts if set(lay) <= set(columns)), None)
        if layout is None:
            raise ValueError(
                f"{what} {path}: columns {columns} match no known layout; expected one of "
                + "; ".join(", ".join(lay) for lay in layouts)
            )
        return layout, columns, list(reader)


def load_trace(path: str | Path) -> Trace:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace file {path} does not exist")
    layout, columns, rows = _read_csv(path, LAYOUTS, "trace")
    times, prompts, outputs, slos = [], [], [], []
    for line, row in enumerate(rows, start=2):
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


def save_trace(path: str | Path, trace: Trace) -> Path:
    """Write `trace` in dilaserve's own layout (see the module docstring); returns the path.

    Floats are written with `repr`, the shortest text that parses back to the same float, so
    `load_trace` returns the same arrays. `load_trace` shifts the first arrival to 0, so a
    trace whose first arrival is not 0 (a `window` of another) comes back shifted by it.
    """
    n = len(trace)
    if n == 0:
        raise ValueError(f"trace {trace.source!r} has no requests; load_trace could not read it")
    columns = {"prompt_tokens": trace.prompt_tokens, "output_tokens": trace.output_tokens}
    if trace.slo is not None:
        columns["slo"] = trace.slo
    for name, values in columns.items():
        if len(values) != n:
            raise ValueError(f"trace has {n} arrival times but {len(values)} {name}")
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arrival_time", *columns])
        arrival = [repr(float(t)) for t in trace.arrival]
        prompt = [int(x) for x in trace.prompt_tokens]
        output = [int(x) for x in trace.output_tokens]
        slo = [repr(float(s)) for s in trace.slo] if trace.slo is not None else None
        for i in range(n):
            writer.writerow([arrival[i], prompt[i], output[i]] + ([slo[i]] if slo else []))
    return path


# -- lengths ------------------------------------------------------------------------------------


def load_first_turn_lengths(
    path: str | Path = SHAREGPT_FIRST_TURNS,
) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_tokens, output_tokens) of ShareGPT first turns, estimated from characters.

    The sample in ../shared/data/prompts holds 2,000 first human turns with the length of the
    first answer (`prompt_chars`, `first_response_chars`; untruncated counts). Single turns are
    what the paper's length table looks like (median prompt 28 tokens); tokens are estimated as
    characters / CHARS_PER_TOKEN, since the Llama-2 tokenizer is not available here.
    """
    _, prompts, outputs = load_first_turns(path)
    return prompts, outputs


def load_first_turns(
    path: str | Path = SHAREGPT_FIRST_TURNS,
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The first turns' prompt texts with their (prompt_tokens, output_tokens), as above."""
    import json

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"first-turn sample {path} does not exist")
    texts, prompts, outputs = [], [], []
    with path.open() as f:
        for line, text in enumerate(f, start=1):
            try:
                row = json.loads(text)
                prompts.append(round(int(row["prompt_chars"]) / CHARS_PER_TOKEN))
                outputs.append(round(int(row["first_response_chars"] or 0) / CHARS_PER_TOKEN))
                texts.append(str(row.get("prompt", "")))
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"first-turn sample {path}, line {line}: {err!r}") from None
    return texts, np.asarray(prompts, dtype=np.int64), np.asarray(outputs, dtype=np.int64)


def load_lengths(path: str | Path = SHAREGPT_LENGTHS) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_tokens, output_tokens) int arrays from a length table (no arrival times).

    Columns are found by name: `num_prefill_tokens,num_decode_tokens` (the ShareGPT table in
    ../shared/data/lengths, from Sarathi-Serve) or `prompt_tokens,output_tokens` (so a
    dilaserve trace can lend its lengths too). Other columns are ignored.
    """
    path = Path(path)
    if path.suffix == ".jsonl":
        return load_first_turn_lengths(path)
    if not path.exists():
        raise FileNotFoundError(f"length table {path} does not exist")
    layout, _, rows = _read_csv(path, LENGTH_LAYOUTS, "length table")
    prompts, outputs = [], []
    for line, row in enumerate(rows, start=2):
        try:
            prompts.append(int(row[layout[0]]))
            outputs.append(int(row[layout[1]]))
        except (TypeError, ValueError) as err:
            raise ValueError(f"length table {path}, line {line}: {err}") from None
    if not prompts:
        raise ValueError(f"length table {path} has no rows")
    prompt, output = np.asarray(prompts, dtype=np.int64), np.asarray(outputs, dtype=np.int64)
    if (prompt < 0).any() or (output < 0).any():
        raise ValueError(f"length table {path} has negative token counts")
    return prompt, output


def length_pairs(prompt, output) -> tuple[np.ndarray, np.ndarray]:
    """Checked int64 arrays of (prompt, output) token counts, or an error naming the problem."""
    prompt, output = np.asarray(prompt), np.asarray(output)
    if prompt.ndim != 1 or prompt.shape != output.shape:
        raise ValueError(
            f"prompt and output lengths must be 1-D and equally long, got shapes "
            f"{prompt.shape} and {output.shape}"
        )
    if len(prompt) == 0:
        raise ValueError("no (prompt, output) length pairs given")
    if not (np.issubdtype(prompt.dtype, np.integer) and np.issubdtype(output.dtype, np.integer)):
        raise ValueError(f"token counts must be integers, got {prompt.dtype} and {output.dtype}")
    if (prompt < 0).any() or (output < 0).any():
        raise ValueError("token counts must not be negative")
    return prompt.astype(np.int64), output.astype(np.int64)


def filter_lengths(
    prompt, output, max_total: int = 4096, block_len: int = DEFAULT_BLOCK_LEN
) -> tuple[np.ndarray, np.ndarray]:
    """The paper's filtering of (prompt, output) pairs; returns the kept pairs.

    A diffusion LM generates whole blocks, so an output of n tokens costs ceil(n / block_len)
    blocks and occupies that many block_len slots: outputs are rounded up to a multiple of
    block_len (an output of 0 still denoises one block). A pair is kept only if prompt plus
    the rounded output fits in max_total, the context the model serves.
    """
    prompt, output = length_pairs(prompt, output)
    keep = kept_pairs(prompt, output, max_total, block_len)
    return prompt[keep], rounded_outputs(output[keep], block_len)


def rounded_outputs(output, block_len: int = DEFAULT_BLOCK_LEN) -> np.ndarray:
    """Outputs rounded up to whole blocks (an output of 0 still denoises one)."""
    return np.maximum(-(-np.asarray(output) // block_len), 1) * block_len


def kept_pairs(
    prompt, output, max_total: int = 4096, block_len: int = DEFAULT_BLOCK_LEN
) -> np.ndarray:
    """Indices of the pairs `filter_lengths` keeps."""
    if max_total <= 0 or block_len <= 0:
        raise ValueError(f"max_total and block_len must be positive, got {max_total}, {block_len}")
    return np.flatnonzero(np.asarray(prompt) + rounded_outputs(output, block_len) <= max_total)


def length_stats(values) -> dict[str, float]:
    """mean, p50, p90 and p99 of a length array: the columns of the paper's Table 2."""
    values = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = (float(q) for q in np.percentile(values, [50, 90, 99]))
    return {"mean": float(values.mean()), "p50": p50, "p90": p90, "p99": p99}
