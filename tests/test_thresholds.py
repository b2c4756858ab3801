import numpy as np
import pytest

from dilaserve.control.profile import LatencyProfile
from dilaserve.control.thresholds import (
    InstanceLoad,
    LoadView,
    allowed_ranks,
    allowed_thresholds,
    instance_capacity,
    predicted_time_left,
    request_load,
    select_threshold,
)

PROFILE = LatencyProfile.from_dict(
    {
        "entries": [
            {"tp": 1, "kind": "full", "batch_tokens": 100, "ms": 100},
            {"tp": 1, "kind": "full", "batch_tokens": 1000, "ms": 500},
            {"tp": 1, "kind": "cache", "batch_tokens": 32, "ms": 20},
            {"tp": 1, "kind": "cache", "batch_tokens": 320, "ms": 50},
        ]
    }
)
STEPS = {0.9: 20, 0.7: 10, 0.5: 5}
ONE = InstanceLoad(tp=1, num_tokens=100, num_requests=1)


def view(rid="a", arrival=0.0, steps=None, tokens=100, recompute=0, priority=0):
    return LoadView(rid, arrival, tokens, steps or STEPS, recompute, priority)


@pytest.mark.parametrize("slo_left, expected", [(2.5, 0.9), (1.5, 0.7), (0.2, 0.5)])
def test_algorithm1_highest_threshold_that_fits_else_the_lowest(slo_left, expected):
    # 0.1 s per step: 2.0 s at 0.9, 1.0 s at 0.7, 0.5 s at 0.5
    assert select_threshold(view(), (0.9, 0.7, 0.5), slo_left, ONE, PROFILE, None) == expected


def test_algorithm1_stays_within_the_allowed_range():
    assert select_threshold(view(), (0.7, 0.5), 100.0, ONE, PROFILE, None) == 0.7


def test_algorithm5_counts_cache_and_recompute_steps_at_their_own_cost():
    req = view(steps={0.9: 10}, recompute=2)
    busy = InstanceLoad(tp=1, num_tokens=1000, num_requests=10)
    # 8 cache steps over 10 requests (320 tokens, 50 ms) + 2 recompute steps of 1000 tokens
    assert predicted_time_left(req, 0.9, busy, PROFILE, 32) == pytest.approx(8 * 0.05 + 2 * 0.5)


def test_request_load_without_and_with_cache():
    req = view(steps={0.9: 10}, recompute=2)
    assert request_load(req, 0.9, None) == 1000
    assert request_load(req, 0.9, 32) == 8 * 32 + 2 * 100


def test_algorithm2_caps_late_arrivals_when_capacity_binds():
    reqs = [
        view("c", 2.0, {0.9: 10, 0.5: 4}),
        view("a", 0.0, {0.9: 10, 0.5: 4}),
        view("b", 1.0, {0.9: 10, 0.5: 4}),
    ]
    # loads: 1000 at 0.9, 400 at 0.5; a: 0+1000+800 fits 2000; b: 1000+1000+400 does not
    allowed = allowed_thresholds(reqs, (0.5, 0.9), 2000, None)
    assert allowed == {"a": (0.9, 0.5), "b": (0.5,), "c": (0.5,)}


def test_algorithm2_gives_everyone_the_full_range_when_load_is_light():
    reqs = [view("a", 0.0), view("b", 1.0)]
    assert set(allowed_thresholds(reqs, (0.9, 0.7, 0.5), 1e9, None).values()) == {(0.9, 0.7, 0.5)}


def test_algorithm2_serves_higher_priority_first():
    reqs = [
        view("a", 0.0, {0.9: 10, 0.5: 4}),
        view("b", 1.0, {0.9: 10, 0.5: 4}),
        view("c", 2.0, {0.9: 10, 0.5: 4}, priority=1),
    ]
    allowed = allowed_thresholds(reqs, (0.9, 0.5), 2000, None)
    assert allowed == {"c": (0.9, 0.5), "a": (0.5,), "b": (0.5,)}


def test_algorithm2_lowest_threshold_is_always_allowed_even_when_overloaded():
    assert allowed_thresholds([view()], (0.9, 0.5), 0.0, None) == {"a": (0.5,)}


def test_capacity_without_and_with_cache():
    assert instance_capacity(PROFILE, 1, 3.0, None) == pytest.approx(2000 * 3.0)
    per_s = (320 * 31 + 100) / (0.05 * 31 + 0.1)
    got = instance_capacity(PROFILE, 1, 3.0, 32, tokens_per_request=100, max_requests=10)
    assert got == pytest.approx(per_s * 3.0)


def reference_ranks(loads, capacity):
    """The paper's Algorithm 2 loop, written plainly."""
    n, width = loads.shape
    floor_after = [loads[i + 1 :, -1].sum() for i in range(n)]
    used, ranks = 0.0, []
    for i in range(n):
        for col in range(width):
            if used + loads[i, col] + floor_after[i] <= capacity or col == width - 1:
                used += loads[i, col]
                ranks.append(col)
                break
    return ranks


def test_vectorised_load_control_matches_the_papers_loop():
    rng = np.random.default_rng(0)
    for trial in range(300):
        n, width = int(rng.integers(1, 40)), int(rng.integers(1, 6))
        loads = np.sort(rng.integers(1, 50, (n, width)).astype(float), axis=1)[:, ::-1]
        if trial % 3 == 0:  # predictors are not always monotone
            loads = rng.integers(1, 50, (n, width)).astype(float)
        capacity = float(rng.uniform(0, 1.5) * loads[:, 0].sum())
        assert allowed_ranks(loads, capacity).tolist() == reference_ranks(loads, capacity)
