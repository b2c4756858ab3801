"""benchmarks/gpu_dataplane.py's smoke mode: the GPU script's whole path on the CPU with tiny
shapes (no published code, no timing bounds), and the profile hook its output ships through."""

from __future__ import annotations

import json

import pytest

from dilaserve.sim import profiles

from conftest import import_benchmark


@pytest.fixture(scope="module")
def dataplane():
    return import_benchmark("gpu_dataplane")


@pytest.fixture(scope="module")
def smoke_run(dataplane, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    run = dataplane.main(["--smoke", "--out", str(out), "--deadline", "inf"])  # no bound
    return run, json.loads((run / "summary.json").read_text())


def test_smoke_run_measures_every_kind_against_both_limits(smoke_run):
    run, summary = smoke_run
    assert set(summary) >= {"rates", "targets", "steps", "engine", "published", "skipped"}
    assert summary["skipped"] == []
    kinds = {(s["model"], s["kind"]) for s in summary["steps"]}
    assert kinds == {
        ("llada-8b", "cache"),
        ("llada-8b", "recompute"),
        ("llada2-mini", "block"),
        ("llada2-mini", "commit"),
        ("llada2-mini", "prefill"),
    }
    for s in summary["steps"]:
        assert s["weight_limit_ms"] > 0 and s["matrix_limit_ms"] > 0
        # both rounded for the table: 3 decimals and 1
        assert s["over_weight_limit"] == pytest.approx(s["ms"] / s["weight_limit_ms"], abs=1e-3)
        assert s["pct_matrix_rate"] == pytest.approx(100 * s["matrix_limit_ms"] / s["ms"], abs=0.1)
        # a dense model reads no routed experts; the MoE's steps touch some, at most all
        touched = s["experts_touched"]
        assert touched == 0 if s["model"] == "llada-8b" else 0 < touched <= 2 * 8
    targets = summary["targets"]
    assert targets["llada8b_cache_1_over_weight_limit"] > 0
    assert targets["llada2_block_1_over_touched_limit"] > 0
    assert targets["pct_matrix_rate_at_most_requests"]["llada-8b cache"]["num_requests"] == 2
    assert targets["llada8b_tokens_per_s_over_fastdllm"] is None  # no published code given
    assert targets["llada2_tokens_per_s_over_published"] is None
    assert all("skipped" in ref for ref in summary["published"].values())
    assert {e["model"] for e in summary["engine"]} == {"llada-8b", "llada2-mini"}
    assert all(e["tokens"] > 0 and e["steady_tokens_per_s"] > 0 for e in summary["engine"])
    assert (run / "report.md").is_file() and (run / "config.json").is_file()


def test_weight_bytes_are_the_dense_weights_and_the_touched_experts(dataplane, smoke_run):
    import torch

    _, summary = smoke_run
    for name in ("llada-8b", "llada2-mini"):
        model, _ = dataplane.build(name, True, torch.device("cpu"), torch.float32)
        info = dataplane.limits.accounting(model)
        embedding = model.config.vocab_size * 64 * 4  # not read: a gather of a few rows
        assert info["dense_bytes"] <= 4 * info["params"] - embedding
        for s in (s for s in summary["steps"] if s["model"] == name):
            expected = info["dense_bytes"] + s["experts_touched"] * info["expert_bytes"]
            assert s["weight_bytes"] == expected
    # the tiny LLaDA2's expert: gate and up 32 x 64, down 64 x 32, float32
    assert info["expert_bytes"] == 3 * 32 * 64 * 4 and info["moe_layers"] == 1


def test_the_written_profiles_load_as_latency_profiles(smoke_run):
    run, summary = smoke_run
    assert set(summary["profiles"]) == {"llada-8b", "llada2-mini"}
    llada = profiles.load_profile(run / summary["profiles"]["llada-8b"])
    assert {k.value for _, k in llada.curves} == {"cache", "recompute"}
    llada2 = profiles.load_profile(run / summary["profiles"]["llada2-mini"])
    assert {k.value for _, k in llada2.curves} == {"block", "commit", "prefill"}
    assert llada2.meta["block_causal"] is True


def test_a_spent_deadline_skips_every_setting_and_says_so(dataplane, tmp_path):
    run = dataplane.main(
        ["--smoke", "--out", str(tmp_path), "--deadline", "0", "--models", "llada2-mini"]
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == [] and summary["engine"] == [] and summary["profiles"] == {}
    assert any("llada2-mini block step, 1 requests" in s for s in summary["skipped"])
    assert summary["targets"]["llada2_block_1_over_touched_limit"] is None


def test_an_unknown_model_is_refused_by_name(dataplane):
    with pytest.raises(SystemExit):
        dataplane.parse(["--models", "llada-8b,gpt-2"])


def test_a_shipped_profile_file_replaces_the_analytic_preset(tmp_path, monkeypatch):
    assert profiles.load_profile("llada2-mini-h200").meta["source"] == "analytic preset"
    measured = {
        "schema": 1,
        "block_causal": True,
        "source": "measured",
        "entries": [{"tp": 1, "kind": "block", "batch_tokens": 32, "ms": 5.0}],
    }
    path = tmp_path / "llada2-mini-h200-profile.json"
    path.write_text(json.dumps(measured))
    monkeypatch.setattr(profiles, "ASSETS", tmp_path)
    profile = profiles.load_profile("llada2-mini-h200")
    assert profile.meta["source"] == "measured"
    assert profile.step_latency(1, 32, "block") == pytest.approx(0.005)


def test_a_setting_that_fails_is_noted_and_the_run_goes_on(dataplane, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 54.00 GiB")

    monkeypatch.setattr(dataplane.gp, "cache_step", refuse)
    run = dataplane.main(["--smoke", "--out", str(tmp_path), "--models", "llada-8b"])
    summary = json.loads((run / "summary.json").read_text())
    assert {s["kind"] for s in summary["steps"]} == {"recompute"}
    assert any(
        s.startswith("llada-8b cache step, 1 requests: RuntimeError: CUDA out of memory")
        for s in summary["skipped"]
    )
    assert summary["engine"] and summary["profiles"] == {"llada-8b": "llada-8b-cpu-profile.json"}
