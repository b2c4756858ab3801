import json
import math

import pytest

from dilaserve.control.profile import LatencyProfile
from dilaserve.protocol import StepKind
from dilaserve.sim import latency, latency_tables
from dilaserve.sim.hardware import LLADA2_FLASH, LLADA2_MINI
from dilaserve.sim.latency import (
    BLOCK_LEN,
    BLOCK_PRESETS,
    CALIBRATION,
    DREAM_7B,
    FASTDLLM_BASELINE_TOK_S,
    FASTDLLM_TOK_S,
    GH200,
    H100_SXM,
    LLADA_8B,
    PRESETS,
    REF_CONTEXT,
    TOKENS_PER_STEP_0_9,
    TP2_STEP_RATIO_PAPER,
    TP4_STEP_RATIO,
    request_seconds,
    request_steps,
    step_cost,
    step_seconds,
)
from dilaserve.sim.profiles import load_profile, preset_profile

KINDS = (StepKind.FULL, StepKind.RECOMPUTE, StepKind.CACHE)
GSM8K_SEQ = 1020 + 256


@pytest.fixture(scope="module")
def profiles():
    return {name: preset_profile(name) for name in PRESETS}


def test_presets_build_with_meta_and_round_trip(profiles):
    assert set(PRESETS) == {"llada-8b-h100", "llada-8b-gh200", "dream-7b-h100", "dream-7b-gh200"}
    for name, p in profiles.items():
        assert p.tp_degrees == (1, 2, 4, 8)
        assert {kind for _, kind in p.curves} == set(KINDS)
        assert p.block_len == 32
        assert p.meta["source"] == "analytic preset"
        assert p.meta["dtype"] == "bfloat16"
        model, gpu = PRESETS[name]
        assert (p.meta["model"], p.meta["hardware"]) == (model.name, gpu.name)
        back = LatencyProfile.from_dict(json.loads(json.dumps(p.to_dict())))
        assert back.meta == {"schema": 1, **p.meta} and back.block_len == p.block_len
        assert back.curves.keys() == p.curves.keys()
        for key, curve in p.curves.items():
            assert back.curves[key].tokens == curve.tokens
            assert back.curves[key].seconds == pytest.approx(curve.seconds, rel=1e-5)


def test_grids_and_tp_degrees():
    p = preset_profile("llada-8b-h100", tp_degrees=(1, 4))
    assert p.tp_degrees == (1, 4)
    assert p.curve(1, StepKind.RECOMPUTE).tokens[0] == 128
    assert p.max_batch_tokens(1, StepKind.RECOMPUTE) == 65536
    assert p.curve(4, StepKind.CACHE).tokens[0] == 32
    assert p.max_batch_tokens(4, StepKind.CACHE) == 8192


def test_latency_increases_with_batch_tokens(profiles):
    for p in profiles.values():
        for curve in p.curves.values():
            assert all(b > a for a, b in zip(curve.seconds, curve.seconds[1:]))


def test_cache_steps_are_cheaper_than_recomputing_the_same_requests(profiles):
    """The profile's cache curve reads 768 cached tokens a request, so it is compared with
    sequences at least that long; shorter ones are compared through the formula, each step
    costed at the request's own length."""
    for p in profiles.values():
        for tp in p.tp_degrees:
            for requests in (1, 4, 16, 64, 256):
                cache = p.step_latency(tp, requests * BLOCK_LEN, StepKind.CACHE)
                for seq in (REF_CONTEXT, GSM8K_SEQ, 2048):
                    assert cache < p.step_latency(tp, requests * seq, StepKind.RECOMPUTE)
    for model, gpu in PRESETS.values():
        for tp in (1, 2, 4, 8):
            for requests in (1, 4, 16, 64, 256):
                for seq in (64, 128, 256, 512):
                    kw = dict(context=seq)
                    cache = step_seconds(model, gpu, tp, requests * BLOCK_LEN, "cache", **kw)
                    recompute = step_seconds(model, gpu, tp, requests * seq, "recompute", **kw)
                    assert cache < recompute


def test_more_gpus_never_slower_within_a_node(profiles):
    for name, p in profiles.items():
        node = PRESETS[name][1].gpus_per_node
        degrees = [d for d in p.tp_degrees if d <= node]
        for kind in KINDS:
            for n in (32, 256, 1024, 8192):
                lat = [p.step_latency(d, n, kind) for d in degrees]
                assert all(b < a for a, b in zip(lat, lat[1:]))


