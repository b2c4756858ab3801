"""Helpers for the Dream and LLaDA2 tests: the package's random-checkpoint writers
(`dilaserve/training/random_checkpoint.py`) under the names the tests use, prompt ids, cases run
as one batch (with and without the graph path's static buffers), a step driver, log comparison,
a tensor-parallel executor, and a mask row scaled down."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dilaserve.config import EngineConfig, SamplingParams
from dilaserve.engine.llm import LLM
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


def run_cases(llm: LLM, cases, which=None) -> list:
    """Cases (prompt length, max_tokens, threshold) `which` (all by default) as requests named
    by their index, prompt i offset by i, run as one batch."""
    requests = []
    for i in range(len(cases)) if which is None else which:
        n, max_tokens, threshold = cases[i]
        params = SamplingParams(threshold, max_tokens)
        (r,) = llm.make_requests([prompt_ids(n, offset=i)], params, chat=False)
        r.request_id = str(i)
        requests.append(r)
    llm.run(requests, len(requests))
    return requests


def plain_and_graphed(path: Path, config: EngineConfig, cases):
    """The cases' (output window, steps) without the graph path and with its static buffers
    (`config.cuda_graphs` rows; eager on a CPU), and the graph path's calls as (rows, queried
    tokens each)."""
    outcomes, calls = [], []
    for cuda_graphs in (0, config.cuda_graphs):
        llm = LLM(path, replace(config, cuda_graphs=cuda_graphs))
        graphs = llm.engine._graphs
        if graphs is not None:
            graphs.hidden = _counted(graphs.hidden, calls)
        requests = run_cases(llm, cases)
        outcomes.append([(r.output_ids.tolist(), r.num_steps) for r in requests])
    return *outcomes, calls


def _counted(hidden, calls: list):
    def counted(seqs, ids, *args):
        calls.append((len(seqs), ids.shape[1]))
        return hidden(seqs, ids, *args)

    return counted


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
