"""Frozen, validated configuration for every knob; errors name the field that is wrong."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dilaserve.protocol import EosStop, KVCacheMode

ASSETS = Path(__file__).resolve().parent / "assets"
BUNDLED_MODEL = ASSETS / "tiny-llada"  # the small dLLM this project trains and ships
BUNDLED_LLADA2_MODEL = ASSETS / "tiny-llada2"  # its block-diffusion (LLaDA2 MoE) sibling
BUNDLED_CALIBRATION = BUNDLED_MODEL / "dilaserve-calibration" / "cpu-float32"  # `calibrate`
BUNDLED_PREDICTOR = BUNDLED_CALIBRATION / "predictor"  # its step predictor
BUNDLED_PROFILE = BUNDLED_CALIBRATION / "profile.json"  # its latency on a 2-core CPU
BUNDLED_DWS = ASSETS / "tiny-llada-dws"  # its DWS cost predictor (dilaserve train-dws)
BUNDLED_DWS_COST = ASSETS / "tiny-llada-dws-cost.json"  # the DWS cost kernel on that CPU
DEFAULT_BLOCK_LEN = 32  # tokens per semi-autoregressive block (DESIGN section 1)
DEFAULT_THRESHOLD = 0.9  # a request's confidence threshold when nothing else sets it
# the thresholds calibration records trajectories at and step predictors are trained on
MEASURED_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)
DTYPES = ("float32", "bfloat16", "float16")
EDITING_CHOICES = (None, "speed", "quality", "off")  # EngineConfig.editing


def setting(default, help: str, **option):
    """A dataclass field whose command-line option is generated (`cli_args.field_option`):
    its default, its help, and any further argparse keywords (choices, metavar)."""
    return field(default=default, metadata={"help": help, **option})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One model instance.

    kv_cache: "none" (every step a full forward), "prefix" or "dual" (Fast-dLLM-style approximate
    cache, refreshed at each block's first step). early_finish: a request may end before its
    window is decoded, by the `eos_stop` rule (None: the model family's published one, e.g.
    LLaDA2's stop after a block holding EOS; LLaDA's and Dream's: once a stop token and all
    before it are committed); off, the whole window is decoded. steps: a family with a per-block
    step schedule (LLaDA2's `steps`) gives each block this many steps (None: `block_len`, the
    published default); others ignore it. editing: token editing (LLaDA2.1's published decoding),
    "speed" or "quality" (the published modes: mask-to-token / edit thresholds 0.5 / 0.0 and
    0.7 / 0.5; a request's threshold sets the first and moves the second in the mode's ratio) or
    "off"; None: the checkpoint's own (speed for a config.json of `model_type` llada21_moe,
    else off); a family without token editing refuses a mode. step_budget: a family whose `none`
    mode decodes the whole window (Dream's, Fast-dLLM's `generation_utils.py`) commits at most
    this many tokens a step plus the rejections carried over (None: `block_len`, the published
    setting's `gen_len / steps`); it must divide `block_len`. cuda_graphs: cached steps of
    up to this many requests, each with at most `cuda_graph_context` cached tokens, replay CUDA
    graphs (engine/graphs.py; 0: off; tensor-parallel instances and CPUs run the same steps without
    graphs). max_forward_tokens: a step batch runs as forward passes of at most this many tokens
    each (memory, not scheduling: the scheduler's batch limit is `ClusterConfig.max_batch_tokens`).
    kv_memory: GiB the requests' K/V slots and the graphs' static buffers may take together on
    an instance (engine/kv_budget.py; None: no bound); past it the least recently stepped
    requests' caches are dropped, and their next steps recompute.
    """

    kv_cache: KVCacheMode = KVCacheMode.DUAL
    block_len: int = DEFAULT_BLOCK_LEN
    dtype: str = "float32"
    device: str = "cpu"
    early_finish: bool = True
    eos_stop: EosStop | None = None
    steps: int | None = None
    editing: str | None = None
    step_budget: int | None = None
    max_forward_tokens: int = 65_536
    cuda_graphs: int = 0
    cuda_graph_context: int = 2048
    kv_memory: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "kv_cache", KVCacheMode(self.kv_cache))
        if self.eos_stop is not None:
            object.__setattr__(self, "eos_stop", EosStop(self.eos_stop))
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"{self.steps=} must be positive (or None: block_len)")
        if self.editing not in EDITING_CHOICES:
            raise ValueError(f"{self.editing=} must be one of {EDITING_CHOICES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"{self.dtype=} must be one of {DTYPES}")
        if self.block_len <= 0:
            raise ValueError(f"{self.block_len=} must be positive")
        if self.step_budget is not None and not (
            0 < self.step_budget <= self.block_len and self.block_len % self.step_budget == 0
        ):
            raise ValueError(
                f"{self.step_budget=} must be a positive divisor of {self.block_len=} (or None)"
            )
        if self.max_forward_tokens <= 0:
            raise ValueError(f"{self.max_forward_tokens=} must be positive")
        if self.kv_memory is not None and not self.kv_memory > 0:
            raise ValueError(f"{self.kv_memory=} must be positive GiB (or None: no bound)")
        if self.cuda_graphs < 0 or self.cuda_graph_context <= 0:
            raise ValueError(
                f"{self.cuda_graphs=} must be >= 0 and {self.cuda_graph_context=} positive"
            )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation settings.

    threshold: commit every masked position whose confidence exceeds it (at least one per step).
    max_tokens: the answer's length at most. The output window is whole blocks: max_tokens
    rounded up, or, where blocks sit at absolute positions (LLaDA2), up to the first block
    boundary after prompt + max_tokens; the answer is cut to max_tokens.
    steps: steps per block of a family's step schedule (LLaDA2's `steps`; None: the engine's).
    """

    threshold: float = DEFAULT_THRESHOLD
    max_tokens: int = 64
    steps: int | None = None

    def __post_init__(self):
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"{self.threshold=} must be in (0, 1]")
        if self.max_tokens <= 0:
            raise ValueError(f"{self.max_tokens=} must be positive")
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"{self.steps=} must be positive (or None: the engine's)")

    def gen_len(self, block_len: int) -> int:
        return -(-self.max_tokens // block_len) * block_len