def ratio(p, tp, n, kind):
    return p.step_latency(tp, n, kind) / p.step_latency(1, n, kind)


def test_tp_ratios_at_the_reference_batch(profiles):
    """Calibrated to Fig. 4a's TP-4 cut (-55%) on a one-request cache step; TP-2 is the model's.

    The paper's TP-2 figure (-25%) is out of reach of the model (docstring): TP-2 comes out at
    -36% on LLaDA-8B/H100, between the paper's TP-2 and TP-4 figures.
    """
    p = profiles["llada-8b-h100"]
    assert ratio(p, 4, BLOCK_LEN, StepKind.CACHE) == pytest.approx(TP4_STEP_RATIO, abs=0.005)
    tp2 = ratio(p, 2, BLOCK_LEN, StepKind.CACHE)
    assert tp2 == pytest.approx(0.636, abs=0.01)
    assert TP4_STEP_RATIO < tp2 < TP2_STEP_RATIO_PAPER
    # Every preset: TP-4 within 0.45 .. 0.50 of TP-1 on the reference cache step (the overhead
    # is a larger share where steps are faster: GH200, Dream-7B), TP-2 within 0.63 .. 0.67.
    for q in profiles.values():
        assert 0.445 <= ratio(q, 4, BLOCK_LEN, StepKind.CACHE) <= 0.50
        assert 0.63 <= ratio(q, 2, BLOCK_LEN, StepKind.CACHE) <= 0.67
        # Whole-sequence steps are compute-bound and scale better: -42% / -64%.
        assert ratio(q, 2, REF_CONTEXT, StepKind.RECOMPUTE) == pytest.approx(0.575, abs=0.01)
        assert ratio(q, 4, REF_CONTEXT, StepKind.RECOMPUTE) == pytest.approx(0.362, abs=0.01)


def test_gh200_tp8_pays_the_node_interconnect(profiles):
    """GH200 nodes hold 4 GPUs: a TP-8 group crosses the 25 GB/s link, H100 SXM's does not."""
    gh, h = profiles["llada-8b-gh200"], profiles["llada-8b-h100"]
    assert gh.step_latency(8, 8192, StepKind.RECOMPUTE) > gh.step_latency(
        4, 8192, StepKind.RECOMPUTE
    )
    assert h.step_latency(8, 8192, StepKind.RECOMPUTE) < h.step_latency(4, 8192, StepKind.RECOMPUTE)


def test_single_request_speed_matches_fast_dllm(profiles):
    tok_s = 256 / request_seconds(profiles["llada-8b-h100"])
    assert tok_s == pytest.approx(FASTDLLM_TOK_S, rel=0.15)
    assert tok_s == pytest.approx(55.1, abs=0.2)  # the docstring's figure
    # The calibration itself hits 54.4 exactly when each step is costed at the request's length.
    recompute, cache = request_steps(256, TOKENS_PER_STEP_0_9)
    assert (recompute, cache) == (8, pytest.approx(256 / 3 - 8))
    kw = dict(context=GSM8K_SEQ)
    exact = recompute * step_seconds(
        LLADA_8B, H100_SXM, 1, GSM8K_SEQ, StepKind.RECOMPUTE, **kw
    ) + cache * step_seconds(LLADA_8B, H100_SXM, 1, BLOCK_LEN, StepKind.CACHE, **kw)
    assert 256 / exact == pytest.approx(FASTDLLM_TOK_S, rel=1e-6)
    baseline = step_seconds(LLADA_8B, H100_SXM, 1, GSM8K_SEQ, StepKind.FULL, **kw)
    assert baseline == pytest.approx(1 / FASTDLLM_BASELINE_TOK_S, rel=1e-6)
    # Faster hardware, smaller model and more GPUs all speed it up.
    for name in ("llada-8b-gh200", "dream-7b-h100", "dream-7b-gh200"):
        assert 256 / request_seconds(profiles[name]) > tok_s
    assert 256 / request_seconds(profiles["llada-8b-h100"], tp=4) > 2 * tok_s


