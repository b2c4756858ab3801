"""Shared fakes and factories.

- `tiny_checkpoint`: a randomly initialised LLaDA checkpoint in the exact Hugging Face layout
  (config.json, two safetensors shards + index, tokenizer files), small enough to run in tests.
- `FakeModel`: a deterministic stand-in for the model with known confidences per position, so a
  test knows exactly which positions clear a threshold.
- `make_request`: a Request factory.
- `PLANNER_PROFILE`, `planner_config`: a planning problem small enough to solve by hand.
- `HANG_GUARD_S`, `wait_until`: how long a test waits on real work before it calls it hung.
- `listening_addresses`, `LOOPBACK`: where a process listens (Linux /proc).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from dilaserve.cluster.requests import RequestHandle
from dilaserve.config import EngineConfig
from dilaserve.control.planner import PlannerConfig
from dilaserve.control.profile import LatencyProfile
from dilaserve.control.step_costs import StepCosts
from dilaserve.engine.engine import Engine
from dilaserve.models.checkpoint import save_checkpoint
from dilaserve.models.common import ForwardResult
from dilaserve.models.config import LLaDAConfig
from dilaserve.models.llada import LLaDAModelLM
from dilaserve.models.tokenizer import SpecialIds, Tokenizer
from dilaserve.protocol import KVCacheMode
from dilaserve.request import Request
from dilaserve.tasks import arith
from dilaserve.training.tokenizer import train_tokenizer

# Test tensors are tiny: one thread is as fast and never oversubscribes a busy machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Each test starts on one thread, whatever an earlier one ran (`generate --threads`,
    `train()` and others set torch's threads for the whole process)."""
    torch.set_num_threads(1)


# Waits on real work (a process loading the model, a step on a busy machine) are hang guards,
# never speed checks: a test asserts what happened, and this bound only stops one that hangs.
# It is long enough for a 2-core machine at load 9 (`make test-under-load`); a slower one can
# stretch it with DILASERVE_TEST_PATIENCE (a factor).
HANG_GUARD_S = 600.0 * float(os.environ.get("DILASERVE_TEST_PATIENCE", "1"))


