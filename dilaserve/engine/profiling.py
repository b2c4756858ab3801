"""`dilaserve profile`: measure this machine's step latencies on the real engine.

For a grid of batch sizes it times recompute steps (whole sequences, K/V stored) and cache steps
(one block per request against the stored K/V), through `Engine.execute`, so the figures include
the engine's own per-step work. Requests use threshold 1.0 (one commit per step), which keeps a
block open for the cache-step measurements. Writes a latency-profile JSON
(`control/profile.py` format) and a run folder.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dilaserve.config import EngineConfig
from dilaserve.control.profile import SCHEMA
from dilaserve.engine.engine import Engine
from dilaserve.protocol import SequenceSpec, StepBatch, StepItem, StepKind
from dilaserve.runs import create_run_dir, environment, write_json, write_records


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    model: str
    seq_len: int = 128  # prompt + output window of the profiled requests
    gen_len: int = 64
    requests: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    repeats: int = 3
    dtype: str = "float32"
    device: str = "cpu"
    cuda_graphs: int = 0  # EngineConfig.cuda_graphs
    out: str = "runs"
    profile_out: str | None = None

    def __post_init__(self):
        if self.gen_len >= self.seq_len:
            raise ValueError(f"{self.gen_len=} must be smaller than {self.seq_len=}")
        if self.repeats <= 0 or not self.requests or min(self.requests) <= 0:
            raise ValueError("repeats and every entry of requests must be positive")


def _items(engine: Engine, n: int, cfg: ProfileConfig, kind: StepKind, fresh: bool):
    prompt = tuple(3 + i % 50 for i in range(cfg.seq_len - cfg.gen_len))
    output = (engine.special.mask,) * cfg.gen_len
    spec = SequenceSpec(prompt, output) if fresh else None
    return StepBatch(tuple(StepItem(f"p{i}", 1.0, kind, spec) for i in range(n)))


def _time_step(engine: Engine, batch: StepBatch) -> tuple[float, int]:
    start = time.perf_counter()
    out = engine.execute(batch)
    return time.perf_counter() - start, out.num_tokens


def measure(engine: Engine, cfg: ProfileConfig, n: int) -> list[dict]:
    """Median recompute and cache step time for `n` requests."""
    rows = []
    for kind in (StepKind.RECOMPUTE, StepKind.CACHE):
        samples, tokens = [], 0
        for _ in range(cfg.repeats + 1):  # the first run of each is a warm-up
            for i in range(n):
                engine.release(f"p{i}")
            seconds, tokens = _time_step(engine, _items(engine, n, cfg, StepKind.RECOMPUTE, True))
            if kind is StepKind.CACHE:
                seconds, tokens = _time_step(engine, _items(engine, n, cfg, kind, False))
            samples.append(seconds)
        ms = 1e3 * statistics.median(samples[1:])
        rows.append(
            {
                "tp": 1,
                "kind": kind.value,
                "batch_tokens": tokens,
                "num_requests": n,
                "seq_len": cfg.seq_len,
                "ms": round(ms, 3),
            }
        )
    return rows


def profile(cfg: ProfileConfig, log=print) -> Path:
    config = EngineConfig("dual", dtype=cfg.dtype, device=cfg.device, cuda_graphs=cfg.cuda_graphs)
    engine = Engine.from_checkpoint(cfg.model, config)
    run = create_run_dir(cfg.out, "profile")
    write_json(run / "config.json", {**asdict(cfg), "environment": environment()})
    entries = []
    for n in cfg.requests:
        entries += measure(engine, cfg, n)
        log(
            " ".join(
                f"{e['kind']}: {e['batch_tokens']} tokens {e['ms']:.1f} ms" for e in entries[-2:]
            )
        )
    write_records(run / "records.csv", entries)
    import torch

    result = {
        "schema": SCHEMA,
        "model": str(cfg.model),
        "dtype": cfg.dtype,
        "block_len": engine.config.block_len,
        "hardware": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "entries": entries,
    }
    write_json(run / "summary.json", result)
    target = Path(cfg.profile_out) if cfg.profile_out else run / "profile.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    write_json(target, result)
    log(f"profile written to {target}; run folder: {run}")
    return target
