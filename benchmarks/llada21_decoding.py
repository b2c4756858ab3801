"""LLaDA2.1's token-editing decoding through dilaserve's engine against the published `generate`.

Part of `published_parity.py` (which loads the published LLaDA2.1 model): for each published
mode (speed: thresholds 0.5 / edit 0.0; quality: 0.7 / 0.5), each EOS mode and every prompt
length, `max_tokens` and threshold of the grid below, dilaserve runs all the cases of one mode
as one batch through its exact block cache (the requests differ in prompt, window and
threshold), and the published `generate` runs each case alone, without a cache, with
`threshold` and the `editing_threshold` that dilaserve's knob gives it (`TokenEditing`: the
mode's own pair at the mode's threshold, the edit threshold moved in the mode's ratio at the
others). A case is equal when the answers (cut after the first EOS, at most `max_tokens`) are
the same token for token, and its forwards equal when both ran as many forward passes (edit-only
steps included).

The published `generate` builds its block-causal mask as a keep mask (1 / 0); the copy of the
forward run here (ZHZisZZ/dllm's, under transformers 4.57) passes a float mask to SDPA as
additive, so it is handed as LLaDA2.0's `generate` builds it (0 / -inf): the same mask.

EOS modes: `none` (the published `eos_id=-1`, dilaserve's early_finish off) and `block` (the
published `eos_early_stop=True`: stop after a block, all of it edited, holding EOS). As in
`llada2_decoding.py`, the EOS is the token the no-stop run produced most often, among those no
prompt holds.
"""

from __future__ import annotations

from itertools import product
from pathlib import Path

import torch
from family_checkpoints import prompt_ids
from llada2_decoding import answer, frequent_token, quiet_mask

from dilaserve.config import EngineConfig, SamplingParams
from dilaserve.engine.llm import LLM
from dilaserve.models.llada2 import LLADA21_MODES
from dilaserve.request import Request
from dilaserve.training.random_checkpoint import write_random_llada21

PROMPT_LENS = (5, 8, 13)  # inside a block, on a boundary, inside the next
MAX_TOKENS = (16, 11)
OTHER_THRESHOLD = 0.9  # beside each mode's own: moves the edit threshold in the mode's ratio
EOS_MODES = {"none": False, "block": True}
MODES = {m.mode: m for m in LLADA21_MODES}
# forwards after which a published run counts as not ending: its rule may re-mask a token (an
# edit to the mask token, when that is the top-1) and "commit" the mask forever
FORWARD_LIMIT = 1000


class NoEnd(Exception):
    """The published `generate` ran past FORWARD_LIMIT forwards (args: whether the mask token
    was the top-1 so far)."""


def cases(mode: str) -> list[dict]:
    thresholds = (MODES[mode].threshold, OTHER_THRESHOLD)
    grid = product(PROMPT_LENS, MAX_TOKENS, thresholds)
    return [dict(prompt_len=p, max_tokens=m, threshold=t) for p, m, t in grid]


def ours(path: Path, block: int, mode: str, eos_mode: str, grid) -> list[tuple[list[int], int]]:
    config = EngineConfig(
        "block", block_len=block, early_finish=EOS_MODES[eos_mode], editing=mode, dtype="float32"
    )
    llm = LLM(path, config)
    requests = [_request(llm, i, case) for i, case in enumerate(grid)]
    llm.run(requests, max_batch=len(requests))
    return [(r.output_ids.tolist(), r.num_steps) for r in requests]


def _request(llm: LLM, i: int, case: dict) -> Request:
    params = SamplingParams(case["threshold"], case["max_tokens"])
    (request,) = llm.make_requests([prompt_ids(case["prompt_len"], offset=i)], params, chat=False)
    request.request_id = str(i)
    return request


