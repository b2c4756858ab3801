"""On-time calibration (`control/on_time.py`): admission's margin learned from finished requests,
and its way back to the plain prediction when no evidence comes."""

import pytest

from dilaserve.control.on_time import OnTimeCalibration


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
