"""The simulator drives the real control plane: deterministic, complete, and reconfiguring."""

from types import SimpleNamespace

import numpy as np
import pytest

from dilaserve.protocol import StepKind
from dilaserve.request import Request
from dilaserve.sim import metrics
from dilaserve.sim.behaviour import (
    ParametricBehaviour,
    ReplayBehaviour,
    Uniforms,
    llada_tokens_per_step,
)
from dilaserve.sim.run import SimulationSpec, sim_config, simulate, write_run
from dilaserve.sim.simulator import Simulator
from dilaserve.sim.traces import Trace, save_trace
from dilaserve.trajectory import Trajectory

from conftest import import_benchmark


def small_trace(tmp_path, rate=1.0, seconds=20.0, seed=0):
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.uniform(0, seconds, int(rate * seconds)))
    arrival -= arrival[0]
    n = len(arrival)
    trace = Trace(arrival, rng.integers(50, 300, n), rng.choice([64, 128, 256], n))
    return str(save_trace(tmp_path / "trace.csv", trace))


def spec(tmp_path, **kw) -> SimulationSpec:
    kw.setdefault("trace", small_trace(tmp_path))
    kw.setdefault("gpus", 4)
    kw.setdefault("gpus_per_node", 4)
    return SimulationSpec(predictor_prompts=12, **kw)


def test_same_inputs_same_decisions_and_summary(tmp_path):
    a, b = simulate(spec(tmp_path)), simulate(spec(tmp_path))
    assert a.summary["decision_digest"] == b.summary["decision_digest"]
    assert a.rows == b.rows
    c = simulate(spec(tmp_path, seed=1))
    assert c.summary["decision_digest"] != a.summary["decision_digest"]


@pytest.mark.parametrize("policy", ["dilaserve", "infaas", "llumnix", "no-load-control"])
def test_every_request_finishes_with_consistent_records(tmp_path, policy):
    run = simulate(spec(tmp_path, policy=policy, planner_period=1e9))
    assert run.summary["finished"] == run.summary["requests"] == 20
    for row in run.rows:
        assert row["latency"] > 0 and row["steps"] >= row["output_tokens"] // 32
        assert 0.5 <= row["mean_threshold"] <= 0.9
    if policy != "dilaserve":
        assert all(row["mean_threshold"] == 0.9 for row in run.rows)


def test_the_planner_reconfigures_the_cluster_while_requests_run(tmp_path):
    # light load on eight TP-1 instances over two nodes: fewer, faster high-TP instances give
    # more slack, and one node keeps serving while the other's instance loads. The start-up is
    # short against the period, so the move pays for it (a 2 s one, twice over for a move to
    # less throughput, would eat the gain: reconfigure.Reconfigurer._move_pays)
    run = simulate(spec(tmp_path, planner_period=5.0, startup_delay=0.5, gpus=8, initial_tp=1))
    assert run.summary["reconfigurations"] >= 1
    shapes = {tuple(sorted(counts.items())) for _, counts in run.result.instance_log}
    assert len(shapes) > 1  # the instance mix changed during the run
    assert run.summary["finished"] == run.summary["requests"]


def test_run_folder_has_config_records_intervals_summary_report(tmp_path):
    run = simulate(spec(tmp_path, interval=5.0))
    folder = write_run(run, tmp_path / "runs")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "records.csv", "intervals.csv", "summary.json", "report.md"} <= names
    assert len(run.intervals) >= 3
    again = write_run(simulate(spec(tmp_path, interval=5.0)), tmp_path / "runs")
    for name in ("summary.json", "records.csv", "intervals.csv"):  # byte for byte
        assert (folder / name).read_bytes() == (again / name).read_bytes()


def test_parametric_behaviour_commits_fewer_steps_at_lower_thresholds():
    steps = {}
    for g in (0.9, 0.7):
        b = ParametricBehaviour(seed=0)
        r = Request("p0", (3,) * 10, 256, 32, 1, g)
        while not r.is_finished:
            r.apply(b.step(r, g, StepKind.CACHE))
        steps[g] = r.num_steps
    assert steps[0.7] < steps[0.9]
    assert llada_tokens_per_step(0.7) / llada_tokens_per_step(0.9) == pytest.approx(1 / 0.62)