def theirs(ref, block: int, mode: str, eos_mode: str, ids: dict, i: int, case: dict):
    """The published answer, its forward count, and whether the mask token was ever the top-1
    of a generated position of the block (the published rule may then commit or edit to the
    mask; dilaserve never does). Raises NoEnd past FORWARD_LIMIT forwards."""
    calls, mask_top1 = 0, False
    forward, mask = ref.forward, ids["mask"]
    prompt_len = case["prompt_len"]

    def counted(x, attention_mask, **kwargs):
        """Counts the forwards; the published block mask is a keep mask (1 visible, 0 not),
        which this copy of the forward, under transformers 4.57, would add to the scores: it
        gets the additive form (log: 0 / -inf) that LLaDA2.0's `generate` builds."""
        nonlocal calls, mask_top1
        calls += 1
        if calls > FORWARD_LIMIT:
            raise NoEnd(mask_top1)
        out = forward(x, attention_mask=attention_mask.to(ref.dtype).log(), **kwargs)
        generated = torch.arange(x.shape[1] - block, x.shape[1]) >= prompt_len
        top = out.logits[0, -block:].argmax(-1)
        mask_top1 |= bool(((top == mask) & generated).any())
        return out

    early = EOS_MODES[eos_mode]
    rule = MODES[mode]
    ref.forward = counted
    try:
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([prompt_ids(prompt_len, offset=i)]),
                block_length=block,
                gen_length=case["max_tokens"],
                threshold=case["threshold"],
                editing_threshold=rule.edit_threshold_for(case["threshold"]),
                max_post_steps=rule.max_post_steps,
                eos_early_stop=early,
                eos_id=ids["eos"] if early else -1,
                mask_id=mask,
                temperature=0.0,
            )[0].tolist()
    finally:
        del ref.forward
    return out, calls, mask_top1


def checkpoint(folder: Path, quiet: bool, **overrides) -> Path:
    path = write_random_llada21(folder, **overrides)
    return quiet_mask(path, LLM(path).special.mask) if quiet else path


def compare(ref_for, block: int, tmp: Path, quiet: bool) -> dict:
    """Every case of both modes in both EOS modes on a random LLaDA2.1 checkpoint (`quiet`: its
    mask row scaled down); `ref_for(path)`: the published model of a checkpoint."""
    name = "quiet21" if quiet else "random21"
    path = checkpoint(tmp / name, quiet)
    mask = LLM(path).special.mask
    summary = {"mask_row_scaled": quiet, "modes": {}}
    for mode in MODES:
        grid = cases(mode)
        no_stop = ours(path, block, mode, "none", grid)
        eos = frequent_token(no_stop, grid)
        eos_path = checkpoint(tmp / f"{name}-{mode}-eos", quiet, eos_token_id=eos)
        ids = {"eos": eos, "mask": mask}
        for eos_mode in EOS_MODES:
            path_m = path if eos_mode == "none" else eos_path
            mine = no_stop if eos_mode == "none" else ours(path_m, block, mode, eos_mode, grid)
            ref = ref_for(path_m)
            rows = [
                _row(ref, block, (mode, eos_mode), ids, i, case, out)
                for i, (case, out) in enumerate(zip(grid, mine))
            ]
            summary["modes"][f"{mode}/{eos_mode}"] = {"eos_token": eos, **_totals(rows)}
    return summary


def _row(ref, block: int, modes: tuple[str, str], ids: dict, i: int, case: dict, out) -> dict:
    mode, eos_mode = modes
    tokens, steps = out
    cut = answer(tokens, case["max_tokens"], ids["eos"] if eos_mode != "none" else -1)
    try:
        published, calls, mask_top1 = theirs(ref, block, mode, eos_mode, ids, i, case)
    except NoEnd as no_end:
        published, calls, mask_top1 = None, None, no_end.args[0]
    return {
        **case,
        "tokens_equal": cut == published,
        "forwards": [steps, calls],
        "published_mask_top1": mask_top1,
        "published_ended": published is not None,
        "answer_has_eos": published is not None and ids["eos"] in published,
    }


def _totals(rows: list[dict]) -> dict:
    return {
        "cases": len(rows),
        "tokens_equal": sum(r["tokens_equal"] for r in rows),
        "forwards_equal": sum(r["forwards"][0] == r["forwards"][1] for r in rows),
        "published_mask_top1": sum(r["published_mask_top1"] for r in rows),
        "published_not_ended": sum(not r["published_ended"] for r in rows),
        "differing_without_mask_top1": sum(
            not r["published_mask_top1"]
            and (not r["tokens_equal"] or r["forwards"][0] != r["forwards"][1])
            for r in rows
        ),
        "forwards": [sum(r["forwards"][k] or 0 for r in rows) for k in (0, 1)],  # ours, published
        "answers_with_eos": sum(r["answer_has_eos"] for r in rows),
        "differing": [r for r in rows if not r["tokens_equal"] or len(set(r["forwards"])) > 1],
    }
