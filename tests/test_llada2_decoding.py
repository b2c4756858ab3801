"""LLaDA2's published decoding rule through the engine, on tiny random checkpoints: the output
window ends on an absolute block boundary and the answer is cut to max_tokens; the `steps`
schedule (at least its top-k a step); the early-stop modes (after a block holding EOS, after a
step that commits EOS); batches mixing these settings; the schedule's place surviving a move
to another instance; the mask as a step's pick, and a block left with masks when its steps run
out."""

from collections import Counter

import numpy as np
import pytest
import torch
from family_checkpoints import llada2_checkpoint, prompt_ids, quiet_mask

from dilaserve.config import EngineConfig, SamplingParams
from dilaserve.engine.engine import Engine
from dilaserve.engine.llm import LLM
from dilaserve.engine.sequence import Sequence
from dilaserve.models.family import DecodingRule
from dilaserve.models.llada2 import FAMILY
from dilaserve.models.tokenizer import SpecialIds
from dilaserve.protocol import EosStop, StepBatch, window_len
from dilaserve.request import Request

from conftest import FakeModel

BLOCK = 8
NEVER = 1.0  # no confidence exceeds it: every step commits exactly the schedule's count


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("llada2"))


def checkpoint(folder, **overrides):
    """A random checkpoint whose mask is never the top-1, as in a trained model (the published
    rule's mask picks: `MaskPicking` below)."""
    path = llada2_checkpoint(folder, **overrides)
    return quiet_mask(path, LLM(path).special.mask)


def make_llm(path, **config) -> LLM:
    return LLM(path, EngineConfig("block", block_len=BLOCK, **config))


def run(llm: LLM, prompts, params: SamplingParams, on_step=None) -> list[Request]:
    requests = llm.make_requests(prompts, params, chat=False)
    llm.run(requests, len(requests), on_step)
    return requests


def test_the_schedule_shares_a_blocks_commits_over_its_steps():
    rule = FAMILY.decoding
    assert [rule.min_commits(8, 3, k) for k in range(3)] == [3, 3, 2]
    assert [rule.min_commits(8, 8, k) for k in range(8)] == [1] * 8
    assert [rule.min_commits(8, 16, k) for k in (0, 7)] == [1, 1]
    assert rule.steps_for(32, max_tokens=11) == 11  # the published cap at gen_length
    assert DecodingRule().steps_for(32, max_tokens=11) is None  # no schedule, no steps
    assert DecodingRule().min_commits(8, 3, 0) == 1


def test_the_window_ends_on_the_absolute_block_boundary(path):
    assert window_len(13, 8, BLOCK, aligned=True) == 11  # to position 24
    assert window_len(16, 8, BLOCK, aligned=True) == 8
    assert window_len(13, 8, BLOCK, aligned=False) == 8
    (request,) = run(make_llm(path, early_finish=False), [prompt_ids(13)], SamplingParams(0.9, 8))
    assert request.gen_len == 11 and not (request.output_ids == request.mask_id).any()
    assert len(request.generated_ids(frozenset())) == 8  # the answer, cut to max_tokens


def test_a_short_answer_is_the_head_of_a_longer_one(path):
    """The last block is decoded whole, so what follows the answer changes none of it."""
    llm = make_llm(path, early_finish=False)
    prompts = [prompt_ids(13, offset=k) for k in range(3)]
    short = run(llm, prompts, SamplingParams(0.7, 8))
    long = run(llm, prompts, SamplingParams(0.7, 19))
    for s, g in zip(short, long):
        assert s.output_ids[:8].tolist() == g.output_ids[:8].tolist()


@pytest.mark.parametrize("steps, counts", [(3, [3, 3, 3, 2]), (2, [3, 4, 4]), (8, [1] * 11)])
def test_each_step_commits_the_schedules_count(path, steps, counts):
    """Prompt 13: the first block holds 3 masked positions, the next one 8."""
    (request,) = run(
        make_llm(path, early_finish=False), [prompt_ids(13)], SamplingParams(NEVER, 8, steps)
    )
    assert request.step_tokens == counts


def test_the_steps_are_capped_at_max_tokens(path):
    (request,) = run(make_llm(path, early_finish=False), [prompt_ids(16)], SamplingParams(NEVER, 4))
    assert request.steps == 4 and request.step_tokens == [2, 2, 2, 2]