def test_replay_switches_trajectories_when_the_threshold_changes():
    conf = np.zeros((2, 8), np.float32)
    slow = Trajectory(
        0, 0.9, 4, 8, 8, ("recompute", "cache"), (np.arange(4), np.arange(4, 8)), conf
    )
    fast = Trajectory(0, 0.5, 4, 8, 8, ("recompute",), (np.arange(8),), conf[:1])
    b = ReplayBehaviour([slow, fast])
    b.assign("r", 0)
    r = Request("r", (3,) * 4, 8, 8, 1, 0.9)
    first = b.step(r, 0.9, StepKind.RECOMPUTE)
    assert first.positions.tolist() == [0, 1, 2, 3] and not first.is_finished
    r.apply(first)
    second = b.step(r, 0.5, StepKind.CACHE)  # the fast trajectory has no step at 4 tokens
    assert second.is_finished and sorted(second.positions.tolist()) == [4, 5, 6, 7]


def test_summary_and_intervals_by_hand():
    rows = [
        {
            "arrival": 0.0,
            "finished": True,
            "latency": 1.0,
            "met_slo": True,
            "first_block": 0.5,
            "output_tokens": 32,
            "mean_threshold": 0.9,
            "quality": 0.8,
        },
        {
            "arrival": 7.0,
            "finished": True,
            "latency": 3.0,
            "met_slo": False,
            "first_block": 1.0,
            "output_tokens": 96,
            "mean_threshold": 0.5,
            "quality": 0.7,
        },
    ]
    s = metrics.summarize(rows)
    assert s["slo_attainment"] == 0.5 and s["latency_mean"] == 2.0
    assert s["mean_threshold"] == pytest.approx(0.6)  # token-weighted
    assert [r["requests"] for r in metrics.by_interval(rows, 5.0)] == [1, 1]


@pytest.mark.parametrize("policy", ["dilaserve", "oracle-predictor"])
def test_replaying_recorded_engine_steps(tiny_checkpoint, tmp_path, policy):
    from dilaserve.config import EngineConfig
    from dilaserve.engine.llm import LLM
    from dilaserve.engine.record import record_trajectories
    from dilaserve.trajectory import save_trajectories

    llm = LLM(tiny_checkpoint, EngineConfig(kv_cache="dual", block_len=8))
    prompts = ["Tom has 3 apples.", "Ava has 9 coins.", "Sam has 4 pens."]
    recorded = record_trajectories(llm, prompts, (0.5, 0.9), max_tokens=16)
    save_trajectories(tmp_path / "t.npz", recorded)
    replay = f"replay:{tmp_path / 't.npz'}"
    run = simulate(spec(tmp_path, behaviour=replay, block_len=8, policy=policy))
    assert run.summary["finished"] == run.summary["requests"] == 20
    steps = {(t.prompt_len, t.threshold): t.num_steps for t in recorded}
    for row in run.rows:  # never more steps than the slowest recorded run of its prompt
        assert row["steps"] <= max(n for (p, _), n in steps.items() if p == row["prompt_tokens"])


def test_simulate_command_writes_a_run_folder(tmp_path, capsys):
    from dilaserve.cli import main

    args = ["simulate", "--trace", small_trace(tmp_path), "--gpus", "4", "--quiet"]
    assert main(args + ["--policy", "llumnix", "--out", str(tmp_path / "runs")]) == 0
    assert "slo_attainment:" in capsys.readouterr().out
    [folder] = (tmp_path / "runs").glob("simulate-*")
    assert (folder / "records.csv").read_text().count("\n") == 21  # header + 20 requests
    assert main(args + ["--policy", "nope"]) == 2  # a clear error, not a traceback


def test_the_oracle_predictor_needs_replayed_trajectories(tmp_path):
    with pytest.raises(ValueError, match="replay"):
        simulate(spec(tmp_path, policy="oracle-predictor"))


