"""What admission's on-time factor learns from (`control/admission.py`): only requests that ran
every step at the lowest threshold, where admission priced them. A request that had room ran
higher, and took longer by choice: counting it made the factor grow with the load's slack."""

import pytest

from dilaserve.control.admission import Admission
from dilaserve.control.build import ControlSpec, build_scheduler
from dilaserve.control.features import request_states
from dilaserve.control.step_limits import within_limits

from conftest import make_request


def busy_admission():
    """Admission over one instance with 20 requests in flight (the default policy)."""
    scheduler = build_scheduler(ControlSpec())
    scheduler.add_instance("i0", 1, 8192)
    for k in range(20):
        scheduler.on_arrival(make_request(f"busy{k}", gen_len=64, deadline=1e6), 0.0)
    return Admission(scheduler)


def run_and_finish(admission, thresholds, count=64, took=5.0):
    """`count` requests admitted at 0 s, each running steps at `thresholds` and finishing at
    `took` seconds: `took` over the time admission predicted for each."""
    for k in range(count):
        request = make_request(f"r{k}", gen_len=32, deadline=1e6)
        assert admission.refusal(request, 0.0) is None
        admission.admitted(request, 0.0)
        request.threshold_steps = list(thresholds)
        admission.finished(request.request_id, took)


def fits_by_prediction(admission, now):
    """A request whose SLO is twice what admission predicts it needs at `now`."""
    probe = make_request("probe", gen_len=32, deadline=1e6)
    assert admission.refusal(probe, now) is None
    return make_request("new", gen_len=32, deadline=now + 2 * admission._predicted)


def test_admission_keeps_its_own_factor_beside_alg1s():
    admission = busy_admission()
    assert admission.scheduler.deadline is not None  # the default policy calibrates Alg. 1
    assert admission.on_time is not admission.scheduler.deadline


def test_requests_that_ran_above_the_lowest_threshold_teach_nothing():
    admission = busy_admission()
    lowest, highest = admission._loads.ladder[-1], admission._loads.ladder[0]
    run_and_finish(admission, [highest, lowest, lowest])
    assert admission.on_time.finished == 0 and admission.on_time.pending == 0
    assert admission.on_time.factor(5.0) == 1.0
    assert admission.refusal(fits_by_prediction(admission, 5.0), 5.0) is None


def test_requests_that_ran_at_the_lowest_threshold_teach_the_factor():
    admission = busy_admission()
    lowest = admission._loads.ladder[-1]
    run_and_finish(admission, [lowest, lowest, lowest])
    assert admission.on_time.finished == 64
    assert admission.on_time.factor(5.0) > 2.0  # they took five times what it predicted
    assert admission.refusal(fits_by_prediction(admission, 5.0), 5.0) is not None


def test_a_dropped_request_is_forgotten():
    admission = busy_admission()
    request = make_request("gone", gen_len=32, deadline=1e6)
    assert admission.refusal(request, 0.0) is None
    admission.admitted(request, 0.0)
    admission.dropped("gone")
    admission.finished("gone", 1.0)  # (a late report of it)
    assert admission.on_time.finished == 0 and not admission._priced


@pytest.mark.parametrize("policy", ["fcfs", "no-dynamic-threshold"])
def test_fixed_thresholds_record_nothing(policy):
    scheduler = build_scheduler(ControlSpec(policy=policy))
    scheduler.add_instance("i0", 1, 8192)
    admission = Admission(scheduler)
    request = make_request("r", gen_len=32, deadline=1e6)
    admission.admitted(request, 0.0)
    admission.finished("r", 1.0)
    assert not admission._priced and admission.on_time.finished == 0


def test_a_request_admission_priced_is_not_predicted_again_when_it_is_admitted(monkeypatch):
    """Admission's prediction of a newcomer's steps is load control's first one (the same
    request in the same state): one predictor call, not two (`LoadControl.predict_arrival`)."""
    scheduler = build_scheduler(ControlSpec())
    scheduler.add_instance("i0", 1, 8192)
    admission, loads = Admission(scheduler), scheduler.load_control
    asked = []
    predict = loads.predictor.predict

    def counting(request_ids, states):
        asked.append(list(request_ids))
        return predict(request_ids, states)

    monkeypatch.setattr(loads.predictor, "predict", counting)
    # deadlines on the scheduler's own event clock, which this test holds at 0.0: far ahead
    priced = make_request("priced", gen_len=64, deadline=1e6)
    assert admission.refusal(priced, 0.0) is None
    admission.admitted(priced, 0.0)
    scheduler.on_arrival(priced, 0.0)
    assert asked == [["priced"]]  # admission's call; the first refresh took its steps
    ladder = loads.ladder
    expected = predict(["priced"], request_states([priced]))[0]
    columns = [list(loads.predictor.thresholds).index(g) for g in ladder]
    expected = within_limits(expected[columns][None, :], [priced])[0]
    assert loads.steps_left("priced", ladder) == pytest.approx(list(expected))
    unpriced = make_request("unpriced", gen_len=64, deadline=1e6)  # (admission not asked)
    scheduler.on_arrival(unpriced, 0.0)
    assert asked[-1] == ["unpriced"]
