"""On-time calibration (`control/on_time.py`): admission's margin learned from finished requests,
and its way back to the plain prediction when no evidence comes."""

import numpy as np
import pytest
from test_admission_learning import busy_admission

from dilaserve.control.on_time import OnTimeCalibration, linear_quantile

from conftest import make_request


def finish(calibration, ratios, start=0.0):
    """Requests admitted at `start` with a 1 s prediction, finished at `start + ratio`."""
    for k, ratio in enumerate(ratios):
        calibration.admitted(f"r{start}-{k}", 1.0, start)
        calibration.finished_at(f"r{start}-{k}", start + ratio)


def test_the_factor_is_the_target_quantile_of_taken_over_predicted_time():
    calibration = OnTimeCalibration(target=0.9, min_evidence=10)
    finish(calibration, [1.0] * 90 + [3.0] * 10)  # 10% take three times the prediction
    assert 1.0 < calibration.factor(3.0) <= 3.0
    assert calibration.finished == 100


def test_the_quantile_is_numpys_to_the_bit():
    rng = np.random.default_rng(0)
    for n in (1, 2, 16, 63, 64):
        for values in (rng.lognormal(0.0, 1.0, n), rng.integers(0, 3, n).astype(float)):
            ordered = sorted(values.tolist())
            for q in (0.0, 0.05, 0.5, 0.95, 1.0, float(rng.random())):
                assert linear_quantile(ordered, q) == float(np.quantile(values, q))


def test_a_prediction_that_holds_needs_no_margin():
    calibration = OnTimeCalibration()
    finish(calibration, [0.5] * 50)  # faster than predicted
    assert calibration.factor(0.5) == 1.0


def test_few_finished_requests_leave_the_prediction_alone():
    calibration = OnTimeCalibration(min_evidence=16)
    finish(calibration, [5.0] * 15)
    assert calibration.factor(5.0) == 1.0
    finish(calibration, [5.0], start=5.0)
    assert calibration.factor(10.0) == pytest.approx(5.0)


def test_the_factor_decays_toward_one_when_nothing_finishes():
    calibration = OnTimeCalibration(half_life=10.0)
    finish(calibration, [5.0] * 50)
    assert calibration.factor(5.0) == pytest.approx(5.0)
    assert calibration.factor(15.0) == pytest.approx(3.0)  # one half-life: half the excess
    assert calibration.factor(5.0 + 200.0) < 1.001  # no evidence for long: the prediction


def test_a_surge_long_past_does_not_hold_the_factor_while_evidence_trickles():
    calibration = OnTimeCalibration(half_life=10.0, age_each=True)  # (admission's)
    finish(calibration, [4.0] * 64)  # a surge: every request four times its prediction
    assert calibration.factor(4.0) == pytest.approx(4.0)
    for start in range(5, 65, 5):  # then one request every 5 s, as predicted
        finish(calibration, [1.0], start=float(start))
    # the window still holds 52 of the surge's ratios; each has aged 60 s or so
    assert calibration.factor(61.0) < 1.1  # (at the last finish)
    assert calibration.low_factor(61.0) == pytest.approx(1.0, abs=0.1)


def test_fresh_evidence_counts_in_full():
    calibration = OnTimeCalibration(target=0.9, min_evidence=10, half_life=10.0, age_each=True)
    finish(calibration, [1.0] * 90 + [3.0] * 10)  # all measured within 3 s
    assert calibration.factor(3.0) > 1.5


def test_without_aging_each_a_trickle_leaves_the_window_as_it_was():
    calibration = OnTimeCalibration(half_life=10.0)  # (Alg. 1's: every request teaches it)
    finish(calibration, [4.0] * 64)
    for start in range(5, 65, 5):
        finish(calibration, [1.0], start=float(start))
    assert calibration.factor(61.0) == pytest.approx(4.0)  # (at the last finish)


def test_requests_that_never_finish_teach_nothing():
    calibration = OnTimeCalibration(min_evidence=1)
    calibration.admitted("gone", 1.0, 0.0)
    calibration.forget("gone")
    calibration.finished_at("gone", 50.0)  # (a late report of it changes nothing)
    calibration.finished_at("never-admitted", 50.0)
    assert calibration.finished == 0 and calibration.pending == 0
    assert calibration.factor(50.0) == 1.0


@pytest.mark.parametrize("kw", [{"target": 0.0}, {"target": 1.0}, {"window": 0}, {"half_life": 0}])
def test_bad_settings_are_refused_by_name(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        OnTimeCalibration(**kw)


def test_admission_counts_on_what_finished_requests_took():
    """Load in flight that fits a request's SLO by the prediction, but not once finished
    requests took five times theirs; with no request finishing for long, it fits again."""
    admission = busy_admission()
    probe = make_request("probe", gen_len=32, deadline=1e6)
    assert admission.refusal(probe, 0.0) is None
    needed = admission._predicted  # what the load ahead and its own take, predicted
    request = make_request("new", gen_len=32, deadline=2 * needed)
    assert admission.refusal(request, 0.0) is None
    assert not admission.room(0.0).refuses(0, 2 * needed)
    finish(admission.on_time, [5.0] * 64)  # (admitted at 0 s, finished at 5 s)
    late = make_request("late", gen_len=32, deadline=5.0 + 2 * needed)
    assert admission.refusal(late, 5.0) is not None
    assert admission.room(5.0).refuses(0, 2 * needed)
    later = 5.0 + 10 * admission.on_time.half_life
    again = make_request("again", gen_len=32, deadline=later + 2 * needed)
    assert admission.refusal(again, later) is None


def test_admission_fits_again_while_a_trickle_follows_a_surge():
    """At overload few requests run at the lowest threshold, admission's only teachers: a
    trickle of them as predicted must not leave a surge's ratios holding the factor. (Every
    time here is passed in: seconds of a virtual clock, no wall clock read.)"""
    admission = busy_admission()
    assert admission.refusal(make_request("probe", gen_len=32, deadline=1e6), 0.0) is None
    needed = admission._predicted
    finish(admission.on_time, [5.0] * 64)
    for start in range(10, 100, 10):  # one as predicted every 10 s
        finish(admission.on_time, [1.0], start=float(start))
    request = make_request("new", gen_len=32, deadline=91.0 + 2 * needed)
    assert admission.refusal(request, 91.0) is None


def test_a_void_request_teaches_nothing_even_if_priced_again_until_it_ends():
    calibration = OnTimeCalibration(min_evidence=1)
    calibration.admitted("slow", 1.0, 0.0)
    calibration.void(["slow", "later"])  # in flight at a fault; "later" not priced yet
    assert "slow" not in calibration
    calibration.admitted("later", 1.0, 0.0)  # priced after it: still void
    calibration.finished_at("slow", 9.0)
    calibration.finished_at("later", 9.0)
    assert calibration.finished == 0 and calibration.factor(9.0) == 1.0
    calibration.admitted("slow", 1.0, 10.0)  # an id used again, after it ended, counts
    calibration.finished_at("slow", 13.0)
    assert calibration.finished == 1 and calibration.factor(13.0) == 3.0
