import pytest

from dilaserve.control.profile import LatencyProfile
from dilaserve.protocol import StepKind


def profile(**meta):
    entries = [
        {"tp": 1, "kind": "recompute", "batch_tokens": 100, "ms": 10.0},
        {"tp": 1, "kind": "recompute", "batch_tokens": 300, "ms": 30.0},
        {"tp": 1, "kind": "recompute", "batch_tokens": 200, "ms": 18.0},
        {"tp": 1, "kind": "cache", "batch_tokens": 32, "ms": 4.0},
        {"tp": 2, "kind": "full", "batch_tokens": 100, "ms": 7.5},
    ]
    return LatencyProfile.from_dict({"entries": entries, "block_len": 32, **meta})


def test_interpolates_between_points_and_extrapolates_above():
    p = profile()
    assert p.step_latency(1, 200, StepKind.RECOMPUTE) == pytest.approx(0.018)
    assert p.step_latency(1, 150, StepKind.RECOMPUTE) == pytest.approx(0.014)
    assert p.step_latency(1, 400, StepKind.RECOMPUTE) == pytest.approx(0.042)


def test_a_falling_last_segment_never_prices_a_larger_batch_below_it():
    # a noisy calibration (one repeat): two requests measured faster than one. Extrapolating
    # that slope reached 0 s, and load control divided by it (the cluster's requests failed)
    entries = [
        {"tp": 1, "kind": "block", "batch_tokens": 32, "ms": 12.0},
        {"tp": 1, "kind": "block", "batch_tokens": 64, "ms": 9.0},
    ]
    p = LatencyProfile.from_dict({"entries": entries, "block_len": 32})
    assert p.step_latency(1, 48, StepKind.BLOCK) == pytest.approx(0.0105)
    assert p.step_latency(1, 2048, StepKind.BLOCK) == pytest.approx(0.009)


def test_small_batches_cost_the_smallest_point():
    assert profile().step_latency(1, 10, StepKind.RECOMPUTE) == pytest.approx(0.010)


def test_single_point_scales_linearly_above_it():
    assert profile().step_latency(1, 64, StepKind.CACHE) == pytest.approx(0.008)


def test_full_and_recompute_stand_in_for_each_other():
    p = profile()
    assert p.step_latency(2, 100, StepKind.RECOMPUTE) == pytest.approx(0.0075)
    assert p.step_latency(1, 100, StepKind.FULL) == pytest.approx(0.010)
    with pytest.raises(KeyError, match="tp=2, kind=cache"):
        p.step_latency(2, 32, StepKind.CACHE)


def test_round_trips_and_reports_best_throughput():
    p = profile(hardware="cpu")
    q = LatencyProfile.from_dict(p.to_dict())
    assert q.curves == p.curves and q.meta["hardware"] == "cpu"
    assert p.tp_degrees == (1, 2)
    tokens, per_s = p.curve(1, StepKind.RECOMPUTE).best_throughput()
    assert tokens == 200 and per_s == pytest.approx(200 / 0.018)


def test_malformed_profiles_are_named():
    with pytest.raises(ValueError, match="entry 0"):
        LatencyProfile.from_dict(
            {"entries": [{"tp": 1, "kind": "warp", "batch_tokens": 1, "ms": 1}]}
        )
    with pytest.raises(ValueError, match="no entries"):
        LatencyProfile.from_dict({"entries": []})
    for raw in ([1], {"entries": 5}):
        with pytest.raises(ValueError, match="a list of 'entries'"):
            LatencyProfile.from_dict(raw)
    for entry in (5, {"tp": 1, "kind": "cache", "batch_tokens": 8, "ms": -1.0}):
        with pytest.raises(ValueError, match="entry 0"):
            LatencyProfile.from_dict({"entries": [entry]})


def test_a_profile_file_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("tp,ms\n1,2\n")
    with pytest.raises(ValueError, match=f"{path} is not JSON"):
        LatencyProfile.from_file(path)