def test_calibration_matches_the_docstring():
    assert CALIBRATION.mfu == pytest.approx(0.147, abs=0.0005)
    assert CALIBRATION.hbm_eff == pytest.approx(0.147, abs=0.001)
    assert CALIBRATION.overhead_s == pytest.approx(11.48e-3, abs=0.01e-3)
    assert latency_tables.summary() in latency.__doc__


def test_model_shapes_match_published_parameter_counts():
    for model in (LLADA_8B, DREAM_7B):
        assert model.derived_params == pytest.approx(model.params, rel=0.02)
        assert model.head_dim == 128
    assert LLADA_8B.kv_bytes_per_token == 32 * 2 * 32 * 128 * 2
    assert DREAM_7B.kv_bytes_per_token == 28 * 2 * 4 * 128 * 2


def test_dream_gqa_moves_less_kv_on_cache_steps():
    for gpu in (H100_SXM, GH200):
        for tp in (1, 2, 4, 8):
            for n in (32, 1024, 8192):
                llada = step_cost(LLADA_8B, gpu, tp, n, StepKind.CACHE)
                dream = step_cost(DREAM_7B, gpu, tp, n, StepKind.CACHE)
                assert dream.kv_bytes < llada.kv_bytes
                assert dream.seconds < llada.seconds
    one = step_cost(DREAM_7B, H100_SXM, 1, 1024, "cache").kv_bytes
    assert one / step_cost(LLADA_8B, H100_SXM, 1, 1024, "cache").kv_bytes == pytest.approx(
        (28 * 4) / (32 * 32)
    )
    # Dream's 4 K/V heads are replicated beyond TP-4: its per-GPU K/V stops shrinking there.
    four = step_cost(DREAM_7B, H100_SXM, 4, 1024, "cache").kv_bytes
    assert step_cost(DREAM_7B, H100_SXM, 8, 1024, "cache").kv_bytes == pytest.approx(four)


def test_step_cost_terms():
    one = step_cost(LLADA_8B, H100_SXM, 1, 1024, StepKind.RECOMPUTE)
    assert one.allreduce_s == 0
    assert one.weight_bytes == 2 * LLADA_8B.params
    assert one.seconds == pytest.approx(max(one.compute_s, one.memory_s) + one.overhead_s)
    # Recompute stores the K/V that a full step only uses.
    full = step_cost(LLADA_8B, H100_SXM, 1, 1024, StepKind.FULL)
    assert one.kv_bytes == pytest.approx(2 * full.kv_bytes)
    assert step_cost(LLADA_8B, H100_SXM, 2, 1024, StepKind.RECOMPUTE).allreduce_s > 0
    with pytest.raises(ValueError):
        step_seconds(LLADA_8B, H100_SXM, 0, 1024, StepKind.CACHE)
    with pytest.raises(ValueError):
        step_seconds(LLADA_8B, H100_SXM, 1, 1024, "bogus")


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ValueError, match="llada-8b-h100.*dream-7b-gh200"):
        preset_profile("llada-8b-a100")


def test_load_profile_by_name_and_by_path(tmp_path, profiles):
    by_name = load_profile("dream-7b-gh200")
    assert by_name.meta == profiles["dream-7b-gh200"].meta
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profiles["llada-8b-h100"].to_dict()))
    for spec in (path, str(path)):
        by_path = load_profile(spec)
        assert by_path.meta["model"] == "LLaDA-8B"
        assert by_path.step_latency(1, 32, StepKind.CACHE) == pytest.approx(
            profiles["llada-8b-h100"].step_latency(1, 32, StepKind.CACHE), rel=1e-5
        )
    with pytest.raises(ValueError, match="neither a latency-profile file nor a profile"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="llada-8b-gh200.*llada-8b-h200"):
        load_profile("llada-8b")


def test_measured_h200_profile_loads_by_name():
    """benchmarks/gpu_profile.py's output ships in the package and serves as a latency model."""
    p = load_profile("llada-8b-h200")
    assert p.tp_degrees == (1,)
    assert "H200" in p.meta["hardware"] and p.meta["dtype"] == "bfloat16"
    assert {"single_request", "engine", "launch_overhead"} <= set(p.meta)
    recompute = p.curve(1, StepKind.RECOMPUTE)
    assert recompute.tokens[0] == 256 and recompute.tokens[-1] == 16384
    assert p.curve(1, StepKind.FULL) is recompute  # no-cache steps fall back to recompute points
    assert p.max_batch_tokens(1, StepKind.CACHE) == 256 * p.block_len
    # the largest batches are compute-bound: 64x the tokens of the smallest cost over 10x more
    assert recompute.seconds[-1] > 10 * recompute.seconds[0]
    assert 0 < request_seconds(p) < request_seconds(load_profile("llada-8b-h100"))


