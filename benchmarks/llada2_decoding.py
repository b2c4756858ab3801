"""LLaDA2's decoding through dilaserve's engine against the published `generate`, case by case.

Part of `published_parity.py` (which loads the published model): for every prompt length,
`max_tokens`, `steps`, threshold and EOS mode of the grid below, dilaserve runs all the cases of
one EOS mode as one batch (the requests differ in prompt, window, steps and threshold) through
its exact block cache, and the published `generate` runs each case alone, without a cache. A
case is equal when the answers (the output cut after the first EOS, at most `max_tokens`) are
the same token for token, and its forwards equal when both ran as many forward passes.

The EOS modes: `none` (no early stop: the published `eos_id=-1`, dilaserve's early_finish off),
`block` (the published default: stop after a block holding EOS) and `step` (`eos_early_stop`).
Random weights rarely produce a given token, so the EOS cases use as EOS the token the no-stop
run produced most often, among those no prompt holds (a checkpoint written with that
`eos_token_id`).
"""

from __future__ import annotations

from collections import Counter
from itertools import product
from pathlib import Path

import torch
from family_checkpoints import llada2_checkpoint, prompt_ids, quiet_mask

from dilaserve.config import EngineConfig, SamplingParams
from dilaserve.engine.llm import LLM
from dilaserve.request import Request

PROMPT_LENS = (5, 8, 13)  # inside a block, on a boundary, inside the next
MAX_TOKENS = (16, 11)
STEPS = (8, 4, 3)  # = block length (8), and fewer: the schedule commits at least 2, 2-3
THRESHOLDS = (0.9, 0.5)
EOS_MODES = {"none": (False, False), "block": (True, False), "step": (True, True)}


def cases() -> list[dict]:
    grid = product(PROMPT_LENS, MAX_TOKENS, STEPS, THRESHOLDS)
    return [dict(prompt_len=p, max_tokens=m, steps=s, threshold=t) for p, m, s, t in grid]


def answer(tokens: list[int], max_tokens: int, eos: int) -> list[int]:
    """The output as the published `generate` returns it: cut after the first EOS."""
    tokens = tokens[:max_tokens]
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def ours(path: Path, block: int, mode: str, grid: list[dict]) -> list[tuple[list[int], int]]:
    early, _ = EOS_MODES[mode]
    eos_stop = "step" if mode == "step" else None  # None: the family's own, `block`
    config = EngineConfig(
        "block", block_len=block, early_finish=early, eos_stop=eos_stop, dtype="float32"
    )
    llm = LLM(path, config)
    requests = [_request(llm, i, case) for i, case in enumerate(grid)]
    llm.run(requests, max_batch=len(requests))
    return [(r.output_ids.tolist(), r.num_steps) for r in requests]


def _request(llm: LLM, i: int, case: dict) -> Request:
    """Case i as `LLM.generate` makes it (window, steps), with a batch-unique id."""
    params = SamplingParams(case["threshold"], case["max_tokens"], case["steps"])
    (request,) = llm.make_requests([prompt_ids(case["prompt_len"], offset=i)], params, chat=False)
    request.request_id = str(i)
    return request


def theirs(ref, block: int, mode: str, mask: int, eos: int, i: int, case: dict):
    """The published answer, its forward count, and whether the mask token was ever the top-1
    of a masked position (the published rule then "commits" the mask; dilaserve never does)."""
    calls, mask_top1 = 0, False
    forward = ref.forward

    def counted(ids, attention_mask, **kwargs):
        """Counts the forwards; gives the bf16 block mask (0 or -inf, exact in any float
        type) the model's dtype, which SDPA wants."""
        nonlocal calls, mask_top1
        calls += 1
        out = forward(ids, attention_mask=attention_mask.to(ref.dtype), **kwargs)
        top = out.logits[0, -block:].argmax(-1)
        mask_top1 |= bool(((top == mask) & (ids[0, -block:] == mask)).any())
        return out

    early, step_stop = EOS_MODES[mode]
    ref.forward = counted
    try:
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([prompt_ids(case["prompt_len"], offset=i)]),
                block_length=block,
                steps=case["steps"],
                gen_length=case["max_tokens"],
                threshold=case["threshold"],
                eos_early_stop=step_stop,
                eos_id=eos if early else -1,
                mask_id=mask,
                temperature=0.0,
            )[0].tolist()
    finally:
        del ref.forward
    return out, calls, mask_top1


def frequent_token(outputs, grid: list[dict]) -> int:
    """The token the outputs hold most often, among those no prompt holds (the published step
    stop looks for EOS in the prompt too)."""
    in_prompts = {t for i, c in enumerate(grid) for t in prompt_ids(c["prompt_len"], offset=i)}
    counts = Counter(t for out, _ in outputs for t in out if t not in in_prompts)
    return counts.most_common(1)[0][0]


def checkpoint(folder: Path, quiet: bool, **overrides) -> Path:
    path = llada2_checkpoint(folder, **overrides)
    return quiet_mask(path, LLM(path).special.mask) if quiet else path


def compare(ref_for, block: int, tmp: Path, quiet: bool) -> dict:
    """Every case in every EOS mode on a random checkpoint (`quiet`: its mask row scaled down);
    `ref_for(path)`: the published model of a checkpoint. Returns the summary per EOS mode."""
    grid = cases()
    name = "quiet" if quiet else "random"
    path = checkpoint(tmp / name, quiet)
    no_stop = ours(path, block, "none", grid)
    eos = frequent_token(no_stop, grid)
    eos_path = checkpoint(tmp / f"{name}-eos", quiet, eos_token_id=eos)
    ids = {"eos": eos, "mask": LLM(path).special.mask}
    summary = {"eos_token": eos, "mask_row_scaled": quiet, "modes": {}}
    for mode in EOS_MODES:
        path_m = path if mode == "none" else eos_path
        mine = no_stop if mode == "none" else ours(path_m, block, mode, grid)
        summary["modes"][mode] = _mode_summary(ref_for(path_m), block, mode, ids, grid, mine)
    return summary


def _mode_summary(ref, block: int, mode: str, ids: dict, grid: list[dict], mine) -> dict:
    eos, mask = ids["eos"], ids["mask"]
    rows = []
    for i, (case, (tokens, steps)) in enumerate(zip(grid, mine)):
        cut = answer(tokens, case["max_tokens"], eos if mode != "none" else -1)
        published, calls, mask_top1 = theirs(ref, block, mode, mask, eos, i, case)
        rows.append(
            {
                **case,
                "tokens_equal": cut == published,
                "forwards": [steps, calls],
                "published_mask_top1": mask_top1,
                "answer_has_eos": eos in published,
            }
        )
    return {
        "cases": len(rows),
        "tokens_equal": sum(r["tokens_equal"] for r in rows),
        "forwards_equal": sum(r["forwards"][0] == r["forwards"][1] for r in rows),
        "published_mask_top1": sum(r["published_mask_top1"] for r in rows),
        "forwards": [sum(r["forwards"][k] for r in rows) for k in (0, 1)],  # ours, published
        "answers_with_eos": sum(r["answer_has_eos"] for r in rows),
        "differing": [r for r in rows if not r["tokens_equal"] or len(set(r["forwards"])) > 1],
    }