def test_oracle_counts_the_recorded_steps_left():
    conf = np.zeros((2, 8), np.float32)
    slow = Trajectory(
        0, 0.9, 4, 8, 8, ("recompute", "cache"), (np.arange(4), np.arange(4, 8)), conf
    )
    b = ReplayBehaviour([slow])
    b.assign("r", 0)
    assert b.remaining_steps("r", 0.9) == 2
    r = Request("r", (3,) * 4, 8, 8, 1, 0.9)
    r.apply(b.step(r, 0.9, StepKind.RECOMPUTE))
    assert b.remaining_steps("r", 0.9) == 1


def test_the_summary_says_what_of_the_quality_estimate_is_extrapolated(tmp_path):
    run = simulate(spec(tmp_path, planner_period=1e9))  # the default candidates, 0.7-0.9
    summary = run.summary
    assert summary["quality_measured_range"] == [0.7, 0.9]
    assert min(row["mean_threshold"] for row in run.rows) >= 0.7  # candidates 0.7-0.9 only
    assert summary["quality_extrapolated_share"] == 0.0
    assert summary["quality_accelerating_drop"] == summary["quality"]  # differs below 0.7 only
    wide = (0.5, 0.6, 0.7, 0.8, 0.9)
    low = simulate(spec(tmp_path, slo=1.0, candidates=wide, planner_period=1e9)).summary
    assert low["quality_extrapolated_share"] > 0
    assert low["quality_accelerating_drop"] < low["quality"]


def test_simulate_writes_its_run_folder_as_it_goes(tmp_path, monkeypatch):
    """config.json at once, progress.json while it runs (a long run can be watched), and the
    rest at the end, when progress.json goes."""
    import dilaserve.sim.run as run_module
    from dilaserve.cli import main

    real, seen = run_module.simulate, []

    def watched(spec, progress=None):
        def spy(now, done, total):
            progress(now, done, total)
            (folder,) = tmp_path.iterdir()
            seen.append(sorted(p.name for p in folder.iterdir()))

        return real(spec, spy)

    monkeypatch.setattr(run_module, "simulate", watched)
    argv = ["simulate", "--trace", "poisson:5:40", "--gpus", "2", "--profile", "llada-8b-gh200"]
    assert main([*argv, "--out", str(tmp_path), "--quiet"]) == 0
    assert ["config.json", "progress.json"] in seen
    (folder,) = tmp_path.iterdir()
    names = {p.name for p in folder.iterdir()}
    assert "summary.json" in names and "progress.json" not in names


def test_a_cluster_starts_at_its_policys_degree_where_the_profile_and_nodes_allow(tmp_path):
    from types import SimpleNamespace

    from dilaserve.sim.run import initial_instances, load_profile, with_start

    h100 = load_profile("llada-8b-h100")
    degrees = {p: [i.tp for i in initial_instances(with_start(spec(tmp_path, policy=p), h100))]
               for p in ("dilaserve", "no-reconfig", "infaas", "fcfs")}  # fmt: skip
    assert degrees == {"dilaserve": [2, 2], "no-reconfig": [2, 2], "infaas": [1] * 4,
                       "fcfs": [1] * 4}  # fmt: skip
    only_tp1 = SimpleNamespace(tp_degrees=(1,))  # a profile measured on one device
    assert with_start(spec(tmp_path), only_tp1).layout() == [1] * 4
    assert with_start(spec(tmp_path, gpus=3, gpus_per_node=3), h100).layout() == [1] * 3
    assert with_start(spec(tmp_path, initial_tp=4), h100).layout() == [4]  # given: kept
    run = simulate(spec(tmp_path))
    assert run.spec.initial_tp == 2  # (what the run folder's config.json records)
    assert {2: 2} in [counts for _, counts in run.result.instance_log]