def test_a_step_commits_at_least_the_schedule_and_a_block_ends_within_steps(path):
    blocks: dict[int, list[int]] = {}

    def record(request, result):
        blocks.setdefault(result.block_index, []).append(len(result.positions))

    run(make_llm(path, early_finish=False), [prompt_ids(16)], SamplingParams(0.3, 16, 3), record)
    assert [sum(counts) for counts in blocks.values()] == [BLOCK, BLOCK]
    for counts in blocks.values():
        assert len(counts) <= 3 and all(n >= k for n, k in zip(counts, [3, 3, 2]))


def test_requests_with_different_settings_share_a_batch(path):
    llm = make_llm(path, early_finish=False)
    settings = [(0.9, 8, None), (0.5, 11, 3), (NEVER, 16, 2), (0.7, 5, 8)]
    cases = [(prompt_ids(5 + 4 * k, offset=k), SamplingParams(*s)) for k, s in enumerate(settings)]
    together = []
    for k, (prompt, params) in enumerate(cases):
        (request,) = llm.make_requests([prompt], params, chat=False)
        request.request_id = str(k)
        together.append(request)
    llm.run(together, len(together))
    for (prompt, params), batched in zip(cases, together):
        (alone,) = run(llm, [prompt], params)
        assert batched.output_ids.tolist() == alone.output_ids.tolist()
        assert batched.step_tokens == alone.step_tokens


def test_the_schedules_place_moves_with_the_request(path):
    """Moved to another instance after 3 of a block's 5 steps (schedule 2, 2, 2, 1, 1), a
    request goes on with the schedule's fourth step there, not its first."""
    config = EngineConfig("block", block_len=BLOCK, early_finish=False)
    llm = make_llm(path, early_finish=False)
    (moved,) = llm.make_requests([prompt_ids(16)], SamplingParams(NEVER, 8, 5), chat=False)
    first, second = Engine.from_checkpoint(path, config), Engine.from_checkpoint(path, config)
    for engine in [first] * 3 + [second] * 2:
        item = moved.step_item(config.kv_cache, engine.has_request(moved.request_id))
        moved.apply(engine.execute(StepBatch((item,))).results[0])
    assert moved.is_finished and moved.step_tokens == [2, 2, 2, 1, 1]


@pytest.fixture(scope="module")
def eos_path(path, tmp_path_factory):
    """The same weights, with the token they produce most often (in no prompt) as EOS."""
    prompts = [prompt_ids(5 + 3 * k, offset=k) for k in range(6)]
    outputs = run(make_llm(path, early_finish=False), prompts, SamplingParams(0.5, 24))
    in_prompts = {t for p in prompts for t in p}
    counts = Counter(t for r in outputs for t in r.output_ids.tolist() if t not in in_prompts)
    eos = counts.most_common(1)[0][0]
    return checkpoint(tmp_path_factory.mktemp("llada2-eos"), eos_token_id=eos), prompts


def eos_runs(eos_path, **config):
    folder, prompts = eos_path
    llm = make_llm(folder, **config)
    steps = {}

    def record(request, result):
        steps.setdefault(request.request_id, []).append(result)

    return llm, run(llm, prompts, SamplingParams(0.5, 24), record), steps


def test_the_published_default_stops_after_the_block_holding_eos(eos_path):
    llm, requests, _ = eos_runs(eos_path)
    _, whole, _ = eos_runs(eos_path, early_finish=False)
    eos = llm.special.eos
    assert llm.engine.eos_stop is EosStop.BLOCK
    stopped = [r for r in requests if (r.output_ids == r.mask_id).any()]
    assert stopped, "no request stopped early: the test checkpoint's EOS is too rare"
    for r, w in zip(requests, whole):
        done = int((r.output_ids != r.mask_id).sum())
        assert (r.prompt_len + done) % BLOCK == 0 or done == r.gen_len  # whole blocks
        assert r.output_ids[:done].tolist() == w.output_ids[:done].tolist()
        if done < r.gen_len:
            last_block = max(done - BLOCK, 0)
            assert eos in r.output_ids[last_block:done] and eos not in r.output_ids[:last_block]


def test_the_step_mode_stops_on_the_step_that_commits_eos(eos_path):
    llm, requests, steps = eos_runs(eos_path, eos_stop="step")
    _, by_block, _ = eos_runs(eos_path)
    eos, mid_block = llm.special.eos, 0
    for r, b in zip(requests, by_block):
        assert r.num_steps <= b.num_steps
        out = r.output_ids.tolist()
        if r.mask_id not in out or (r.prompt_len + out.index(r.mask_id)) % BLOCK == 0:
            continue  # decoded whole, or stopped by the block rule
        mid_block += 1
        assert eos in steps[r.request_id][-1].tokens and r.mask_id not in out[: out.index(eos)]
    assert mid_block, "no request stopped mid-block: the test checkpoint's EOS is too rare"


