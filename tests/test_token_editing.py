"""LLaDA2.1's token editing on fixed logits: which committed tokens a step replaces, how the
request threshold moves the edit threshold, how a block's edit-only steps end, the published
modes, and what an unfinished request shows of a block still being edited."""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dilaserve.config import EngineConfig
from dilaserve.engine.engine import Engine
from dilaserve.engine.unmask import select_edits
from dilaserve.models.common import ForwardResult
from dilaserve.models.family import MASK_PICK_STEPS, TokenEditing
from dilaserve.models.llada import FAMILY as LLADA
from dilaserve.models.llada2 import FAMILY, LLADA21_MODES
from dilaserve.models.tokenizer import SpecialIds
from dilaserve.protocol import StepBatch
from dilaserve.request import Request

VOCAB, MASK, EOS = 8, 7, 6
BLOCK, PROMPT = 4, (1, 2, 3, 4)


def test_a_committed_token_is_edited_when_its_top1_differs_above_the_edit_threshold():
    conf = torch.tensor([[0.6, 0.6, 0.4, 0.9], [0.6, 0.6, 0.6, 0.6]])
    top = torch.tensor([[2, 3, 2, 5], [2, 3, 2, 5]])
    current = torch.tensor([[1, 3, 1, 1], [1, 3, 1, 1]])
    editable = torch.tensor([[True, True, True, False], [True, True, True, True]])
    edits = select_edits(conf, top, current, editable, torch.tensor([0.5, 0.65]))
    # row 0: position 1 keeps its token, 2 is below 0.5, 3 is not editable (masked or prompt)
    assert edits.tolist() == [[True, False, False, False], [False, False, False, False]]


def test_the_request_threshold_moves_the_edit_threshold_in_the_modes_ratio():
    speed, quality = LLADA21_MODES
    assert (speed.mode, speed.threshold, speed.edit_threshold) == ("speed", 0.5, 0.0)
    assert (quality.mode, quality.threshold, quality.edit_threshold) == ("quality", 0.7, 0.5)
    assert quality.edit_threshold_for(0.7) == 0.5  # the published pair, exactly
    assert quality.edit_threshold_for(0.9) == pytest.approx(0.9 * 0.5 / 0.7)
    assert speed.edit_threshold_for(0.9) == 0.0  # speed edits at any confidence
    assert speed.max_post_steps == quality.max_post_steps == 16


def test_the_checkpoints_model_type_picks_the_rule_and_a_mode_can_be_asked_for():
    v21, v20 = (SimpleNamespace(extra={"model_type": t}) for t in ("llada21_moe", "llada2_moe"))
    assert FAMILY.decoding_for(v21).editing.mode == "speed"  # the published default
    assert FAMILY.decoding_for(v20) == FAMILY.decoding  # LLaDA2.0: its own rule, no editing
    assert FAMILY.decoding_for(v20, "quality").editing.mode == "quality"
    assert FAMILY.decoding_for(v21, "off") == FAMILY.decoding
    rule = FAMILY.decoding_for(v21)
    assert not rule.step_schedule and rule.eos_only and rule.mask_in_softmax
    with pytest.raises(ValueError, match="LLaDA has token-editing modes none"):
        LLADA.decoding_for(SimpleNamespace(extra={}), "speed")
    with pytest.raises(ValueError, match="editing="):
        EngineConfig(editing="fast")


def dist(token: int, p: float) -> list[float]:
    """Logits whose softmax gives `token` probability p and spreads the rest evenly."""
    rest = math.log((1 - p) / (VOCAB - 1))
    return [math.log(p) if t == token else rest for t in range(VOCAB)]


class ScriptedModel(torch.nn.Module):
    """Logits from a script: step k's row for window position i is `script[k][i]` (the hidden
    state is the logits; `logits` is the identity). Runs whole sequences (no cache)."""

    def __init__(self, script: list[list[list[float]]]):
        super().__init__()
        self.script, self.calls = script, 0
        self.config = SimpleNamespace(extra={"model_type": "llada21_moe"})

    def forward(self, ids, positions, valid, context=None, keep_kv=False, **kw):
        hidden = torch.zeros(*ids.shape, VOCAB)
        hidden[:, len(PROMPT) :] = torch.tensor(self.script[self.calls])
        self.calls += 1
        return ForwardResult(hidden, None, None)

    def logits(self, hidden):
        return hidden


def run_script(script, threshold: float, mode: TokenEditing):
    family = replace(FAMILY, editing_modes=(mode,))
    model = ScriptedModel(script)
    special = SpecialIds(mask=MASK, eos=EOS, eot=None)
    engine = Engine(model, special, EngineConfig("none", block_len=BLOCK), family)
    request = Request("r", PROMPT, BLOCK, BLOCK, MASK, threshold, edits=True)
    shown, steps = [], []
    while not request.is_finished:
        item = request.step_item(engine.config.kv_cache, engine.has_request("r"))
        (result,) = engine.execute(StepBatch((item,))).results
        request.apply(result)
        steps.append((result.positions.tolist(), result.tokens.tolist()))
        shown.append(request.generated_ids(frozenset((EOS,))))
    return request, steps, shown


