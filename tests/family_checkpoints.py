"""Helpers for the Dream and LLaDA2 tests: the package's random-checkpoint writers
(`dilaserve/training/random_checkpoint.py`) under the names the tests use, prompt ids, a step
driver, log comparison, a tensor-parallel executor, and a mask row scaled down."""

from __future__ import annotations

from pathlib import Path

from dilaserve.training.random_checkpoint import (  # noqa: F401 (re-exported)
    DREAM_KEYS,
    DREAM_SPECIALS,
    LLADA2_KEYS,
    LLADA2_SPECIALS,
    QWEN_TEMPLATE,
    WORDS,
    dream_config,
    llada2_config,
    write_random_dream,
    write_random_llada2,
    write_tokenizer,
)

from conftest import HANG_GUARD_S

dream_checkpoint = write_random_dream
llada2_checkpoint = write_random_llada2


def quiet_mask(folder: Path, mask: int, scale: float = 0.01) -> Path:
    """Scale the mask token's `lm_head` row down, so that its logit stays near 0 and it is never
    the top-1 (as in a trained model), while still counting in the softmax."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(shard)
        if "lm_head.weight" in tensors:
            tensors["lm_head.weight"][mask] *= scale
            save_file(tensors, shard, metadata={"format": "pt"})
    return folder


def prompt_ids(n: int, offset: int = 0) -> tuple[int, ...]:
    """n ordinary word ids (no special token)."""
    first = len(LLADA2_SPECIALS) + 1
    return tuple(first + (offset + 3 * i) % len(WORDS) for i in range(n))


def drive(execute, requests, mode: str, delays: dict[str, int] | None = None) -> dict:
    """Step `requests` to completion through `execute(StepBatch) -> StepOutput`, request r
    joining at step `delays[r]` (default 0). Each request's log of (kind, positions, tokens,
    confidences) per step."""
    from dilaserve.protocol import StepBatch

    delays = delays or {}
    log = {r.request_id: [] for r in requests}
    on_instance: set[str] = set()
    step = 0
    while any(not r.is_finished for r in requests):
        batch = [r for r in requests if not r.is_finished and delays.get(r.request_id, 0) <= step]
        if batch:
            items = tuple(r.step_item(mode, r.request_id in on_instance) for r in batch)
            on_instance.update(r.request_id for r in batch)
            for r, res in zip(batch, execute(StepBatch(items)).results):
                r.apply(res)
                entry = (res.kind.value, res.positions.tolist(), res.tokens.tolist())
                log[r.request_id].append((*entry, res.confidences.copy()))
        step += 1
    return log


def same_logs(a: dict, b: dict, atol: float = 1e-5) -> bool:
    """Equal kinds, positions and tokens at every step; confidences equal to `atol`."""
    import numpy as np

    if a.keys() != b.keys():
        return False
    for rid in a:
        if [s[:3] for s in a[rid]] != [s[:3] for s in b[rid]]:
            return False
        if not all(np.allclose(x[3], y[3], atol=atol) for x, y in zip(a[rid], b[rid])):
            return False
    return True


def tensor_parallel_execute(path: Path, engine, tp: int = 2):
    """An `execute` running on a `tp`-rank instance of the cluster's local backend (gloo), and
    a function that stops it."""
    import time

    from dilaserve.cluster.backends import LocalBackend
    from dilaserve.cluster.worker import WorkerConfig
    from dilaserve.control.decisions import InstanceSpec

    backend = LocalBackend(WorkerConfig(model=str(path), engine=engine, threads=1))
    backend.start(InstanceSpec("tp", 0, tp, tuple(range(tp))))

    def wait(kind: str):
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline:
            for event in backend.poll(0.5):
                assert event.kind == kind, event
                return event
        raise TimeoutError(kind)

    wait("up")

    def execute(batch):
        backend.step("tp", batch)
        return wait("done").output

    return execute, backend.shutdown