# -- block diffusion (LLaDA2.x): analytic MoE presets with prefill, block and commit curves ------

BLOCK_KINDS = {StepKind.FULL, StepKind.PREFILL, StepKind.BLOCK, StepKind.COMMIT}


@pytest.fixture(scope="module")
def block_profiles():
    return {name: preset_profile(name) for name in BLOCK_PRESETS}


def test_block_presets_are_analytic_with_exact_cache_curves(block_profiles):
    assert set(BLOCK_PRESETS) == {
        "llada2-mini-h100",
        "llada2-mini-h200",
        "llada2-flash-h100",
        "llada2-flash-h200",
    }
    for name, p in block_profiles.items():
        assert {kind for _, kind in p.curves} == BLOCK_KINDS
        assert p.meta["source"] == "analytic preset" and p.meta["block_causal"] is True
        assert load_profile(name).curves.keys() == p.curves.keys()
    # only the TP degrees that hold the weights: flash's 206 GB need 4 H100s or 2 H200s
    assert block_profiles["llada2-mini-h100"].tp_degrees == (1, 2, 4, 8)
    assert block_profiles["llada2-flash-h100"].tp_degrees == (4, 8)
    assert block_profiles["llada2-flash-h200"].tp_degrees == (2, 4, 8)


def test_block_steps_are_ordered_by_the_work_they_do(block_profiles):
    for p in block_profiles.values():
        for tp in p.tp_degrees:
            block = p.step_latency(tp, BLOCK_LEN, StepKind.BLOCK)
            commit = p.step_latency(tp, 2 * BLOCK_LEN, StepKind.COMMIT)
            assert commit > block  # two blocks, and more experts routed to
            assert p.step_latency(tp, 1276, StepKind.PREFILL) > commit
            for kind in BLOCK_KINDS:
                curve = p.curve(tp, kind)
                assert all(b > a for a, b in zip(curve.seconds, curve.seconds[1:]))
        low, high = p.tp_degrees[:2]
        for kind, n in ((StepKind.BLOCK, 2048), (StepKind.PREFILL, 16384)):
            assert p.step_latency(high, n, kind) < p.step_latency(low, n, kind)


def test_moe_shapes_match_published_totals_and_active_parameters():
    assert LLADA2_MINI.derived_params == pytest.approx(16e9, rel=0.02)
    assert LLADA2_MINI.active_params == pytest.approx(1.4e9, rel=0.03)
    # flash's assumed shapes (Ling-flash-2.0's): the checkpoint's 102,889,697,280 bf16
    # parameters less the norms (274,432), and the published 6.1B active
    assert LLADA2_FLASH.derived_params == 102_889_697_280 - 274_432
    assert LLADA2_FLASH.active_params == pytest.approx(6.1e9, rel=0.01)
    assert LLADA2_MINI.kv_bytes_per_token == 20 * 2 * 4 * 128 * 2
    experts = LLADA2_MINI.experts
    assert experts.distinct_experts(1) == pytest.approx(8)
    assert experts.distinct_experts(32) / 256 == pytest.approx(0.64, abs=0.01)
    assert experts.distinct_experts(64) / 256 == pytest.approx(0.87, abs=0.01)
    assert experts.distinct_experts(math.inf) == 256
    # a dense model reads all its weights at any batch
    assert LLADA_8B.weight_bytes(1) == LLADA_8B.weight_bytes(1e6) == LLADA_8B.params * 2


def test_moe_weights_read_grow_with_batch_and_saturate():
    reads = [LLADA2_MINI.weight_bytes(n) for n in (1, 32, 64, 256, 4096)]
    assert all(b > a for a, b in zip(reads, reads[1:]))
    assert reads[-1] == pytest.approx(LLADA2_MINI.derived_params * 2, rel=1e-6)
    assert reads[0] < 0.1 * reads[-1]


def test_block_table_matches_the_docstring():
    assert latency_tables.block_summary() in latency.__doc__