def test_a_mixed_starting_layout_is_packed_onto_the_nodes_in_order(tmp_path):
    from dilaserve.sim.run import initial_instances

    s = spec(tmp_path, gpus=8, initial_layout="4x1,1x4", planner_period=1e9)
    assert [(i.node, i.tp, i.gpus) for i in initial_instances(s)] == [
        (0, 4, (0, 1, 2, 3)),
        (1, 1, (0,)),
        (1, 1, (1,)),
        (1, 1, (2,)),
        (1, 1, (3,)),
    ]
    run = simulate(s)
    assert run.result.instance_log[-1][1] == {1: 4, 4: 1}  # each start is logged
    assert run.summary["finished"] == run.summary["requests"]


@pytest.mark.parametrize(
    "layout, words",
    [("1x1,4x1", "span two nodes"), ("4x3", "needs 12 GPUs"), ("4:2", "TPxCOUNT")],
)
def test_a_bad_layout_is_refused_naming_it(tmp_path, layout, words):
    with pytest.raises(ValueError, match=words):
        spec(tmp_path, gpus=8, initial_layout=layout)


@pytest.mark.parametrize(
    "stragglers",
    [
        "2",
        "5:2",
        "1:0",
        "a:b",
        "1:2@-1",
        "1:2@x",
        "1:2@5/0",
        "1:2@5/x",
        "1:2@5/",
        "1:nan",
        "1:2@5/nan",
    ],
)
def test_bad_stragglers_are_refused_naming_them(tmp_path, stragglers):
    with pytest.raises(ValueError, match="stragglers"):
        spec(tmp_path, stragglers=stragglers)


def test_straggling_instances_slow_the_requests_bound_to_them(tmp_path):
    base = simulate(spec(tmp_path, policy="infaas", planner_period=1e9))
    none = simulate(spec(tmp_path, policy="infaas", planner_period=1e9, stragglers="0:3"))
    slow = simulate(spec(tmp_path, policy="infaas", planner_period=1e9, stragglers="2:3"))
    assert none.summary["decision_digest"] == base.summary["decision_digest"]
    # INFaaS binds each request at arrival: half of them run every step three times as long
    assert slow.summary["latency_mean"] > 1.5 * base.summary["latency_mean"]
    assert slow.summary["finished"] == slow.summary["requests"]
    # slowed from second 10 on (a GPU that throttles mid-run): the earlier arrivals' first
    # steps ran at the profile's speed, the later ones as slow as from the start
    late = simulate(spec(tmp_path, policy="infaas", planner_period=1e9, stragglers="2:3@10"))
    done_early = {
        r["request_id"]: r["latency"] for r in base.rows if r["latency"] + r["arrival"] < 10
    }
    assert done_early and all(
        done_early.get(r["request_id"], r["latency"]) == r["latency"] for r in late.rows
    )  # what finished before second 10 ran as without a straggler
    assert late.summary["latency_mean"] < slow.summary["latency_mean"]
    assert late.summary["latency_mean"] > base.summary["latency_mean"]


def test_a_straggler_that_moves_slows_each_starting_instance_in_turn(tmp_path):
    config = sim_config(spec(tmp_path, gpus=4, stragglers="1:3@10/5"))
    assert config.slowdown_moves == (5.0, ("i0", "i1", "i2", "i3"))
    sim = SimpleNamespace(config=config)  # (`_straggling` reads only the config)

    def slow_at(now):
        return [
            i for i in ("i0", "i1", "i2", "i3", "i9") if Simulator._straggling(sim, i, now) == 3
        ]

    assert [slow_at(t) for t in (10.0, 14.9, 15.0, 20.0, 25.0, 30.0)] == [
        ["i0"],
        ["i0"],
        ["i1"],
        ["i2"],
        ["i3"],
        ["i0"],
    ]  # around the starting instances; one a reconfiguration started (i9) never slows
    fixed = SimpleNamespace(config=sim_config(spec(tmp_path, gpus=4, stragglers="1:3@10")))
    assert Simulator._straggling(fixed, "i0", 99.0) == 3.0
    assert Simulator._straggling(fixed, "i1", 99.0) == 1.0