def wait_until(condition, timeout: float = HANG_GUARD_S) -> None:
    """Return once `condition()` holds; fail the test if `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s"
        time.sleep(0.02)


def listening_addresses(pid: int) -> set[str]:
    """The local addresses of the TCP sockets process `pid` listens on (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.add(fields[1].split(":")[0])
    return found


# 127.0.0.1, ::1 and ::ffff:127.0.0.1 as /proc/net spells them
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
BLOCK_LEN = 8


def write_tiny_checkpoint(folder: Path, num_shards: int = 2, seed: int = 0) -> Path:
    problems = arith.generate(300, seed=1)
    train_tokenizer([p.question for p in problems] + [p.target for p in problems], folder, 200)
    tok = Tokenizer(folder)
    cfg = LLaDAConfig(
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        n_layers=2,
        mlp_hidden_size=64,
        vocab_size=tok.vocab_size,
        embedding_size=tok.vocab_size + 8,
        mask_token_id=tok.special.mask,
        eos_token_id=tok.special.eos,
    )
    model = LLaDAModelLM(cfg)
    model.init_weights(seed, std=0.5)
    save_checkpoint(model, folder, num_shards=num_shards)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llada"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_checkpoint) -> Tokenizer:
    return Tokenizer(tiny_checkpoint)


def tiny_engine(path: Path, kv_cache: str = "none", **kwargs) -> Engine:
    return Engine.from_checkpoint(
        path, EngineConfig(kv_cache=kv_cache, block_len=BLOCK_LEN, **kwargs)
    )


class FakeModel(torch.nn.Module):
    """Position p of the output gets token `token_of(p)` with probability `conf_of(p)`.

    Confidences depend only on absolute position, so the engine's choices are predictable:
    with threshold g, exactly the masked positions of the current block with conf > g commit.
    """

    VOCAB = 16
    MASK, EOS = 15, 1

    def __init__(self, conf_of, token_of=lambda p: 2 + p % 10):
        super().__init__()
        self.conf_of, self.token_of = conf_of, token_of
        self.config = LLaDAConfig(
            d_model=1,
            n_heads=1,
            n_layers=1,
            mlp_hidden_size=1,
            vocab_size=self.VOCAB,
            mask_token_id=self.MASK,
            eos_token_id=self.EOS,
        )
        self.calls: list[tuple[int, int, bool]] = []  # (rows, seq_len, with_context)

    def forward(self, ids, positions, valid, context=None, keep_kv=False):
        self.calls.append((ids.shape[0], ids.shape[1], context is not None))
        hidden = positions.float()[..., None]
        kv = [torch.zeros(ids.shape[0], 1, ids.shape[1], 1)] if keep_kv else None
        return ForwardResult(hidden, kv, kv)

    def logits(self, hidden):
        pos = hidden[..., 0].long()
        conf = torch.tensor([[self.conf_of(int(p)) for p in row] for row in pos])
        tokens = torch.tensor([[self.token_of(int(p)) for p in row] for row in pos])
        rest = ((1 - conf) / (self.VOCAB - 2)).clamp_min(1e-12).log()
        out = rest[..., None].expand(*pos.shape, self.VOCAB).clone()
        out.scatter_(-1, tokens[..., None], conf.log()[..., None])
        out[..., self.MASK] = -1e9  # the mask token carries no probability mass
        return out


def fake_engine(
    conf_of, token_of=None, kv_cache: str = "none", **kwargs
) -> tuple[Engine, FakeModel]:
    model = FakeModel(conf_of) if token_of is None else FakeModel(conf_of, token_of)
    special = SpecialIds(mask=FakeModel.MASK, eos=FakeModel.EOS, eot=None)
    config = EngineConfig(kv_cache=kv_cache, block_len=BLOCK_LEN, **kwargs)
    return Engine(model, special, config), model


def make_request(
    request_id: str = "r0",
    prompt_len: int = 5,
    gen_len: int = 2 * BLOCK_LEN,
    threshold: float = 0.9,
    mask_id: int = FakeModel.MASK,
    **kwargs,
) -> Request:
    prompt = tuple(2 + i % 10 for i in range(prompt_len))
    return Request(request_id, prompt, gen_len, BLOCK_LEN, mask_id, threshold, **kwargs)


def refused_handle(error: Exception, **submitted) -> RequestHandle:
    """A request's handle as admission leaves one it refused with `error` (`Answers.refuse`),
    for a stand-in cluster's `submit(prompt, **submitted)` (its `loop` and `stream` kept)."""
    keep = {k: submitted[k] for k in ("loop", "stream") if k in submitted}
    handle = RequestHandle(make_request("r"), 0.0, **keep)
    handle.admission.set_exception(error)
    handle.future.set_exception(error)
    return handle


# -- the planner's hand-solvable case (tests/test_planner.py explains the numbers) ----------

PLANNER_PROFILE = LatencyProfile.from_dict(
    {
        "entries": [
            {"tp": 1, "kind": "full", "batch_tokens": 128, "ms": 100.0},
            {"tp": 2, "kind": "full", "batch_tokens": 128, "ms": 60.0},
            {"tp": 1, "kind": "recompute", "batch_tokens": 128, "ms": 100.0},
            {"tp": 1, "kind": "cache", "batch_tokens": 32, "ms": 20.0},
        ]
    }
)
TOKENS_PER_STEP = {0.5: 4.0, 0.9: 2.0}


def planner_config(gpus_per_node=(2,), **kw) -> PlannerConfig:
    kw.setdefault("costs", StepCosts(KVCacheMode.NONE))
    kw.setdefault("tolerance", 1e-7)  # hold objective 1 exactly, so hand numbers hold
    return PlannerConfig(gpus_per_node, TOKENS_PER_STEP, tp_degrees=(1, 2), **kw)


def import_benchmark(name: str):
    """`benchmarks/<name>.py` as a module (a benchmark imports its siblings, so benchmarks/ is
    on sys.path while it loads)."""
    import importlib
    import sys

    folder = str(Path(__file__).resolve().parent.parent / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


class AnyIntake:
    """The intake of a stand-in cluster for the API: every prompt fits, and is cheap to check
    (submitted on the event loop, as a short prompt is)."""

    @staticmethod
    def check_text_length(chars: int, param: str = "prompt") -> None:
        pass

    @staticmethod
    def is_cheap(prompt) -> bool:
        return True
