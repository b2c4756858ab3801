"""Analytic latency presets: LLaDA-8B and Dream-7B on H100 and GH200, as `LatencyProfile`s.

Without a GPU to measure (`benchmarks/gpu_profile.py`), the simulator and the planner need step
latencies from somewhere. These presets derive them from the model shapes and the GPU's data
sheet, then fix three free constants against published numbers. `profiles.py` assembles them
into profiles by name (`load_profile`), beside the measured ones the package ships.

Cost of one step
----------------
A denoising step runs the bidirectional transformer over `n` batch tokens (the profile's x
axis): for full and recompute steps the whole sequences (prompt + output window) summed over
the batch; for dual-cache steps `B` = 32 tokens per request, whose queries attend to that
request's cached K/V of the whole sequence. The x axis does not say how long each sequence is,
so attention is costed at a reference sequence length `REF_CONTEXT` = 768 tokens (between
ShareGPT's mean prompt + output of ~400 and the GSM8K/MBPP 5-/3-shot requests' ~1,000-1,300;
papers.md 1.11): a full/recompute step over `n` tokens is `n / 768` sequences of 768 tokens (one
sequence of `n` when `n` < 768), a cache step is `n / 32` requests with 768 cached tokens each.
On TP degree `d`, with `L` layers, hidden `h`, `P` parameters (`P_mm` of them in matmuls: all
but the input embedding) and K/V bytes per token `kv = L x 2 x kv_heads x head_dim x 2`:

    FLOPs     = 2 P_mm n + 4 L h n ctx          ctx = min(n, 768) full/recompute, 768 cache
    compute   = FLOPs / (d x peak x MFU)
    K/V bytes = n kv (full: written once for attention)
              | 2 n kv (recompute: also stored as the cache)
              | n kv + (n / 32) 768 kv (cache: the block's K/V, plus each request's cache read)
    memory    = (2 P / d + K/V bytes x s(d)) / (HBM bandwidth x HBM_EFF)
    all-reduce= 2 L x [2 (d-1)/d x n h 2 bytes / link + ALLREDUCE_LATENCY]   (0 at d = 1)
    step      = max(compute, memory) + all-reduce + STEP_OVERHEAD

(MFU, HBM_EFF and STEP_OVERHEAD are `CALIBRATION`'s fields.)

where `s(d) = max(kv_heads / d, 1) / kv_heads` is the share of K/V heads a GPU holds (Dream's 4
K/V heads are replicated beyond TP-4). The link is NVLink at 450 GB/s per direction within a
node (H100 SXM: 8 GPUs per HGX node; GH200: the same NVLink bandwidth assumed within the
paper's 4-superchip nodes) and the cluster's 200 Gb/s interconnect (papers.md 1.11; 25 GB/s,
assumed per GPU) for a TP group wider than a node (GH200 at TP-8). Activation traffic is not
counted: it is small beside the weights at these batch sizes, and otherwise absorbed by the
calibrated efficiencies.

Calibration
-----------
`MFU`, `HBM_EFF` and `STEP_OVERHEAD` are free. Three published numbers fix them; `calibrate()`
solves the three linear equations at import (LLaDA-8B on H100, TP-1 unless said):

(a) DiLaServe Fig. 4a: TP cuts per-step latency by ~25% at TP-2 and ~55% at TP-4. No model of
    this form hits both. With a share `a` of the TP-1 step that TP does not divide (overhead)
    and `1 - a` that it does, the TP-2 figure needs a + (1-a)/2 = 0.75, a = 0.5, and the TP-4
    figure a + (1-a)/4 = 0.45, a = 0.27; the all-reduce, which grows with `d`, only widens the
    gap, and a per-degree efficiency factor would have to make TP-2 *less* efficient than
    TP-4, which nothing in the model explains. So the presets hit the TP-4 figure, the one the
    paper's experiments lean on (Fig. 4b: 2 x TP-4 vs 8 x TP-1; Fig. 8: TP-1/TP-4 mixes), at
    the reference batch of one request's dual-cache step (32 tokens against 768 cached; cache
    steps are ~90% of a request's steps): latency(TP-4) = 0.45 latency(TP-1). TP-2 then lands
    where the model puts it, a 36% cut rather than 25%: TP-2 is more attractive here than in
    the paper, and whole-sequence steps (compute-bound, less overhead-dominated) scale better
    than Fig. 4a's "No Cache" panel (-64% at TP-4 at 768 tokens).
(b) Fast-dLLM (peers.md section 4): LLaDA-8B-Instruct on GSM8K 5-shot, gen 256, block 32, dual
    cache + threshold 0.9, batch 1: 54.4 tokens/s, i.e. 4.71 s a request. The request: a
    1,020-token prompt (papers.md 1.11, Table 3) + 256 output tokens; threshold 0.9 commits
    `TOKENS_PER_STEP_0_9` = 3.0 tokens per step on average (no published Fast-dLLM NFE for this
    setting was found; DiLaServe Fig. 3b's ~80 steps at 0.9 would be 3.2), so 256 / 3 = 85.3
    steps: 8 recompute steps over the whole 1,276-token sequence (one per block) and 77.3 cache
    steps of 32 tokens against 1,276 cached tokens (costed at the request's own length here).
(c) The same README row's no-cache baseline, 6.73 tokens/s with one token per step: 256 full
    steps of 1,276 tokens, 148.6 ms each. This splits (b)'s time between the compute-bound
    whole-sequence steps and the memory/overhead-bound cache steps from data rather than from
    an assumed MFU : bandwidth ratio.

Solution: MFU 0.147, HBM efficiency 0.147, step overhead 11.48 ms. A one-request cache step on
H100 is then 44.9 ms at TP-1 and 20.2 ms at TP-4, a 1,276-token full step 148.6 ms. The
efficiencies are low because Fast-dLLM's batch-1 numbers come from a research implementation
(PyTorch eager, Hugging Face model code) on hardware the README does not name: the presets keep
a GPU's roofline shape (the compute/memory ridge sits at ~300 batch tokens, batching is nearly
free below it) but run at that implementation's speed; tuned kernels (MFU ~0.5, 80% of HBM)
would be 3-5x faster on the same GPU. The same three constants serve every preset: GH200 is
faster only through its bandwidth, Dream-7B through its shapes.

Ratios of step latency to TP-1 by TP degree at the reference batches (cache: one request, 32
tokens; recompute: one 768-token sequence), and the single request of (b) as 256 / seconds at
TP-1 and TP-4, computed from each preset's profile (interpolated; its cache context is 768, not
1,276, hence 55.1 rather than 54.4; Dream-7B is costed on the same request and tokens per step,
for lack of a Dream figure). GH200 at TP-8 spans two 4-GPU nodes and pays the 25 GB/s link.
`python -m dilaserve.sim.latency_tables` prints this table:

| preset | cache 2 | cache 4 | cache 8 | recompute 2 | recompute 4 | tok/s 1 | tok/s 4 |
|---|---|---|---|---|---|---|---|
| llada-8b-h100 | 0.636 | 0.450 | 0.357 | 0.575 | 0.361 | 55.1 | 131.6 |
| llada-8b-gh200 | 0.654 | 0.478 | 0.417 | 0.575 | 0.361 | 60.6 | 139.1 |
| dream-7b-h100 | 0.642 | 0.460 | 0.369 | 0.577 | 0.363 | 58.3 | 136.6 |
| dream-7b-gh200 | 0.661 | 0.488 | 0.425 | 0.577 | 0.363 | 63.9 | 144.1 |

Block diffusion (LLaDA2.x): ANALYTIC presets
---------------------------------------------
`BLOCK_PRESETS` price LLaDA2.0-mini and -flash (`sim/hardware.py`: published shapes; flash's
assumed to be Ling-flash-2.0's) on H100 and H200. None of it is measured: the presets say
"analytic preset" in their meta until a measured LLaDA2.x profile replaces them. The same step
formula, with these changes for a mixture of experts and an exact, block-causal cache:
- FLOPs count the ACTIVE parameters (`2 P_active_mm n`: the dense layers, attention, shared and
  top-k experts, the output head), plus attention as above;
- weight bytes are the dense weights plus the distinct routed experts the batch's `n` tokens
  route to, E (1 - (1 - k/E)^n) a layer (`hardware.py`: the uniform-routing assumption): at one
  request's block (32 tokens) 64% of LLaDA2.0-mini's experts, 87% at a commit (64), all beyond;
- step kinds: prefill (the whole sequence, causal between blocks, so a query attends to half
  its sequence on average, K/V stored), block (32 tokens a request against its cached context
  of 768), commit (64 tokens a request: the finished block's K/V stored, the cache read), and
  full for kv_cache none;
- a TP degree is offered only if the weights fit in 90% of each GPU's HBM (assumed headroom):
  LLaDA2.0-flash's 206 GB need TP-4 on H100 (80 GB) and TP-2 on H200 (141 GB);
- MFU, HBM efficiency and overhead stay `CALIBRATION`'s, fitted to LLaDA-8B through Fast-dLLM's
  research implementation: these presets run at that implementation's speed, not SGLang's.

Milliseconds per step at the smallest TP degree that holds the weights (kind and batch tokens:
one request's block and commit, 64 requests' block and commit, a 1,276-token and a 4,096-token
prefill), and the 64-request block step at twice that TP degree over it:

| preset, TP | block 32 | block 2048 | commit 64 | commit 4096 | prefill 1276 | prefill 4096 | 2x |
|---|---|---|---|---|---|---|---|
| llada2-mini-h100, TP-1 | 55.2 | 82.0 | 69.6 | 82.3 | 77.9 | 78.4 | 0.582 |
| llada2-mini-h200, TP-1 | 42.0 | 60.7 | 52.1 | 77.6 | 57.9 | 75.8 | 0.610 |
| llada2-flash-h100, TP-4 | 79.9 | 121.9 | 103.4 | 125.6 | 118.9 | 124.1 | 0.575 |
| llada2-flash-h200, TP-2 | 106.8 | 162.9 | 139.6 | 177.3 | 159.7 | 174.5 | 0.551 |

Units are SI throughout (seconds, bytes, FLOP/s); profiles store milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dilaserve.config import DEFAULT_BLOCK_LEN
from dilaserve.control.profile import LatencyProfile
from dilaserve.protocol import CACHED_KINDS, StepKind
from dilaserve.sim.behaviour import TOKENS_PER_STEP_09
from dilaserve.sim.hardware import (
    BYTES_BF16,
    DREAM_7B,
    GH200,
    H100_SXM,
    H200_SXM,
    LLADA2_FLASH,
    LLADA2_MINI,
    LLADA_8B,
    GPUSpec,
    ModelShape,
)

BLOCK_LEN = DEFAULT_BLOCK_LEN
REF_CONTEXT = 768  # reference sequence length for attention (tokens)

# Calibration targets.
TP4_STEP_RATIO = 0.45  # DiLaServe Fig. 4a: TP-4 cuts per-step latency by ~55%
TP2_STEP_RATIO_PAPER = 0.75  # DiLaServe Fig. 4a: TP-2 cuts ~25% (not reachable; see docstring)
FASTDLLM_TOK_S = 54.4  # Fast-dLLM README, LLaDA-8B-Instruct GSM8K 5-shot, gen 256, dual cache
FASTDLLM_BASELINE_TOK_S = 6.73  # same setting, no cache, one token per step (256 steps)
TOKENS_PER_STEP_0_9 = TOKENS_PER_STEP_09  # the behaviour model's, so both stay calibrated together
GSM8K_PROMPT_TOKENS = 1020  # papers.md 1.11, Table 3 average prompt
GSM8K_GEN_TOKENS = 256

ALLREDUCE_LATENCY_S = 5e-6  # per all-reduce call (NCCL, small message, within a node)


PRESETS: dict[str, tuple[ModelShape, GPUSpec]] = {
    "llada-8b-h100": (LLADA_8B, H100_SXM),
    "llada-8b-gh200": (LLADA_8B, GH200),
    "dream-7b-h100": (DREAM_7B, H100_SXM),
    "dream-7b-gh200": (DREAM_7B, GH200),
}
# Block-causal MoE models (exact cache): prefill, block and commit steps, and full steps for
# kv_cache none. ANALYTIC: no LLaDA2.x step has been measured; the constants are `CALIBRATION`'s.
BLOCK_PRESETS: dict[str, tuple[ModelShape, GPUSpec]] = {
    "llada2-mini-h100": (LLADA2_MINI, H100_SXM),
    "llada2-mini-h200": (LLADA2_MINI, H200_SXM),
    "llada2-flash-h100": (LLADA2_FLASH, H100_SXM),
    "llada2-flash-h200": (LLADA2_FLASH, H200_SXM),
}


@dataclass(frozen=True, slots=True)
class Calibration:
    mfu: float  # achieved fraction of peak FLOP/s
    hbm_eff: float  # achieved fraction of HBM bandwidth
    overhead_s: float  # fixed per step: launches, Python, sampling


@dataclass(frozen=True, slots=True)
class StepCost:
    """One step's terms, seconds and bytes (all per GPU of the TP group)."""

    flops: float
    weight_bytes: float
    kv_bytes: float
    compute_s: float
    memory_s: float
    allreduce_s: float
    overhead_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.allreduce_s + self.overhead_s


