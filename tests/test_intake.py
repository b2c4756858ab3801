"""A submission's checks, before the cluster queues it: each bad argument is named."""

from types import SimpleNamespace

import pytest

from dilaserve.cluster.intake import INLINE_PROMPT_CHARS, Intake, threshold_bounds
from dilaserve.cluster.requests import InvalidRequest, RequestHandle
from dilaserve.models.family import DecodingRule


class WordTokenizer:
    special = SimpleNamespace(mask=9)

    def encode(self, text):
        return [len(w) for w in text.split()]

    def encode_chat(self, text):
        return [1, *self.encode(text), 2]


class FixedEstimate:
    def estimate(self, texts, prompt_lengths, gen_len, steps=None, edits=False):
        return [(float(gen_len), {0.9: 3.0})]


def intake(**kw):
    args = dict(
        tokenizer=WordTokenizer(), block_len=8, context=64, default_max_tokens=16, vocab_size=50
    )
    return Intake(**{**args, **kw})


def check(it, prompt="two words", **kw):
    args = dict(
        max_tokens=None,
        slo=None,
        priority=0,
        chat=True,
        threshold=None,
        min_threshold=None,
        max_threshold=None,
        text=None,
    )
    return it.check(prompt, **{**args, **kw})


def test_window_rounds_up_to_whole_blocks_and_defaults():
    assert check(intake(), max_tokens=9).gen_len == 16
    assert check(intake()).gen_len == 16  # the default window
    assert check(intake(), chat=False).prompt_ids == (3, 5)
    assert check(intake()).prompt_ids == (1, 3, 5, 2)


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=64), "max_tokens"),  # no room left for the prompt
        (dict(max_tokens=56, prompt="a b c d e f g"), "prompt"),  # 9 + 56 > 64
        (dict(prompt="", chat=False), "prompt"),
        (dict(prompt=[3, 50]), "prompt"),  # outside the vocabulary
        (dict(prompt=[-1]), "prompt"),
        (dict(prompt=[3, 9]), "prompt"),  # the mask token
        (dict(prompt="a 123456789"), "prompt"),  # the mask token spelled in text
        (dict(slo=0.0), "slo"),
        (dict(slo=float("nan")), "slo"),
        (dict(priority=2**31), "priority"),  # as a float key it would be inexact, or overflow
        (dict(priority=1.5), "priority"),
        (dict(threshold=1.5), "threshold"),
        (dict(min_threshold=0.8, max_threshold=0.6), "min_threshold"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop"),  # at most 4
        (dict(stop=["a", ""]), "stop"),
        (dict(stop=[3]), "stop"),
        (dict(stop="x" * 257), "stop"),
    ],
)
def test_bad_arguments_are_named(kw, param):
    with pytest.raises(InvalidRequest) as e:
        check(intake(), **kw)
    assert e.value.param == param


def test_threshold_bounds():
    assert threshold_bounds(None, None, None) is None
    assert threshold_bounds(0.7, None, None) == (0.7, 0.7)
    assert threshold_bounds(None, 0.6, None) == (0.6, 1.0)
    assert threshold_bounds(None, None, 0.8) == (1e-6, 0.8)


def test_request_carries_the_checked_fields():
    it = intake(dws=FixedEstimate(), dws_prior=True)
    sub = check(it, slo=2.0, priority=3, min_threshold=0.6)
    r = sub.request("r1", submitted=10.0, block_len=8, mask_id=9)
    assert (r.gen_len, r.deadline, r.priority, r.threshold_bounds) == (16, 12.0, 3, (0.6, 1.0))
    assert r.slo == 2.0  # as given: the planner classes it by that, whatever its wait
    assert (r.cost, r.prior_steps) == (16.0, {0.9: 3.0})
    without_prior = check(intake(dws=FixedEstimate()))
    assert (without_prior.cost, without_prior.prior_steps) == (16.0, None)


def test_stop_strings_one_or_a_list():
    assert check(intake()).stop == ()
    assert check(intake(), stop="\n").stop == ("\n",)
    assert check(intake(), stop=["##", "."]).stop == ("##", ".")


def streamed(stop, commits, final):
    """What a handle with `stop` streams as its committed text grows through `commits`, then
    once more as the final text; and whether a stop string came."""
    r = check(intake()).request("r", 0.0, block_len=8, mask_id=9)
    handle = RequestHandle(r, 0.0, stop)
    stopped = [handle.extend_text(text) for text in commits]
    stopped.append(handle.extend_text(final, final=True))
    handle._push(None)
    return list(handle), stopped


def test_a_stream_holds_back_what_may_start_a_stop_string_and_ends_before_one():
    # "4 #" may be the start of "###": held back until the text shows it is not
    deltas, stopped = streamed(("###",), ["1 + 3 = 4 #", "1 + 3 = 4 # 5"], "1 + 3 = 4 # 5")
    assert deltas == ["1 + 3 = 4 ", "# 5"] and stopped == [False, False, False]
    deltas, stopped = streamed(("###",), ["1 + 3 = 4\n#", "1 + 3 = 4\n### 4"], "")
    assert deltas == ["1 + 3 = 4\n"] and stopped == [False, True, False]
    # the first of several stop strings wins; without stop strings nothing is held back
    assert streamed(("=", "+"), ["1 + 3 = 4"], "")[0] == ["1 "]
    assert streamed((), ["1 + 3 =", "1 + 3 = 4"], "1 + 3 = 4")[0] == ["1 + 3 =", " 4"]


def test_a_requests_own_steps_override_the_engines_and_are_capped_at_max_tokens():
    schedule = intake(decoding=DecodingRule(step_schedule=True), engine_steps=6)
    assert check(schedule, max_tokens=16).steps == 6  # the engine's
    assert check(schedule, max_tokens=16, steps=3).steps == 3
    assert check(schedule, max_tokens=2, steps=3).steps == 2


@pytest.mark.parametrize("steps", [0, -1, 2.5, True, "3"])
def test_steps_that_are_not_a_positive_integer_are_named(steps):
    with pytest.raises(InvalidRequest, match="steps") as err:
        check(intake(decoding=DecodingRule(step_schedule=True)), steps=steps)
    assert err.value.param == "steps"


def test_steps_for_a_family_without_a_step_schedule_are_refused():
    with pytest.raises(InvalidRequest, match="no per-block step schedule") as err:
        check(intake(), steps=4)
    assert err.value.param == "steps"


def test_a_request_carries_the_knobs_the_control_plane_prices_and_dws_sees_them():
    class Seen:
        def estimate(self, texts, prompt_lengths, gen_len, steps=None, edits=False):
            self.knobs = (steps, edits)
            return [(1.0, None)]

    dws = Seen()
    schedule = intake(decoding=DecodingRule(step_schedule=True), dws=dws, step_budget=None)
    assert check(schedule, steps=3, text="two words").steps == 3 and dws.knobs == (3, False)
    whole = check(intake(step_budget=4)).request("r", 0.0, 8, 9)
    assert whole.step_budget == 4 and not whole.edits


def test_only_a_short_prompt_without_dws_is_checked_on_the_callers_thread():
    short, long = "x" * INLINE_PROMPT_CHARS, "x" * (INLINE_PROMPT_CHARS + 1)
    assert intake().is_cheap(short) and intake().is_cheap([1] * INLINE_PROMPT_CHARS)
    assert not intake().is_cheap(long)
    assert not intake(dws=FixedEstimate()).is_cheap("two words")  # its encoder runs in check
