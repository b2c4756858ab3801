"""step_limits: a request's decoding knobs (a step schedule, token editing, a whole-window
budget) bound its predicted steps wherever the control plane prices them."""

import numpy as np
from scheduler_helpers import BLOCK, FakePredictor, only_launch, scheduler

from dilaserve.control.step_limits import step_limits, within_limits
from dilaserve.protocol import MAX_EDIT_STEPS

from conftest import make_request


def test_a_step_schedule_allows_at_most_its_steps_per_block():
    r = make_request("r", gen_len=4 * BLOCK, steps=3)
    fewest, most = step_limits([r])
    assert (fewest[0], most[0]) == (1.0, 4 * 3.0)
    assert within_limits(np.array([[100.0, 0.2]]), [r]).tolist() == [[12.0, 1.0]]


def test_the_current_blocks_steps_run_count_against_its_schedule():
    r = make_request("r", gen_len=4 * BLOCK, steps=3)
    r.current_block, r.block_step = 1, 2  # one block done, two steps into the second
    assert step_limits([r])[1][0] == 1 + 2 * 3


def test_without_a_schedule_a_request_takes_at_most_a_step_per_masked_position():
    r = make_request("r", gen_len=2 * BLOCK)
    assert step_limits([r])[1][0] == 2 * BLOCK
    r.num_committed = 3
    assert step_limits([r])[1][0] == 2 * BLOCK - 3


def test_token_editing_allows_each_block_its_edit_only_steps():
    r = make_request("r", gen_len=2 * BLOCK, edits=True)
    assert step_limits([r])[1][0] == 2 * (BLOCK + MAX_EDIT_STEPS)
    r.num_committed, r.edit_block, r.post_steps = BLOCK, 0, 5  # block 0 edits only now
    assert step_limits([r])[1][0] == MAX_EDIT_STEPS - 5 + BLOCK + MAX_EDIT_STEPS


def test_a_whole_window_budget_sets_the_fewest_steps_the_window_takes():
    r = make_request("r", gen_len=2 * BLOCK, step_budget=2)
    r.num_steps = 3
    fewest, _ = step_limits([r])
    assert fewest[0] == 2 * BLOCK / 2 - 3
    assert within_limits(np.array([[1.0, 40.0]]), [r]).tolist() == [[5.0, 16.0]]


def test_load_control_prices_a_request_with_few_steps_per_block_at_its_schedule():
    # the predictor says 0.9 takes 1000 steps, which the SLO cannot hold: 0.5 (4 steps) is
    # picked; a schedule of one step a block caps 0.9 at two steps, which fits
    predictor = FakePredictor({0.5: 4.0, 0.9: 1000.0})
    plain = scheduler(instances=(("b", 2),), slo=0.05, predictor=predictor)
    launch = only_launch(plain.on_arrival(make_request("r", gen_len=2 * BLOCK), 0.0))
    assert launch.batch.items[0].threshold == 0.5
    capped = scheduler(instances=(("b", 2),), slo=0.05, predictor=predictor)
    request = make_request("r", gen_len=2 * BLOCK, steps=1)
    assert only_launch(capped.on_arrival(request, 0.0)).batch.items[0].threshold == 0.9
    assert capped.load_control.steps_left("r", [0.9, 0.5]) == [2.0, 2.0]


def test_a_dws_prior_is_held_to_the_schedule_too():
    s = scheduler(instances=(("b", 2),), slo=0.05)
    request = make_request("r", gen_len=2 * BLOCK, steps=1, prior_steps={0.5: 4.0, 0.9: 1000.0})
    assert only_launch(s.on_arrival(request, 0.0)).batch.items[0].threshold == 0.9


def test_load_control_prices_a_small_whole_window_budget_at_its_floor():
    s = scheduler(instances=(("b", 2),), predictor=FakePredictor({0.5: 1.0, 0.9: 2.0}))
    s.on_arrival(make_request("r", gen_len=2 * BLOCK, step_budget=1), 0.0)
    assert s.load_control.steps_left("r", [0.9, 0.5]) == [2.0 * BLOCK, 2.0 * BLOCK]


class FixedSurface:
    """A DWS predictor whose surface is known: two blocks of 4 steps, every cell runs."""

    block_len, threshold = 4, 0.9

    def predict(self, texts, prompt_tokens, gen_len):
        from dilaserve.dws.model import DWSPrediction

        return DWSPrediction(np.ones((len(texts), 2, self.block_len)))


def test_dws_prices_a_step_schedule_and_token_editing():
    from dilaserve.dws.estimate import DWSEstimator

    dws = DWSEstimator(FixedSurface(), steps_per_token={0.5: 0.5, 0.9: 1.0}, edit_steps=3.0)
    ((cost, prior),) = dws.estimate(["q"], [8], 8)
    assert prior == {0.5: 4.0, 0.9: 8.0}  # 2 blocks x 4 steps
    assert cost == 8 // 4 + 2 + 8  # prompt blocks + blocks + steps (the unit cost)
    ((cost, prior),) = dws.estimate(["q"], [8], 8, steps=1)
    assert prior[0.9] == 2.0 and cost == 2 + 2 + 2
    ((cost, prior),) = dws.estimate(["q"], [8], 8, edits=True)
    assert prior[0.9] == 8.0 + 2 * 3.0 and cost == 2 + 2 + 14


def test_a_block_in_its_edit_phase_has_the_features_its_commits_give():
    from dilaserve.control.features import request_states, state_matrix

    r = make_request("r", gen_len=2 * BLOCK, edits=True)
    r.output_ids[:BLOCK] = 7  # the first block's masks are all committed; it edits on
    r.num_committed, r.num_steps, r.edit_block, r.post_steps = BLOCK, 4, 0, 2
    expected = state_matrix(r.committed[None], r.confidences[None], np.array([4]), BLOCK)
    np.testing.assert_array_equal(request_states([r]), expected)


def test_a_whole_window_budget_applies_only_where_the_rule_decodes_the_whole_window():
    from dilaserve.models.family import DecodingRule
    from dilaserve.protocol import KVCacheMode

    whole = DecodingRule(whole_window=True)
    assert whole.budget_for(KVCacheMode.NONE, None, 32) == 32  # the published default
    assert whole.budget_for(KVCacheMode.NONE, 4, 32) == 4
    assert whole.budget_for(KVCacheMode.DUAL, 4, 32) is None  # block by block with a cache
    assert DecodingRule().budget_for(KVCacheMode.NONE, 4, 32) is None
