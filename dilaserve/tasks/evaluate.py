"""Quality and speed of a model across confidence thresholds: `dilaserve eval`.

For each threshold, every problem is generated to completion and scored by exact match of the
number after `####`. Reports accuracy and mean denoising steps per request; writes a run folder.
While a threshold runs, one stderr line shows the problems done and the time left. With
`keep_curve` the accuracy per threshold is also kept as the model's quality curve, in its
calibration folder for the device and dtype (`quality.json`, `calibration/store.py`): `serve`
keeps the quality budget on it.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dilaserve.config import DEFAULT_BLOCK_LEN, EngineConfig, SamplingParams
from dilaserve.engine.llm import LLM
from dilaserve.runs import (
    create_run_dir,
    environment,
    markdown_table,
    write_json,
    write_records,
)
from dilaserve.tasks import arith

TASKS = ("bundled", "gsm8k")
DEFAULT_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
# Problems in a batch finish together, so the first few say little about the time left.
MIN_DONE_FOR_ESTIMATE = 0.1
TABLE_COLUMNS = ["threshold", "accuracy", "mean_steps", "mean_tokens", "tokens_per_step", "seconds"]


@dataclass(frozen=True, slots=True)
class EvalConfig:
    model: str
    task: str = "bundled"
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    num_problems: int = 500
    max_tokens: int = 64
    kv_cache: str = "dual"
    dtype: str = "float32"
    device: str = "cpu"
    cuda_graphs: int = 0  # EngineConfig.cuda_graphs
    block_len: int = DEFAULT_BLOCK_LEN  # the output window is whole blocks
    max_batch: int = 128
    data: str | None = None  # GSM8K jsonl
    out: str = "runs"
    seed: int = 2024
    steps: int | None = None  # EngineConfig.steps
    step_budget: int | None = None  # EngineConfig.step_budget
    eos_stop: str | None = None  # EngineConfig.eos_stop
    editing: str | None = None  # EngineConfig.editing
    keep_curve: bool = False  # keep the accuracy per threshold as the model's quality curve

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"{self.task=} must be one of {TASKS}")
        if self.keep_curve and len(set(self.thresholds)) < 2:
            raise ValueError(f"a quality curve needs two thresholds or more, not {self.thresholds}")
        if self.num_problems <= 0:
            raise ValueError(f"{self.num_problems=} must be positive")
        for t in self.thresholds:
            SamplingParams(threshold=t)


def load_problems(cfg: EvalConfig) -> list[tuple[str, int]]:
    """(question, gold answer) pairs."""
    if cfg.task == "bundled":
        return [
            (p.question, p.answer)
            for p in arith.generate(cfg.num_problems, seed=cfg.seed, split="test")
        ]
    path = Path(cfg.data) if cfg.data else None
    if path is None or not path.exists():
        raise FileNotFoundError(f"--data must point to GSM8K's test.jsonl (got {cfg.data})")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["question"], arith.extract_answer(r["answer"])) for r in rows[: cfg.num_problems]]


class ProgressLine:
    """Problems done and the time left at one threshold, redrawn on one line of `stream` at most
    every `every` seconds (and when the last is done); `close` clears the line."""

    def __init__(self, label: str, total: int, stream, clock=time.monotonic, every: float = 0.5):
        self.label, self.total, self.stream = label, total, stream
        self.clock, self.every = clock, every
        self.start = clock()
        self.done = 0
        self.drawn_at: float | None = None
        self.width = 0

    def on_step(self, request, result) -> None:
        """`LLM.run`'s per-step callback: a problem is done when its request finishes."""
        if result.is_finished:
            self.advance()

    def advance(self) -> None:
        self.done += 1
        now = self.clock()
        if self.done == self.total or self.drawn_at is None or now - self.drawn_at >= self.every:
            self.draw(now)

    def text(self, now: float) -> str:
        done = f"{self.label}: {self.done}/{self.total} problems"
        if self.done < MIN_DONE_FOR_ESTIMATE * self.total:
            return f"{done}, time left: estimating"
        left = (now - self.start) / self.done * (self.total - self.done)
        return f"{done}, {left:.0f} s left"

    def draw(self, now: float) -> None:
        text = self.text(now)
        self.width = max(self.width, len(text))
        self.stream.write(f"\r{text.ljust(self.width)}")
        self.stream.flush()
        self.drawn_at = now

    def close(self) -> None:
        if self.drawn_at is not None:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def evaluate(cfg: EvalConfig, log=print, show_progress: bool = True) -> Path:
    engine = EngineConfig(
        cfg.kv_cache,
        cfg.block_len,
        cfg.dtype,
        cfg.device,
        cuda_graphs=cfg.cuda_graphs,
        eos_stop=cfg.eos_stop,
        steps=cfg.steps,
        editing=cfg.editing,
        step_budget=cfg.step_budget,
    )
    llm = LLM(cfg.model, engine)
    problems = load_problems(cfg)
    run = create_run_dir(cfg.out, f"eval-{cfg.task}")
    used = {"kv_cache_used": llm.config.kv_cache.value}  # a block-causal model's: block
    write_json(run / "config.json", {**asdict(cfg), **used, "environment": environment()})
    records, table = [], []
    for threshold in cfg.thresholds:
        progress = ProgressLine(f"threshold {threshold}", len(problems), sys.stderr)
        start = time.perf_counter()
        outs = llm.generate(
            [q for q, _ in problems],
            SamplingParams(threshold=threshold, max_tokens=cfg.max_tokens),
            max_batch=cfg.max_batch,
            on_step=progress.on_step if show_progress else None,
        )
        seconds = time.perf_counter() - start
        progress.close()
        rows = [
            _record(threshold, i, gold, out)
            for i, ((_, gold), out) in enumerate(zip(problems, outs))
        ]
        records += rows
        table.append(_summarise(threshold, rows, seconds))
        log(
            f"threshold {threshold}: accuracy {table[-1]['accuracy']:.3f}, "
            f"mean steps {table[-1]['mean_steps']:.2f} ({seconds:.0f}s)"
        )
    write_records(run / "records.csv", records)
    summary = {"task": cfg.task, "num_problems": len(problems), "table": table}
    write_json(run / "summary.json", summary)
    if cfg.keep_curve:
        log(f"quality curve kept: {keep_curve(cfg, summary)}")
    report = markdown_table(table, TABLE_COLUMNS)
    (run / "report.md").write_text(f"# eval {cfg.task}\n\n{report}\n")
    log(report)
    log(f"run folder: {run}")
    return run


