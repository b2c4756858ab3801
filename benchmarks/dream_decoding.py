"""Dream's decoding through dilaserve's engine against Fast-dLLM's Dream decoders.

Part of `published_parity.py` (which imports the published code): for every prompt length,
output window and threshold of the grid below, in each setting (`none` with the default step
budget and with a smaller one, `prefix`, `dual`), dilaserve runs all the cases of a setting as
one batch, and Fast-dLLM runs each case alone on its `DreamModel`: `generation_utils` `_sample`
for `none` (the whole-window decoder; `steps = gen_len / budget`), `generation_utils_block`
`_sample` (its `dual_cache` off or on) for `prefix` and `dual`; `alg="confidence_threshold"`,
greedy. Neither stops early. A case is equal when the windows are the same token for token; its
forwards, when both ran as many forward passes.
"""

from __future__ import annotations

import contextlib
import io
import types
from itertools import product
from pathlib import Path

import torch
from family_checkpoints import dream_checkpoint, prompt_ids, quiet_mask

from dilaserve.config import EngineConfig, SamplingParams
from dilaserve.engine.llm import LLM

PROMPT_LENS = (5, 7, 12)
GEN_LENS = (16, 24)
THRESHOLDS = (0.9, 0.7, 0.5)
SETTINGS = {  # name: (cache mode, dilaserve's step budget; None: block_len, the default)
    "none": ("none", None),
    "none, budget 4": ("none", 4),
    "prefix": ("prefix", None),
    "dual": ("dual", None),
}


def cases() -> list[dict]:
    grid = product(PROMPT_LENS, GEN_LENS, THRESHOLDS)
    return [dict(prompt_len=p, gen_len=g, threshold=t) for p, g, t in grid]


def ours(path: Path, block: int, setting: str, grid: list[dict]) -> list[tuple[list[int], int]]:
    mode, budget = SETTINGS[setting]
    config = EngineConfig(mode, block_len=block, early_finish=False, step_budget=budget)
    llm = LLM(path, config)
    requests = []
    for i, case in enumerate(grid):
        params = SamplingParams(case["threshold"], case["gen_len"])
        (request,) = llm.make_requests([prompt_ids(case["prompt_len"], offset=i)], params)
        request.request_id = str(i)
        requests.append(request)
    llm.run(requests, max_batch=len(requests))
    return [(r.output_ids.tolist(), r.num_steps) for r in requests]


def published(ref, generation) -> None:
    """A Fast-dLLM decoder module's methods on the published model (its evaluation binds them
    so: `generation_utils` without a cache, `generation_utils_block` with one)."""
    for name in ("diffusion_generate", "_sample"):
        setattr(ref, name, types.MethodType(getattr(generation.DreamGenerationMixin, name), ref))


def theirs(ref, block: int, setting: str, mask: int, i: int, case: dict):
    """The published window, its forward count, and whether the mask token was ever the top-1
    of a masked position."""
    calls, mask_top1 = 0, False
    forward = ref.forward

    def counted(ids, *args, **kwargs):
        nonlocal calls, mask_top1
        calls += 1
        out = forward(ids, *args, **kwargs)
        top = out.logits.argmax(-1)
        top = torch.cat((top[:, :1], top[:, :-1]), dim=1)  # Dream reads position i at i - 1
        mask_top1 |= bool(((top == mask) & (ids == mask)).any())
        return out

    prompt = prompt_ids(case["prompt_len"], offset=i)
    mode, budget = SETTINGS[setting]
    steps = case["gen_len"] // (budget or block) if mode == "none" else case["gen_len"]
    ref.forward = counted
    try:  # (the whole-window decoder prints its steps and time)
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            out = ref.diffusion_generate(
                torch.tensor([prompt]),
                max_length=len(prompt) + case["gen_len"],
                steps=steps,
                mask_token_id=mask,
                temperature=0.0,
                top_p=None,  # as Fast-dLLM's eval.py passes them: else the model config's
                top_k=None,  # defaults (top_k 50) cut the softmax that ranks the positions
                alg="confidence_threshold",
                threshold=case["threshold"],
                block_length=block,
                dual_cache=mode == "dual",
                output_history=False,
                return_dict_in_generate=False,
            )
    finally:
        del ref.forward
    return out[0, len(prompt) :].tolist(), calls, mask_top1


def compare(ref_for, generation: dict, block: int, tmp: Path, quiet: bool) -> dict:
    """Every case in every setting on a random checkpoint (`quiet`: its mask row scaled down);
    `ref_for(path)`: the published model of a checkpoint; `generation`: Fast-dLLM's decoder
    module by cache mode."""
    grid = cases()
    path = dream_checkpoint(tmp / ("dream-quiet" if quiet else "dream-random"))
    mask = LLM(path).special.mask
    if quiet:
        quiet_mask(path, mask)
    ref = ref_for(path)
    summary = {"mask_row_scaled": quiet, "modes": {}}
    for setting, (mode, _) in SETTINGS.items():
        published(ref, generation[mode])
        rows = []
        for i, (case, (tokens, steps)) in enumerate(zip(grid, ours(path, block, setting, grid))):
            window, calls, mask_top1 = theirs(ref, block, setting, mask, i, case)
            rows.append(
                {
                    **case,
                    "tokens_equal": tokens == window,
                    "forwards": [steps, calls],
                    "published_mask_top1": mask_top1,
                }
            )
        summary["modes"][setting] = {
            "cases": len(rows),
            "tokens_equal": sum(r["tokens_equal"] for r in rows),
            "forwards_equal": sum(r["forwards"][0] == r["forwards"][1] for r in rows),
            "published_mask_top1": sum(r["published_mask_top1"] for r in rows),
            "forwards": [sum(r["forwards"][k] for r in rows) for k in (0, 1)],  # ours, published
            "differing": [r for r in rows if not r["tokens_equal"] or len(set(r["forwards"])) > 1],
        }
    return summary
