"""What the scheduler is configured with and what it returns (the control plane's outputs)."""

from __future__ import annotations

from dataclasses import dataclass

from dilaserve.config import DEFAULT_BLOCK_LEN
from dilaserve.control.step_costs import StepCosts
from dilaserve.protocol import KVCacheMode, StepBatch
from dilaserve.quality import LLADA_GSM8K, QualityModel


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    kv_cache: KVCacheMode = KVCacheMode.DUAL
    block_len: int = DEFAULT_BLOCK_LEN
    slo: float = 10.0  # seconds, for requests that carry no deadline
    refresh_every_tokens: int = 8
    max_requests_per_instance: int = 64  # the load model's batch size (Alg. 2/4 capacity)
    max_batch_requests: int | None = None  # requests one step batch may hold; None: no limit
    load_control_interval: float = 0.05  # seconds between re-runs triggered by refreshes only
    refresh_interval: float = 0.05  # seconds between batched refreshes (first predictions: always)
    # Alg. 1 fits the predicted remaining time into this share of the budget left: 1.0 is the
    # paper's rule. A policy may set its own (`dilaserve-headroom`: 0.5, a tuned extension).
    slo_headroom: float = 1.0
    # Alg. 3 prices each instance's step at that instance's measured speed (`speed.py`), so
    # that a straggler the profile does not know looks as slow as it is; None: the policy's
    # (`Policy.instance_speed`: DiLaServe's on, the paper's reading off)
    instance_speed: bool | None = None
    # beyond the paper: a request leaves its instance for Alg. 3's pick only if the move saves
    # this many request-seconds of the next step (its own, after that instance's running step,
    # and the other requests' of both batches; `placement.py`); 0: whenever it saves any
    migration_price: float = 0.0
    # accuracy at a mean threshold, what a policy's quality budget is kept on
    # (`quality_budget.py`): by default LLaDA-8B's GSM8K curve as the paper reports it
    quality: QualityModel = LLADA_GSM8K

    def __post_init__(self):
        object.__setattr__(self, "kv_cache", KVCacheMode(self.kv_cache))
        if self.slo <= 0:
            raise ValueError(f"{self.slo=} must be positive")
        if not 0 < self.slo_headroom <= 1:
            raise ValueError(f"{self.slo_headroom=} must be in (0, 1]")
        if self.refresh_every_tokens <= 0:
            raise ValueError(f"{self.refresh_every_tokens=} must be positive")

    @property
    def costs(self) -> StepCosts:
        """The kinds, tokens and curves of a request's steps under this cache mode: what the
        control plane reads the cache mode through."""
        return StepCosts(self.kv_cache, self.block_len)


@dataclass(frozen=True, slots=True)
class StepLaunch:
    """A step batch the scheduler launches on an instance."""

    instance_id: str
    batch: StepBatch


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """An instance the planner wants started: where, with which GPUs, and its batch limit."""

    instance_id: str
    node: int
    tp: int
    gpus: tuple[int, ...]
    max_batch_tokens: int | None = None  # None: the driver's default


@dataclass(frozen=True, slots=True)
class RolloutStep:
    """One step of a reconfiguration's rollout: stop these instances, then start one."""

    stop: tuple[str, ...]  # running instances to stop first (their GPUs are needed)
    start: InstanceSpec


@dataclass(frozen=True, slots=True)
class Reconfiguration:
    """A plan to carry out in order: each step stops what is in its way, then starts one
    instance; a step that stops something waits until every earlier launch is up (`serial`:
    every step does); `stop_after` go last (`control/rollout.py`)."""

    steps: tuple[RolloutStep, ...]
    stop_after: tuple[str, ...]
    target: dict[int, int]  # instances per TP degree once done
    serial: bool = False
    # Alg. 3's maxBatchSize per TP degree from the plan, tp -> (full-sequence, cache-step)
    # tokens (`PlannerConfig.batch_limits`); None: instances keep the limit they started with
    batch_limits: dict[int, tuple[int, int | None]] | None = None


@dataclass(frozen=True, slots=True)
class Decisions:
    launches: tuple[StepLaunch, ...] = ()
    releases: tuple[tuple[str, str], ...] = ()  # (instance, request) whose state must go
    finished: tuple[str, ...] = ()
    reconfiguration: Reconfiguration | None = None