def test_pricing_instances_at_their_measured_speed_steers_work_off_a_straggler(tmp_path):
    trace = small_trace(tmp_path, rate=3.0, seconds=30.0)
    runs = {
        extension: simulate(
            spec(
                tmp_path,
                trace=trace,
                policy="no-dynamic-threshold",
                planner_period=1e9,
                stragglers="1:4",
                instance_speed=extension,
            )
        )
        for extension in (False, True)
    }
    assert runs[True].summary["finished"] == runs[True].summary["requests"]
    assert runs[True].summary["latency_mean"] < 0.9 * runs[False].summary["latency_mean"]


def test_measured_speed_without_a_straggler_makes_the_papers_decisions(tmp_path):
    # every step takes exactly the profile's time, so every ratio stays 1
    runs = [
        simulate(spec(tmp_path, planner_period=1e9, **flags))
        for flags in ({}, {"measured_speed": True}, {"instance_speed": True})
    ]
    assert len({run.summary["decision_digest"] for run in runs}) == 1


def test_with_the_plans_batch_limits_every_request_still_finishes(tmp_path):
    # Alg. 3's maxBatchSize from Stage 1 (`--plan-batch-limits`): the same run, its instances'
    # batches bounded by the plan once it is applied, which moves decisions but loses nothing
    kw = dict(planner_period=5.0, startup_delay=0.5, gpus=8, initial_tp=1)
    free = simulate(spec(tmp_path, **kw)).summary
    bounded = simulate(spec(tmp_path, plan_batch_limits=True, **kw)).summary
    assert bounded["finished"] == bounded["requests"] == free["requests"]
    assert bounded["decision_digest"] != free["decision_digest"]


@pytest.mark.parametrize("predictor", ["progress", "one-shot"])
def test_the_simulated_predictor_learns_from_requests_of_the_specs_block_length(
    tmp_path, monkeypatch, predictor
):
    from dilaserve.control.policy import get_policy
    from dilaserve.sim import predictor as sim_predictor
    from dilaserve.sim.traces import load_trace
    from dilaserve.sim.workload import make_predictor

    seen = set()
    real_run_alone = sim_predictor.run_alone

    def run_alone(behaviour, r, mode):
        seen.add(r.block_len)
        return real_run_alone(behaviour, r, mode)

    monkeypatch.setattr(sim_predictor, "run_alone", run_alone)
    s = spec(tmp_path, block_len=16)
    make_predictor(s, get_policy("dilaserve", predictor=predictor), load_trace(s.trace))
    assert seen == {16}


def test_the_speed_benchmarks_breakdown_times_every_part_and_puts_it_back(tmp_path):
    # `benchmarks/simulator.py --breakdown` wraps methods by name: a renamed one must fail here,
    # not an hour into the benchmark
    bench = import_benchmark("simulator")
    originals = {part: getattr(cls, name) for part, (cls, name) in bench.PARTS.items()}
    totals: dict[str, list] = {}
    with bench.timed_parts(totals):
        simulate(spec(tmp_path, planner_period=5.0, startup_delay=0.5))
    assert set(totals) == set(bench.PARTS)
    assert all(calls > 0 for _, calls in totals.values())  # each part ran, and was timed
    assert {part: getattr(cls, name) for part, (cls, name) in bench.PARTS.items()} == originals


def test_uniforms_draw_what_the_generator_draws_call_by_call():
    """Blocks of uniforms give the very numbers one generator call per draw gives, small and
    large Poisson means (the generator's own method) and block ends included."""
    means = np.random.default_rng(1).uniform(0.0, 14.0, 3000)
    means[::9] = 0.0
    reference, blocks = np.random.default_rng(7), Uniforms(np.random.default_rng(7))
    for k, lam in enumerate(means):
        assert blocks.poisson(lam) == int(reference.poisson(lam)), (k, lam)
        assert [blocks.random() for _ in range(k % 3)] == reference.random(k % 3).tolist()
    assert (means >= 10).sum() > 100  # (the generator's own draws were taken)
