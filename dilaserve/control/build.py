"""Building a scheduler from files: one recipe for the cluster runtime and for replaying its
runs in the simulator, so that both hold the same control plane.

`ControlSpec` names the policy, the latency profile file, the step predictor folder, the
scheduler's knobs, and (for reconfiguration) the GPUs of each node and the planning period.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dilaserve.config import BUNDLED_PREDICTOR, BUNDLED_PROFILE
from dilaserve.control.decisions import SchedulerConfig
from dilaserve.control.planner import PlannerConfig
from dilaserve.control.policy import get_policy
from dilaserve.control.predictor import create_predictor
from dilaserve.control.profile import LatencyProfile
from dilaserve.control.quality_budget import policy_budget
from dilaserve.control.reconfigure import Reconfigurer
from dilaserve.control.scheduler import Scheduler


@dataclass(frozen=True)
class ControlSpec:
    policy: str = "dilaserve"
    profile: str = str(BUNDLED_PROFILE)  # a latency-profile JSON (a calibration's, or a preset)
    predictor: str = str(BUNDLED_PREDICTOR)  # a step-predictor folder ("": none needed)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    nodes: tuple[int, ...] = ()  # GPUs (or CPU slots) per node; () turns the planner off
    planner_period: float = 300.0
    plan_batch_limits: bool = False  # PlannerConfig.batch_limits
    candidates: tuple[float, ...] | None = None  # the threshold ladder; None: the policy's
    quality_budget: float | None = None  # Policy.quality_budget; None: the policy's, 1: none

    def __post_init__(self):
        self.make_policy()  # an unknown name or a bad ladder fails here, naming the problem
        if not Path(self.profile).is_file():
            raise ValueError(f"latency profile {self.profile} does not exist")

    def make_policy(self):
        overrides = {} if self.candidates is None else {"candidates": tuple(self.candidates)}
        if self.quality_budget is not None:
            overrides["quality_budget"] = policy_budget(self.quality_budget)
        return get_policy(self.policy, **overrides)


def tokens_per_step(predictor_folder: str | Path) -> dict[float, float]:
    """Mean tokens committed per step at each threshold, from the predictor's training runs
    (what the planner's throughput model needs)."""
    meta = json.loads((Path(predictor_folder) / "gbm-full.json").read_text())
    rates = meta["one_shot_steps_per_token"]
    return {float(k): 1.0 / v for k, v in rates.items()}


def build_scheduler(spec: ControlSpec) -> Scheduler:
    policy = spec.make_policy()
    profile = LatencyProfile.from_file(spec.profile)
    predictor = None
    if policy.is_dynamic:
        predictor = create_predictor(policy.predictor, Path(spec.predictor))
    reconfigurer = None
    if policy.reconfigure and spec.nodes:
        planner = PlannerConfig(
            spec.nodes,
            tokens_per_step(spec.predictor),
            tp_degrees=profile.tp_degrees,
            costs=spec.scheduler.costs,
            period=spec.planner_period,
            batch_limits=spec.plan_batch_limits,
        )
        reconfigurer = Reconfigurer(profile, planner)
    return Scheduler(policy, profile, predictor, spec.scheduler, reconfigurer)