def test_only_a_step_committing_eos_stops_the_step_mode():
    """EOS at 3 with position 1 still masked; the next step commits position 1 only."""
    seq = Sequence("r", [5] * 8, [9] * 8, None, BLOCK, mask_id=9, aligned_blocks=True)
    seq.commit(np.array([0, 2, 3]), np.array([6, 6, 0]), np.ones(3, np.float32))
    stops = frozenset({0})
    assert not seq.is_finished(stops, EosStop.STEP, committed_stop=True, block_done=False)
    seq.commit(np.array([1]), np.array([6]), np.ones(1, np.float32))
    assert seq.is_finished(stops, EosStop.COMMITTED, committed_stop=False, block_done=False)
    assert not seq.is_finished(stops, EosStop.STEP, committed_stop=False, block_done=False)
    assert not seq.is_finished(stops, EosStop.BLOCK, committed_stop=False, block_done=False)
    assert seq.is_finished(stops, EosStop.BLOCK, committed_stop=False, block_done=True)
    assert not seq.is_finished(stops, EosStop.NONE, committed_stop=True, block_done=True)


def test_the_command_line_sets_the_steps_and_the_stop_rule(path, capsys):
    from dilaserve.cli import main

    argv = ["generate", str(path), "--prompt", "w1 w2", "--max-tokens", "8", "--threshold", "1"]
    assert main([*argv, "--steps", "2", "--eos-stop", "none"]) == 0
    assert "[2 steps, " in capsys.readouterr().out


class MaskPicking(FakeModel):
    """The conftest's fake model where the mask itself is the top-1 at `MASK_AT` (absolute
    positions); confidences fall with the position, so the most confident come first."""

    MASK_AT = (9, 13, 20)

    def __init__(self):
        super().__init__(lambda p: 0.5 - 0.01 * p, self.token)

    def token(self, p: int) -> int:
        return self.MASK if p in self.MASK_AT else 2 + p % 10

    def forward(self, ids, positions, valid, context=None, keep_kv=False, block_len=None):
        return super().forward(ids, positions, valid, context, keep_kv)

    def logits(self, hidden):
        """The mask takes the position's confidence (token 0, never produced, gives way)."""
        out, pos = super().logits(hidden), hidden[..., 0]
        picks = torch.isin(pos.long(), torch.tensor(self.MASK_AT))
        out[..., self.MASK] = torch.where(picks, (0.5 - 0.01 * pos).log(), -1e9)
        out[..., 0] = torch.where(picks, -1e9, out[..., 0])
        return out


def mask_picking_run(gen_len: int, engines: int = 1):
    """Prompt 8 (blocks start at the window), steps 2 a block (4 commits each), no confidence
    over the threshold; the request moves to the next engine after each block."""
    special = SpecialIds(mask=FakeModel.MASK, eos=FakeModel.EOS, eot=None)
    config = EngineConfig("none", block_len=BLOCK)
    instances = [Engine(MaskPicking(), special, config, FAMILY) for _ in range(engines)]
    request = Request("r", tuple(range(2, 10)), gen_len, BLOCK, FakeModel.MASK, NEVER, steps=2)
    while not request.is_finished:
        engine = instances[min(request.current_block, engines - 1)]
        item = request.step_item(config.kv_cache, engine.has_request("r"))
        request.apply(engine.execute(StepBatch((item,))).results[0])
    return request


def test_a_picked_mask_counts_as_a_commit_and_a_block_ends_after_its_steps():
    """Step 1 takes window positions 0-3 (1 picks the mask); step 2 the 4 most confident still
    masked, 1 again, 4, 5 (the mask again) and 6; the block's 2 steps are then spent: 1, 5 and 7
    keep the mask, as in the published `generate`."""
    request = mask_picking_run(BLOCK)
    m = FakeModel.MASK
    assert request.output_ids.tolist() == [10, m, 2, 3, 4, m, 6, m]
    assert request.step_tokens == [3, 2] and request.is_finished
    assert request.generated_ids(frozenset({FakeModel.EOS})) == [10]  # the text ends before


def test_a_block_left_with_masks_stays_decided_on_another_instance():
    moved, whole = mask_picking_run(2 * BLOCK, engines=2), mask_picking_run(2 * BLOCK)
    assert moved.output_ids.tolist() == whole.output_ids.tolist()
    assert moved.step_tokens == whole.step_tokens and len(whole.step_tokens) == 4