def _kv_tokens(kind: StepKind, n: float, context: int, block_len: int) -> float:
    """Tokens whose K/V a step writes or reads."""
    if kind is StepKind.FULL:
        return n
    if kind in (StepKind.RECOMPUTE, StepKind.PREFILL):
        return 2 * n
    if kind is StepKind.COMMIT:  # two blocks a request: the finished one's K/V stored
        return 1.5 * n + n / (2 * block_len) * context
    return n + n / block_len * context


def _attention_context(kind: StepKind, n: float, context: int) -> float:
    """Keys each query attends to: the cached context for block-sized steps; a whole-sequence
    step's own sequence, half of it on average when attention is (block-)causal."""
    if kind in CACHED_KINDS:
        return context
    own = min(n, context)
    return own / 2 if kind is StepKind.PREFILL else own


def step_cost(
    model: ModelShape,
    gpu: GPUSpec,
    tp: int,
    batch_tokens: float,
    kind: StepKind | str,
    *,
    context: int = REF_CONTEXT,
    block_len: int = BLOCK_LEN,
    calibration: Calibration | None = None,
) -> StepCost:
    """The terms of one step of `batch_tokens` tokens on a TP-`tp` group (module docstring)."""
    kind = StepKind(kind)
    cal = CALIBRATION if calibration is None else calibration
    if tp < 1 or batch_tokens <= 0:
        raise ValueError(f"tp ({tp}) and batch_tokens ({batch_tokens}) must be positive")
    n = float(batch_tokens)
    ctx = _attention_context(kind, n, context)
    flops = 2 * model.matmul_params * n + 4 * model.n_layers * model.hidden * n * ctx
    kv_share = max(model.n_kv_heads / tp, 1) / model.n_kv_heads
    weight_bytes = model.weight_bytes(n) / tp
    kv_bytes = _kv_tokens(kind, n, context, block_len) * model.kv_bytes_per_token * kv_share
    compute = flops / (tp * gpu.peak_flops * cal.mfu)
    memory = (weight_bytes + kv_bytes) / (gpu.hbm_bytes_per_s * cal.hbm_eff)
    allreduce = 0.0
    if tp > 1:
        link = gpu.link_bytes_per_s if tp <= gpu.gpus_per_node else gpu.internode_bytes_per_s
        message = n * model.hidden * BYTES_BF16
        per_call = 2 * (tp - 1) / tp * message / link + ALLREDUCE_LATENCY_S
        allreduce = 2 * model.n_layers * per_call
    return StepCost(flops / tp, weight_bytes, kv_bytes, compute, memory, allreduce, cal.overhead_s)


