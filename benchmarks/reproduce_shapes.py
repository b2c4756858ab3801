"""Workload-shape experiments of `reproduce.py`: each mechanism and baseline on the paper's
settings and on three shapes the paper did not try (`mechanisms`), Alg. 3 against INFaaS at more
seeds (`placement`), and how much of the gain rests on extrapolated thresholds (`quality`).
Each takes the reproduction's `Experiments` (run folders, report sections)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reproduce import Experiments

GH200 = "llada-8b-gh200"  # the paper's Cluster 1 (Table 4, ablations)


# Workload shapes for the mechanism table, on one node of 4 GPUs (the paper's per-GPU pressure,
# a quarter of its events), short traces to fit a shared machine: the paper's Fig. 10 setting
# (on ShareGPT's lengths and on its own) and diurnal trace, then three shapes the paper did not
# try. Reconfiguration needs planning
# rounds within the trace: the diurnal trace is compressed 20x (an hour in 15 s; period and
# start-up shrink with it), the others keep a 30 s start-up with a 50 s period.
AZURE = "../shared/data/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
NO_PLANNER = {"planner_period": 1e9}
STRAGGLER = "straggler: Poisson 3/s, 1 of 4 GPUs at half speed"
SHAPES = {
    "paper Fig. 10: Poisson 5/s": {"trace": "poisson:5:60", **NO_PLANNER},
    # the same on Fig. 10's own requests (GSM8K 5-shot: 1,020-token prompts, 256-token answers),
    # 3/s: the load that saturates 4 GPUs at threshold 0.9 (reproduce_lengths.request_work)
    "paper Fig. 10 on GSM8K: Poisson 3/s": {"trace": "fixed:3:300:1020:256", **NO_PLANNER},
    "paper diurnal, peak 3.5/s": {
        "trace": "paper",
        "peak_rps": 3.5,
        "minutes_per_hour": 0.25,
        "planner_period": 15.0,
        "startup_delay": 1.5,
    },
    "conversation: Azure 2023 x0.4": {
        "trace": AZURE,
        "duration": 150.0,
        "rate_scale": 0.4,
        "planner_period": 50.0,
    },
    "code-like: bursty 6/s": {"trace": "code:6:150:3", "planner_period": 50.0},
    "bursty ShareGPT 3/s": {"trace": "bursty:3:150:3", "planner_period": 50.0},
    # one of the node's GPUs at half the profile's speed, which the control plane is not told
    # (a throttled GPU, a noisy neighbour): what migration is for (docs/simulator/paper-lengths.md)
    STRAGGLER: {
        "trace": "poisson:3:150",
        "stragglers": "1:2",
        **NO_PLANNER,
    },
}
# (column, policy A, policy B, the paper's number): the effect is A's attainment minus B's in
# points, or for a column ending in "p99", A's p99 latency over B's, less one, in percent
EFFECTS = (
    ("dynamic threshold", "no-load-control", "no-dynamic-threshold", "up to +70.8 pp (Fig. 10)"),
    ("load control", "dilaserve", "no-load-control", "up to +42.4 pp (Fig. 10)"),
    ("reconfiguration", "dilaserve", "no-reconfig", "Fig. 11 (a shape, no number)"),
    ("placement (fixed 0.9)", "placement-only", "infaas", ">= 0 (our target)"),
    ("migration", "dilaserve", "no-migration", "none"),
    ("migration p99", "dilaserve", "no-migration", "up to -19% (Fig. 13)"),
    ("vs INFaaS", "dilaserve", "infaas", "+21.1 pp (Table 4)"),
    ("vs Llumnix", "dilaserve", "llumnix", "+30.2 pp (Table 4)"),
    ("Llumnix - INFaaS", "llumnix", "infaas", "-9.1 pp (Table 4)"),
    ("FCFS - INFaaS", "fcfs", "infaas", "none"),
    ("ext. headroom 0.5", "dilaserve-headroom", "dilaserve", "none (ours)"),
    ("ext. budget window", "dilaserve-budget", "dilaserve", "none (ours)"),
)
MECHANISM_POLICIES = (
    "dilaserve",
    "dilaserve-headroom",
    "dilaserve-budget",
    "no-load-control",
    "no-dynamic-threshold",
    "no-reconfig",
    "no-migration",
    "infaas",
    "llumnix",
    "fcfs",
)


def mechanisms(x: Experiments) -> None:
    """Each mechanism's and baseline's effect on SLO attainment, in points, per workload shape:
    the mean over seeds and the range, beside the paper's number (`--shapes`: only the shapes
    whose names contain one of these words)."""
    rows, seeds = [{"shape": "paper", **{col: paper for col, _, _, paper in EFFECTS}}], x.seeds
    for shape, tag, changes in shapes_to_run(x):
        summaries = {}
        for seed in seeds:
            for policy, run_as, extra in shape_policies(changes):
                name = f"mech-{tag}-{policy}-s{seed}"
                spec = {**changes, **extra}
                s = x.run(name, policy=run_as, gpus=4, profile=GH200, seed=seed, **spec)
                summaries[policy, seed] = s
        rows.append({"shape": shape, **effects(summaries, seeds)})
    x.section(
        "Mechanisms: effect on SLO attainment (points; mean over seeds [min, max])",
        rows,
        f"4 GPUs (one node), GH200 preset, seeds {list(seeds)}. placement-only is "
        "no-dynamic-threshold with the planner off.",
    )


def shapes_to_run(x: Experiments):
    """(name, tag for run folders, spec changes) of each workload shape to run: those `--shapes`
    names (all if none), the Azure trace only where its file is."""
    for shape, changes in SHAPES.items():
        if changes["trace"] == AZURE and not Path(AZURE).exists():
            continue
        if x.shapes and not any(word in shape for word in x.shapes):
            continue
        yield shape, re.sub(r"[^A-Za-z0-9]+", "-", shape.split(":")[0]).strip("-"), changes


def shape_policies(changes: dict) -> list[tuple[str, str, dict]]:
    """(name, policy run, spec changes): without a planner no-reconfig is dilaserve and
    placement-only is no-dynamic-threshold, so they are not run twice."""
    out = [(p, p, {}) for p in MECHANISM_POLICIES]
    if changes.get("planner_period") == NO_PLANNER["planner_period"]:
        return [o for o in out if o[0] != "no-reconfig"]
    return out + [("placement-only", "no-dynamic-threshold", NO_PLANNER)]


def effects(summaries: dict, seeds) -> dict:
    """Each `EFFECTS` column from the runs' summaries, (policy, seed) -> summary."""

    def of(policy: str, seed: int) -> dict:
        alias = {"no-reconfig": "dilaserve", "placement-only": "no-dynamic-threshold"}
        return summaries.get((policy, seed), summaries.get((alias.get(policy), seed)))

    out = {}
    for column, a, b, _ in EFFECTS:
        if a == "dilaserve" and b == "no-reconfig" and (b, seeds[0]) not in summaries:
            out[column] = "n/a (planner off)"
        elif column.endswith("p99"):
            ratios = [of(a, s)["latency_p99"] / of(b, s)["latency_p99"] for s in seeds]
            out[column] = spread([100 * (r - 1) for r in ratios]).replace(" [", "% [")
        else:
            gains = [of(a, s)["slo_attainment"] - of(b, s)["slo_attainment"] for s in seeds]
            out[column] = spread([100 * g for g in gains])
    return out


