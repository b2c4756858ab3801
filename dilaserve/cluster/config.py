"""A cluster's configuration: its instances at start, their layout over nodes, the backend that
runs them, and the control plane it drives."""

from __future__ import annotations

from dataclasses import dataclass, field

from dilaserve.cluster.backends import Backend, LocalBackend
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.control.admission import OVERLOAD_MODES, TIME_MODELS
from dilaserve.control.build import ControlSpec
from dilaserve.control.decisions import InstanceSpec
from dilaserve.control.profile import LatencyProfile

HUNG_STEP_FACTOR = 10.0  # a step this many times the slowest predicted one counts as hung
MIN_STEP_TIMEOUT = 10.0  # seconds, whatever the profile says (a busy machine, a cold start)
ADMISSION_WAIT = 0.05  # seconds (`ClusterConfig.admission_wait`)


@dataclass(frozen=True)
class ClusterConfig:
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    control: ControlSpec = field(default_factory=ControlSpec)
    instances: tuple[int, ...] = (1, 1)  # the TP degree of each instance at start
    gpus_per_node: int | None = None  # None: every instance's GPUs on one node
    backend: str = "local"  # "local" | "ray"
    ray_address: str | None = None
    tick: float = 0.5  # seconds between scheduler ticks
    max_tokens: int = 64  # the output window of requests that name none
    max_batch_tokens: int = 8192  # per instance and step
    replace_failed: bool = True
    # a rank process kept waiting with torch imported, the next one started (the local backend)
    spare_worker: bool = True
    step_timeout: float | None = None  # seconds a step may run, at the profile's speed, before
    # its instance counts as hung (killed and replaced); the controller scales it by the
    # instance's measured slowdown; None: from the latency profile (`derived_step_timeout`)
    start_timeout: float = 300.0  # seconds to wait for the initial instances to load
    record: bool = False  # keep a `Recording` (for replay in the simulator)
    max_in_flight: int = 1024  # a backstop: more waiting or running requests are refused
    overload: str = "reject"  # a request over capacity (`admission`): "reject" | "deprioritize"
    admission_time: str = "batched"  # a request's predicted time at admission: "batched" (its
    # steps in the batch it shares, `control/batched_time.py`) | "queue" (the load ahead of it)
    # seconds a request may wait for admission's answer, as the front expects it (the
    # requests ahead of it times admission's pace, `gate.Pace`): one that would wait longer
    # is refused at once. Half issue 38's bound on a refusal's p99 (100 ms): the waits ran
    # up to twice the pace's median (docs/serving/reliability.md)
    admission_wait: float = ADMISSION_WAIT
    measured_speed: bool = True  # price steps at their measured slowdown (`control/speed.py`)
    dws: str | None = None  # a DWS predictor folder: expected cost and step prior at admission
    dws_cost: str | None = None  # its cost kernel (`dilaserve profile --dws`); None: unit cost
    dws_prior: bool = False  # give the step predictor DWS's expected steps before step 1

    def __post_init__(self):
        if not self.instances or min(self.instances) < 1:
            raise ValueError(f"{self.instances=} must list at least one TP degree >= 1")
        if self.backend not in ("local", "ray"):
            raise ValueError(f"{self.backend=} must be 'local' or 'ray'")
        if self.tick <= 0 or (self.step_timeout is not None and self.step_timeout <= 0):
            raise ValueError(f"{self.tick=} and {self.step_timeout=} must be positive")
        if not self.admission_wait > 0:
            raise ValueError(f"{self.admission_wait=} must be positive (seconds)")
        if self.overload not in OVERLOAD_MODES:
            raise ValueError(f"{self.overload=} must be one of {OVERLOAD_MODES}")
        if self.admission_time not in TIME_MODELS:
            raise ValueError(f"{self.admission_time=} must be one of {TIME_MODELS}")
        engine, scheduler = self.worker.engine.block_len, self.control.scheduler.block_len
        if engine != scheduler:
            raise ValueError(f"engine block_len={engine} differs from the scheduler's {scheduler}")

    def dws_estimator(self):
        """The DWS estimator `dws` names (expected cost and step prior at admission), or None."""
        if self.dws is None:
            return None
        from dilaserve.dws.estimate import DWSEstimator

        return DWSEstimator.load(self.dws, self.dws_cost, self.control.predictor)

    def derived_step_timeout(self, profile: LatencyProfile) -> float:
        """`step_timeout` if set; else the slowest step the scheduler can launch (a full-sequence
        step of `max_batch_tokens` on the layout's slowest TP degree, as `profile` predicts it)
        times `HUNG_STEP_FACTOR`, and at least `MIN_STEP_TIMEOUT` seconds. Either is the
        timeout at the profile's speed: the controller multiplies it by each instance's
        measured slowdown (`HangWatch.timeout_of`), so that a loaded machine's slow
        steps are not taken for hung ones."""
        if self.step_timeout is not None:
            return self.step_timeout
        kind = self.control.scheduler.costs.sequence_kind
        slowest = max(
            profile.step_latency(tp, self.max_batch_tokens, kind) for tp in set(self.instances)
        )
        return max(slowest * HUNG_STEP_FACTOR, MIN_STEP_TIMEOUT)

    def initial_specs(self) -> list[InstanceSpec]:
        """Instances laid out in order over nodes of `gpus_per_node` GPUs."""
        per_node = self.gpus_per_node or sum(self.instances)
        specs, node, used = [], 0, 0
        for k, tp in enumerate(self.instances):
            if used + tp > per_node:
                node, used = node + 1, 0
            gpus = tuple(range(used, used + tp))
            specs.append(InstanceSpec(f"i{k}", node, tp, gpus, self.max_batch_tokens))
            used += tp
        return specs


def make_backend(config: ClusterConfig) -> Backend:
    """The backend `config` names: local worker processes or Ray actors."""
    if config.backend == "ray":
        from dilaserve.cluster.ray_backend import RayBackend

        return RayBackend(config.worker, address=config.ray_address)
    return LocalBackend(config.worker, spare=config.spare_worker)