def step_seconds(
    model: ModelShape,
    gpu: GPUSpec,
    tp: int,
    batch_tokens: float,
    kind: StepKind | str,
    **kw,
) -> float:
    """Seconds of one step: max(compute, memory) + all-reduce + overhead."""
    return step_cost(model, gpu, tp, batch_tokens, kind, **kw).seconds


def request_steps(gen_tokens: int, tokens_per_step: float, block_len: int = BLOCK_LEN):
    """(recompute steps, cache steps) of one dual-cache request: one recompute per block."""
    blocks = math.ceil(gen_tokens / block_len)
    steps = max(gen_tokens / tokens_per_step, blocks)
    return blocks, steps - blocks


def request_seconds(
    profile: LatencyProfile,
    tp: int = 1,
    prompt_tokens: int = GSM8K_PROMPT_TOKENS,
    gen_tokens: int = GSM8K_GEN_TOKENS,
    tokens_per_step: float = TOKENS_PER_STEP_0_9,
) -> float:
    """One request alone on a TP-`tp` instance with the dual cache, from a profile."""
    recompute, cache = request_steps(gen_tokens, tokens_per_step, profile.block_len)
    recompute_s = profile.step_latency(tp, prompt_tokens + gen_tokens, StepKind.RECOMPUTE)
    cache_s = profile.step_latency(tp, profile.block_len, StepKind.CACHE)
    return recompute * recompute_s + cache * cache_s