def keep_curve(cfg: EvalConfig, summary: dict) -> Path:
    """Write `summary` (its accuracy per threshold) as the model's quality curve for the device
    and dtype it was measured on; the file written."""
    from dilaserve.calibration.plan import device_name
    from dilaserve.calibration.store import QUALITY_FILE, model_key, writable_folder

    key = model_key(cfg.model, device_name(cfg.device), cfg.dtype)
    path = writable_folder(cfg.model, key) / QUALITY_FILE
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("model", "out", "keep_curve")}
    write_json(path, summary | {"settings": settings})
    return path


def _record(threshold: float, index: int, gold, out) -> dict:
    predicted = arith.extract_answer(out.text)
    return {
        "threshold": threshold,
        "index": index,
        "gold": gold,
        "predicted": predicted,
        "correct": int(predicted is not None and predicted == gold),
        "steps": out.num_steps,
        "tokens": len(out.token_ids),
        "recompute_steps": out.steps_by_kind.get("recompute", 0),
        "text": out.text,
    }


def _summarise(threshold: float, rows: list[dict], seconds: float) -> dict:
    n = len(rows)
    steps = sum(r["steps"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {
        "threshold": threshold,
        "accuracy": round(sum(r["correct"] for r in rows) / n, 4),
        "mean_steps": round(steps / n, 2),
        "mean_tokens": round(tokens / n, 2),
        "tokens_per_step": round(tokens / steps, 2),
        "seconds": round(seconds, 1),
    }
