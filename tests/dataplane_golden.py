"""Step logs of the bundled models (and a random Dream) through `Engine.execute`, for the test
that compares today's data plane with the one it replaced (`tests/test_dataplane.py`).

    PYTHONPATH=<checkout> python tests/dataplane_golden.py GOLDEN.json

adds this machine's logs (`machine()`: the CPU and torch, which pick the kernels and so the
last bits) to `tests/fixtures/dataplane_golden.json`, run from commit e1936f1, the last with
the old data plane (padded K/V stacks, concatenation in every layer, dense masks), its
decoding rules and float16-stored bundled weights. The first logs, of 2026-11, did not
record their machine ("unrecorded"). Each scenario steps requests of different prompt
lengths and thresholds, joining at different steps, so that batches mix step kinds, query
lengths and cached lengths; a log entry is (kind, positions, tokens, confidences) per step,
the confidences as base64 float32 (`decode`).
"""

from __future__ import annotations

import base64
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

from dilaserve.config import BUNDLED_MODEL, EngineConfig
from dilaserve.engine.engine import Engine
from dilaserve.protocol import StepBatch
from dilaserve.request import Request
from dilaserve.training.random_checkpoint import write_random_dream

ASSETS = Path(BUNDLED_MODEL).parent
SHAPES = {"a": (23, 0.9, 0), "b": (41, 0.7, 1), "c": (9, 0.95, 2), "d": (30, 0.8, 0)}
SCENARIOS = [  # (model, kv_cache, dtype, block_len, gen_len)
    ("tiny-llada", "none", "float32", 32, 64),
    ("tiny-llada", "none", "bfloat16", 32, 64),
    ("tiny-llada", "prefix", "float32", 32, 64),
    ("tiny-llada", "dual", "float32", 32, 64),
    ("tiny-llada", "dual", "bfloat16", 32, 64),
    ("tiny-llada2", "dual", "float32", 32, 64),
    ("tiny-llada2", "dual", "bfloat16", 32, 64),
    ("dream", "none", "float32", 8, 16),
    ("dream", "prefix", "float32", 8, 16),
    ("dream", "dual", "float32", 8, 16),
]


def model_path(name: str, scratch: Path) -> Path:
    if name != "dream":
        return ASSETS / name
    folder = scratch / "dream"
    if not folder.exists():
        write_random_dream(folder, seed=0)
    return folder


def run(path: Path, kv_cache: str, dtype: str, block_len: int, gen_len: int) -> dict:
    config = EngineConfig(kv_cache, block_len=block_len, dtype=dtype, early_finish=False)
    eng = Engine.from_checkpoint(path, config)
    first = eng.special.mask + 1 if eng.special.mask < 100 else 20
    requests, delays = [], {}
    for rid, (prompt_len, threshold, delay) in SHAPES.items():
        prompt = tuple(first + (7 * i + prompt_len) % 60 for i in range(prompt_len))
        requests.append(Request(rid, prompt, gen_len, block_len, eng.special.mask, threshold))
        delays[rid] = delay
    log = {r.request_id: [] for r in requests}
    on_instance: set[str] = set()
    step = 0
    while any(not r.is_finished for r in requests):
        batch = [r for r in requests if not r.is_finished and delays[r.request_id] <= step]
        items = tuple(r.step_item(kv_cache, r.request_id in on_instance) for r in batch)
        on_instance.update(r.request_id for r in batch)
        for r, res in zip(batch, eng.execute(StepBatch(items)).results):
            r.apply(res)
            log[r.request_id].append(
                [
                    res.kind.value,
                    res.positions.tolist(),
                    res.tokens.tolist(),
                    encode(res.confidences),
                ]
            )
        step += 1
    return log


def machine() -> str:
    """What decides the last bits of a step's arithmetic here: the CPU (its model, and the
    kernels torch picks for it) and torch's version."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"


def encode(conf) -> str:
    """float32 confidences, bit for bit, as base64."""
    return base64.b64encode(conf.astype("<f4").tobytes()).decode()


def decode(text: str):
    import numpy as np

    return np.frombuffer(base64.b64decode(text), dtype="<f4")


def all_logs() -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # as the tests run (conftest.py): the threads split the sums
    with tempfile.TemporaryDirectory() as scratch:
        return {
            "/".join(map(str, s)): run(model_path(s[0], Path(scratch)), *s[1:]) for s in SCENARIOS
        }


if __name__ == "__main__":
    golden = Path(sys.argv[1])
    by_machine = json.loads(golden.read_text()) if golden.exists() else {}
    by_machine[machine()] = all_logs()
    golden.write_text(json.dumps(by_machine))