def spread(diffs: list[float]) -> str:
    """Points: the mean [min, max]."""
    return f"{sum(diffs) / len(diffs):+.1f} [{min(diffs):+.1f}, {max(diffs):+.1f}]"


def placement(x: Experiments, seeds=(0, 1, 2, 3)) -> None:
    """Alg. 3 at a fixed threshold (0.9, the planner off) against INFaaS on every workload shape
    (`--shapes` as for the mechanisms), at more seeds than the mechanism table."""
    rows = []
    for shape, tag, changes in shapes_to_run(x):
        spec = {**changes, **NO_PLANNER, "gpus": 4, "profile": GH200}
        attained = {
            policy: [
                x.run(f"place-{tag}-{policy}-s{seed}", policy=policy, seed=seed, **spec)[
                    "slo_attainment"
                ]
                for seed in seeds
            ]
            for policy in ("no-dynamic-threshold", "infaas")
        }
        alg3, infaas = attained["no-dynamic-threshold"], attained["infaas"]
        rows.append(
            {
                "shape": shape,
                "alg3": round(sum(alg3) / len(seeds), 4),
                "infaas": round(sum(infaas) / len(seeds), 4),
                "alg3_minus_infaas": spread([100 * (a - b) for a, b in zip(alg3, infaas)]),
            }
        )
    x.section(f"Placement: Alg. 3 against INFaaS at threshold 0.9, seeds {list(seeds)}", rows)