QUALITY = TokenEditing("quality", 0.7, 0.5)
LOW = dist(0, 0.2)
SCRIPT = [
    [dist(1, 0.9), dist(0, 0.3), LOW, LOW],  # commits 0 (above 0.7)
    [dist(2, 0.6), dist(3, 0.4), LOW, LOW],  # edits 0 (0.6 > 0.5) and commits 1 (the top-1)
    [dist(2, 0.9), dist(4, 0.45), dist(5, 0.8), dist(1, 0.8)],  # commits 2, 3; 1 stays (0.45)
    [dist(2, 0.9), dist(3, 0.9), dist(5, 0.9), dist(2, 0.55)],  # edit-only: 3 becomes 2
    [dist(2, 0.9), dist(3, 0.9), dist(5, 0.9), dist(2, 0.9)],  # edits nothing: the block ends
]


def test_a_block_runs_edit_only_steps_until_one_edits_nothing():
    request, steps, shown = run_script(SCRIPT, 0.7, QUALITY)
    assert steps == [([0], [1]), ([0, 1], [2, 3]), ([2, 3], [5, 1]), ([3], [2]), ([], [])]
    assert request.output_ids.tolist() == [2, 3, 5, 2] and request.num_steps == 5
    assert request.num_committed == 4  # edits are not new tokens
    # an unfinished request shows nothing of the block still being edited
    assert shown == [[], [], [], [], [2, 3, 5, 2]]


def test_a_higher_request_threshold_raises_the_edit_threshold():
    # at 0.9 the edit threshold is 0.9 * 0.5 / 0.7 = 0.64: 0.6 edits at 0.7, not at 0.9
    script = [
        [dist(1, 0.95), LOW, LOW, LOW],
        [dist(2, 0.6), dist(3, 0.4), LOW, LOW],
        [dist(1, 0.95), dist(3, 0.95), dist(5, 0.95), dist(1, 0.95)],
        [dist(1, 0.95), dist(3, 0.95), dist(5, 0.95), dist(2, 0.6)],
    ]
    request, steps, _ = run_script(script, 0.9, QUALITY)
    assert steps == [([0], [1]), ([1], [3]), ([2, 3], [5, 1]), ([], [])]
    assert request.output_ids.tolist() == [1, 3, 5, 1]
    _, steps, _ = run_script(script + [script[2]] * 2, 0.7, QUALITY)
    assert steps[1] == ([0, 1], [2, 3]) and steps[3] == ([3], [2])


def test_edit_only_steps_stop_after_max_post_steps():
    flip = [[dist(2, 0.9)] * 4, [dist(3, 0.9)] * 4]  # every step rewrites the whole block
    script = [[dist(1, 0.9)] * 4] + [flip[k % 2] for k in range(6)]
    request, steps, _ = run_script(script, 0.7, replace(QUALITY, max_post_steps=2))
    assert len(steps) == 3 and request.is_finished  # the filling step, then two edit-only
    assert request.output_ids.tolist() == [3] * 4


def test_an_edit_to_the_mask_masks_the_position_again():
    # LLaDA2.1's published loop writes the top-1 wherever it edits, the mask token included
    script = [
        [dist(1, 0.9), dist(2, 0.9), dist(3, 0.9), LOW],  # commits 0-2
        [dist(1, 0.9), dist(MASK, 0.8), dist(3, 0.9), dist(4, 0.9)],  # masks 1 again, commits 3
        [dist(1, 0.9), dist(5, 0.9), dist(3, 0.9), dist(4, 0.9)],  # commits 1 again
        [dist(1, 0.9), dist(5, 0.9), dist(3, 0.9), dist(4, 0.9)],  # edits nothing: the end
    ]
    request, steps, _ = run_script(script, 0.7, QUALITY)
    assert steps == [([0, 1, 2], [1, 2, 3]), ([3, 1], [4, MASK]), ([1], [5]), ([], [])]
    assert request.output_ids.tolist() == [1, 5, 3, 4] and request.num_committed == 4
    assert request.step_tokens == [3, 1, 1, 0]


def test_a_block_whose_top1_stays_the_mask_still_ends():
    # the published loop picks the mask for ever; the engine stops picking it after
    # MASK_PICK_STEPS steps per position and commits the best other token, one a step
    stuck = [[dist(MASK, 0.6)] * BLOCK] * (MASK_PICK_STEPS * BLOCK + BLOCK + 1)
    request, steps, _ = run_script(stuck, 0.7, QUALITY)
    picking_mask = MASK_PICK_STEPS * BLOCK
    assert steps[:picking_mask] == [([], [])] * picking_mask
    assert [len(p) for p, _ in steps[picking_mask:]] == [1, 1, 1, 1, 0]
    assert request.is_finished and MASK not in request.output_ids.tolist()