def calibrate(
    model: ModelShape = LLADA_8B,
    gpu: GPUSpec = H100_SXM,
    tp4_ratio: float = TP4_STEP_RATIO,
    tok_s: float = FASTDLLM_TOK_S,
    baseline_tok_s: float = FASTDLLM_BASELINE_TOK_S,
    tokens_per_step: float = TOKENS_PER_STEP_0_9,
) -> Calibration:
    """Solve for (MFU, HBM efficiency, overhead) from the three targets of the docstring.

    With x = 1/MFU and y = 1/HBM_EFF, each step's time is o + x C or o + y M (C, M: its
    compute and memory time at full efficiency) on whichever side of the roofline it sits, so
    the targets are linear in (o, x, y). The sides are assumed (cache steps of one request
    memory-bound, whole-sequence steps compute-bound) and checked afterwards.
    """
    unit = Calibration(1.0, 1.0, 0.0)
    seq = GSM8K_PROMPT_TOKENS + GSM8K_GEN_TOKENS

    def terms(tp, n, kind, context=REF_CONTEXT):
        return step_cost(model, gpu, tp, n, kind, context=context, calibration=unit)

    cache1, cache4 = terms(1, BLOCK_LEN, StepKind.CACHE), terms(4, BLOCK_LEN, StepKind.CACHE)
    req_recompute = terms(1, seq, StepKind.RECOMPUTE, seq)
    req_cache = terms(1, BLOCK_LEN, StepKind.CACHE, seq)
    base_full = terms(1, seq, StepKind.FULL, seq)
    recompute, cache = request_steps(GSM8K_GEN_TOKENS, tokens_per_step)
    rows = [
        # (a) o + y M4 + ar4 = rho (o + y M1)
        ([1 - tp4_ratio, 0.0, cache4.memory_s - tp4_ratio * cache1.memory_s], -cache4.allreduce_s),
        # (b) one request with the dual cache at threshold 0.9 takes gen / tok_s
        (
            [recompute + cache, recompute * req_recompute.compute_s, cache * req_cache.memory_s],
            GSM8K_GEN_TOKENS / tok_s,
        ),
        # (c) the no-cache baseline: one full step per output token
        ([1.0, base_full.compute_s, 0.0], 1 / baseline_tok_s),
    ]
    o, x, y = np.linalg.solve([r[0] for r in rows], [r[1] for r in rows])
    if min(o, x, y) < 0:
        raise ValueError(f"calibration has no physical solution: {o=}, 1/MFU {x}, 1/HBM_EFF {y}")
    sides = [(cache1, False), (cache4, False), (req_cache, False)]
    sides += [(req_recompute, True), (base_full, True)]
    for c, compute_bound in sides:
        if (c.compute_s * x >= c.memory_s * y) != compute_bound:
            raise ValueError(f"calibration assumed the wrong roofline side for {c}")
    return Calibration(float(1 / x), float(1 / y), float(o))


CALIBRATION = calibrate()
