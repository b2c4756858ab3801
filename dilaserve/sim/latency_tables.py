"""The tables in `latency.py`'s docstring, computed from the presets: TP ratios and one
request's speed for the LLaDA-8B / Dream-7B presets (`summary`), and milliseconds per step for
the block-diffusion ones (`block_summary`). `python -m dilaserve.sim.latency_tables` prints
them with the solved constants; a test holds the docstring to them."""

from __future__ import annotations

import sys

from dilaserve.protocol import StepKind
from dilaserve.sim.latency import (
    BLOCK_LEN,
    BLOCK_PRESETS,
    CALIBRATION,
    GSM8K_GEN_TOKENS,
    GSM8K_PROMPT_TOKENS,
    PRESETS,
    REF_CONTEXT,
    request_seconds,
)
from dilaserve.sim.profiles import preset_profile


def summary() -> str:
    """The docstring's table: TP ratios at the reference batches and one request's tok/s."""
    rows = [
        "| preset | cache 2 | cache 4 | cache 8 | recompute 2 | recompute 4 | tok/s 1 | tok/s 4 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in PRESETS:
        p = preset_profile(name)

        def ratio(tp, n, kind, p=p):
            return p.step_latency(tp, n, kind) / p.step_latency(1, n, kind)

        tok = [GSM8K_GEN_TOKENS / request_seconds(p, tp) for tp in (1, 4)]
        rows.append(
            f"| {name} | {ratio(2, BLOCK_LEN, StepKind.CACHE):.3f} "
            f"| {ratio(4, BLOCK_LEN, StepKind.CACHE):.3f} "
            f"| {ratio(8, BLOCK_LEN, StepKind.CACHE):.3f} "
            f"| {ratio(2, REF_CONTEXT, StepKind.RECOMPUTE):.3f} "
            f"| {ratio(4, REF_CONTEXT, StepKind.RECOMPUTE):.3f} "
            f"| {tok[0]:.1f} | {tok[1]:.1f} |"
        )
    return "\n".join(rows)


# (kind, batch tokens) of the block-diffusion table: one request's and 64 requests' steps
BLOCK_REFERENCE_STEPS = (
    (StepKind.BLOCK, BLOCK_LEN),
    (StepKind.BLOCK, 64 * BLOCK_LEN),
    (StepKind.COMMIT, 2 * BLOCK_LEN),
    (StepKind.COMMIT, 64 * 2 * BLOCK_LEN),
    (StepKind.PREFILL, GSM8K_PROMPT_TOKENS + GSM8K_GEN_TOKENS),
    (StepKind.PREFILL, 4096),
)


def block_summary() -> str:
    """The docstring's block-diffusion table: ms per step at the smallest TP degree that holds
    the weights, and the block step of 64 requests at twice that degree over it."""
    heads = " | ".join(f"{kind.value} {n}" for kind, n in BLOCK_REFERENCE_STEPS)
    rows = [f"| preset, TP | {heads} | 2x |"]
    rows.append("|---" * (len(BLOCK_REFERENCE_STEPS) + 2) + "|")
    for name in BLOCK_PRESETS:
        p = preset_profile(name)
        tp = p.tp_degrees[0]
        ms = " | ".join(f"{p.step_latency(tp, n, k) * 1e3:.1f}" for k, n in BLOCK_REFERENCE_STEPS)
        batch = 64 * BLOCK_LEN
        ratio = p.step_latency(2 * tp, batch, StepKind.BLOCK) / p.step_latency(
            tp, batch, StepKind.BLOCK
        )
        rows.append(f"| {name}, TP-{tp} | {ms} | {ratio:.3f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    c = CALIBRATION
    sys.stdout.write(
        f"MFU {c.mfu:.4f}, HBM efficiency {c.hbm_eff:.4f}, "
        f"overhead {c.overhead_s * 1e3:.3f} ms\n{summary()}\n\n{block_summary()}\n"
    )