# (row, policy, spec changes): Alg. 3 at a fixed threshold and DiLaServe, as the simulator
# runs them without per-instance speeds (no step times reported), at the cluster's measured
# slowdown (as `serve` ran before 2026-12-07), and pricing each instance at its own (DiLaServe's
# default since), beside INFaaS and no migration
PROFILE_ONLY = {"instance_speed": False}
MEASURED = {"measured_speed": True, "instance_speed": False}
PER_INSTANCE = {"instance_speed": True}
STRAGGLER_ROWS = (
    ("Alg. 3, fixed 0.9 (placement-only)", "no-dynamic-threshold", PROFILE_ONLY),
    ("Alg. 3, fixed 0.9, per-instance speeds", "no-dynamic-threshold", PER_INSTANCE),
    ("INFaaS", "infaas", {}),
    ("DiLaServe, the profile alone", "dilaserve", PROFILE_ONLY),
    ("DiLaServe, cluster's measured slowdown", "dilaserve", MEASURED),
    ("DiLaServe, per-instance speeds (the default)", "dilaserve", PER_INSTANCE),
    ("DiLaServe without migration, the profile alone", "no-migration", PROFILE_ONLY),
    ("DiLaServe without migration, per-instance speeds", "no-migration", PER_INSTANCE),
)


def stragglers(x: Experiments, seeds=(0, 1, 2, 3)) -> None:
    """The straggler shape with and without pricing each instance at its measured speed
    (`--instance-speed`, DiLaServe's default): SLO attainment and p99 latency per policy, the
    mean over seeds, and each row's attainment minus INFaaS's."""
    spec = {**SHAPES[STRAGGLER], "gpus": 4, "profile": GH200}
    runs = {
        label: [
            x.run(
                f"straggle-{policy}{''.join(f'-{k}-{v}' for k, v in changes.items())}-s{seed}",
                policy=policy,
                seed=seed,
                **spec,
                **changes,
            )
            for seed in seeds
        ]
        for label, policy, changes in STRAGGLER_ROWS
    }
    infaas = [s["slo_attainment"] for s in runs["INFaaS"]]
    rows = [
        {
            "policy": label,
            "slo_attainment": mean_of(out, "slo_attainment"),
            "latency_p99_s": round(sum(s["latency_p99"] for s in out) / len(out), 1),
            "minus_infaas": spread([100 * (s["slo_attainment"] - i) for s, i in zip(out, infaas)]),
        }
        for label, out in runs.items()
    ]
    x.section(
        f"Stragglers: {STRAGGLER}, 4 GH200s, seeds {list(seeds)}",
        rows,
        "Means over the seeds; minus_infaas in points, mean [min, max]. Per-instance speeds: "
        "Alg. 3 prices each instance's step at that instance's measured speed (DiLaServe's "
        "default since 2026-12-07; the cluster's measured slowdown applies too).",
    )


# A straggler that moves (a noisy neighbour, throttling that passes from GPU to GPU) on Fig. 13's
# longest outputs, 8 TP-2 instances: two at a third of their speed, the slowdown passing on
# every 60 s (long against a request's life, so a request bound where it landed stays slow) and
# every 30 s (where it passes over every request alike)
MOVING = {"trace": "fixed:2.4:300:256:1024", "gpus": 16, "profile": GH200, **NO_PLANNER}
MOVING_STRAGGLERS = ("2:3@30/60", "2:3@30/90", "2:4@30/30")


def moving(x: Experiments, seeds=(0, 1, 2, 3)) -> None:
    """Migration with a straggler that moves: DiLaServe against its no-migration ablation (and
    INFaaS), attainment and p99 per seed, and migration's effect in points."""
    rows = []
    for stragglers in MOVING_STRAGGLERS:
        runs = {
            policy: [
                x.run(
                    f"moving-{policy}-{stragglers.replace('/', 'every')}-s{seed}",
                    policy=policy,
                    seed=seed,
                    stragglers=stragglers,
                    **MOVING,
                )
                for seed in seeds
            ]
            for policy in ("dilaserve", "no-migration", "infaas")
        }
        for policy, out in runs.items():
            rows.append(
                {"stragglers": stragglers, "policy": policy}
                | {"slo_attainment": " / ".join(f"{s['slo_attainment']:.2%}" for s in out)}
                | {"latency_p99_s": " / ".join(f"{s['latency_p99']:.0f}" for s in out)}
            )
        effect = [
            100 * (a["slo_attainment"] - b["slo_attainment"])
            for a, b in zip(runs["dilaserve"], runs["no-migration"])
        ]
        rows.append(
            {
                "stragglers": stragglers,
                "policy": "migration's effect",
                "slo_attainment": spread(effect),
                "latency_p99_s": " / ".join(
                    f"{a['latency_p99'] / b['latency_p99'] - 1:+.0%}"
                    for a, b in zip(runs["dilaserve"], runs["no-migration"])
                ),
            }
        )
    x.section(
        "Migration with a straggler that moves: Fig. 13's lengths, 16 GH200 (8 TP-2), "
        f"seeds {list(seeds)}",
        rows,
        "COUNT:FACTOR@ONSET/PERIOD: COUNT instances at 1/FACTOR of their speed from ONSET, the "
        "slowdown passing to the next instances every PERIOD seconds (`--stragglers`). Effect: "
        "dilaserve minus no-migration, points, mean [min, max].",
    )


def quality(x: Experiments, seeds=(0, 1)) -> None:
    """How much of the gain rests on extrapolated thresholds: the Fig. 10 shape (4 GPUs) with
    the candidates 0.5-0.9 and restricted to the measured 0.7-0.9, each with its quality under
    the paper's linear curve and under the bundled model's accelerating drop below 0.7."""
    rows = []
    for candidates in ((0.5, 0.6, 0.7, 0.8, 0.9), (0.7, 0.8, 0.9)):
        for policy in ("dilaserve", "infaas"):
            if policy == "infaas" and candidates[0] != 0.5:
                continue  # a fixed threshold has no candidates
            for seed in seeds:
                low = f"{candidates[0]:g}"
                s = x.run(
                    f"quality-{policy}-from{low}-s{seed}",
                    policy=policy,
                    candidates=candidates,
                    gpus=4,
                    profile=GH200,
                    seed=seed,
                    **SHAPES["paper Fig. 10: Poisson 5/s"],
                )
                rows.append(
                    {
                        "policy": policy,
                        "candidates": f"{low}-0.9",
                        "seed": seed,
                        "slo_attainment": s["slo_attainment"],
                        "mean_threshold": s["mean_threshold"],
                        "extrapolated_share": s["quality_extrapolated_share"],
                        "quality_linear": s["quality"],
                        "quality_accelerating": s["quality_accelerating_drop"],
                        "run": s["run"],
                    }
                )
    x.section(
        "Quality: measured and extrapolated thresholds",
        rows,
        "Quality is LLaDA-8B's GSM8K accuracy at each request's mean threshold: measured by the "
        "paper at 0.9 and 0.7, extrapolated below 0.7 (linearly, or with the bundled model's "
        "accelerating drop). Paper: under 1% accuracy loss.",
    )


def batch_limits(x: Experiments, table4_seeds=(0, 1, 2)) -> None:
    """Alg. 3's maxBatchSize read as the batch size Stage 1 chose for the instance's TP degree
    (`--plan-batch-limits`), against the default, the instance's own batch-token limit: the Table
    4 trace (16 GH200s) and the mechanism shapes the planner runs in (`--shapes` as for the
    mechanisms), each at its seeds. The paper's Alg. 3 reads `inst.maxBatchSize` without saying
    where it comes from (papers.md 1.7)."""
    settings = [("Table 4 trace, 16 GH200s", "table4", {"profile": GH200}, table4_seeds)]
    for shape, tag, changes in shapes_to_run(x):
        if changes.get("planner_period") != NO_PLANNER["planner_period"]:
            settings.append((shape, tag, {**changes, "gpus": 4, "profile": GH200}, x.seeds))
    rows = []
    for setting, tag, spec, seeds in settings:
        runs = {
            limits: [
                x.run(
                    f"batchlim-{tag}{'-limits' if limits else ''}-s{seed}",
                    policy="dilaserve",
                    seed=seed,
                    plan_batch_limits=limits,
                    **spec,
                )
                for seed in seeds
            ]
            for limits in (False, True)
        }
        rows.append(
            {
                "setting": setting,
                "seeds": len(seeds),
                "slo_default": mean_of(runs[False], "slo_attainment"),
                "slo_plan_limits": mean_of(runs[True], "slo_attainment"),
                "effect": spread(
                    [
                        100 * (b["slo_attainment"] - a["slo_attainment"])
                        for a, b in zip(*runs.values())
                    ]
                ),
                "latency_mean_default_s": mean_of(runs[False], "latency_mean"),
                "latency_mean_plan_limits_s": mean_of(runs[True], "latency_mean"),
                "digests_default": " ".join(s["decision_digest"][:16] for s in runs[False]),
            }
        )
    x.section(
        "Batch limits: Stage 1's batch sizes as Alg. 3's maxBatchSize",
        rows,
        "DiLaServe with each instance's batch bounded by the batch sizes the applied plan chose "
        "for its TP degree (full-sequence and cache-step tokens apart), against the default "
        "(the instance's batch-token limit). Effect in points, mean [min, max] over the seeds.",
    )


def mean_of(summaries: list[dict], key: str) -> float:
    return round(sum(s[key] for s in summaries) / len(summaries), 4)
