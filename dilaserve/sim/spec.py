"""What one simulation run is made of (`SimulationSpec`): trace, latency model, behaviour,
predictor, policy and cluster, each a field with its default."""

from __future__ import annotations

from dataclasses import dataclass

from dilaserve.config import DEFAULT_BLOCK_LEN, DEFAULT_THRESHOLD
from dilaserve.control.step_costs import StepCosts


@dataclass(frozen=True)
class SimulationSpec:
    policy: str = "dilaserve"
    profile: str = "llada-8b-h100"  # a preset name or a profile JSON path
    trace: str = "paper"  # paper | poisson/bursty/code/fixed:RPS:SECONDS[:...] (workload.py) | CSV
    peak_rps: float = 20.0  # the paper trace's peak
    minutes_per_hour: float = 5.0  # the paper trace: each hour of the day becomes this long
    duration: float | None = None  # keep only the first N seconds of the trace
    rate_scale: float = 1.0  # arrivals this many times as fast (a real trace, scaled)
    gpus: int = 16
    gpus_per_node: int = 4
    initial_tp: int = 1  # the cluster starts as gpus / initial_tp instances of this degree
    # or as this mix, "TPxCOUNT,...": "4x2,1x8" is two TP-4 then eight TP-1 instances, packed
    # onto the nodes in that order (the state a reconfiguration leaves)
    initial_layout: str | None = None
    # "COUNT:FACTOR": the first COUNT starting instances take FACTOR times as long per step as
    # the profile says (a throttled GPU, a noisy neighbour); the control plane is not told
    stragglers: str | None = None
    # the simulator reports step times to the control plane as the live cluster does, which
    # then prices steps at the cluster's measured slowdown (`control/speed.py`; with no
    # straggler and no noise it stays exactly 1) ...
    measured_speed: bool = False
    # ... and, an extension, Alg. 3 prices each instance at its own (SchedulerConfig's
    # `instance_speed`; it implies `measured_speed`)
    instance_speed: bool = False
    slo: float | None = None  # seconds; None: slo_multiple x isolated TP-1 latency
    slo_multiple: float = 5.0
    kv_cache: str = "dual"  # none | dual | block (a block-causal model's exact cache)
    block_len: int = DEFAULT_BLOCK_LEN
    # the default threshold: requests start at it, fixed-threshold policies keep it, the SLO's
    # isolated latency is taken at it (a dynamic policy's range is `candidates`)
    threshold: float = DEFAULT_THRESHOLD
    max_batch_tokens: int = 65536
    max_requests_per_instance: int = 64
    max_batch_requests: int | None = None  # requests one step batch may hold (None: no limit)
    refresh_every_tokens: int = 8
    slo_headroom: float = 1.0  # the paper's Alg. 1; see SchedulerConfig
    refresh_interval: float = 0.05  # see SchedulerConfig
    planner_period: float = 300.0
    startup_delay: float = 30.0
    serial_launches: bool = False  # a reconfiguration's launches wait for one another
    rate_trend: bool = True  # the planner plans for the load's growth (monitor.py)
    plan_batch_limits: bool = False  # the plan's batch sizes bound instances (Alg. 3)
    latency_noise: float = 0.0
    interval: float = 300.0  # seconds per row of the per-interval metrics
    predictor_prompts: int = 100  # sample requests the simulated predictor trains on
    behaviour: str = "parametric"  # or "replay:TRAJECTORIES.npz" (recorded engine steps)
    predictor_path: str | None = None  # replay: a trained predictor folder (default: bundled)
    quality: str | None = None  # an eval summary.json (default: LLaDA-8B's GSM8K curve)
    candidates: tuple[float, ...] | None = None  # a dynamic policy's thresholds (None: 0.5-0.9)
    seed: int = 0

    def __post_init__(self):
        if self.gpus <= 0 or self.gpus % self.initial_tp:
            raise ValueError(f"{self.gpus=} must be a positive multiple of {self.initial_tp=}")
        self.layout()  # a malformed layout or straggler count fails here, not mid-run
        self.parsed_stragglers()
        StepCosts(self.kv_cache, self.block_len)  # a bad cache mode or block fails here
        if self.rate_scale <= 0:
            raise ValueError(f"{self.rate_scale=} must be positive")
        if self.slo is not None and self.slo <= 0:
            raise ValueError(f"{self.slo=} must be positive")
        if self.slo_multiple <= 0:
            raise ValueError(f"{self.slo_multiple=} must be positive")

    @property
    def costs(self) -> StepCosts:
        """The cache mode and block length: what the simulator reads the cache through."""
        return StepCosts(self.kv_cache, self.block_len)

    def layout(self) -> list[int]:
        """The starting instances' TP degrees, in the order they are packed onto nodes."""
        if self.initial_layout is None:
            return [self.initial_tp] * (self.gpus // self.initial_tp)
        degrees = []
        for part in self.initial_layout.split(","):
            tp, sep, count = part.strip().partition("x")
            if not sep or not tp.isdigit() or not count.isdigit() or int(tp) <= 0:
                raise ValueError(
                    f"{self.initial_layout=}: each part is TPxCOUNT (e.g. '4x2,1x8'), not {part!r}"
                )
            degrees += [int(tp)] * int(count)
        first = 0
        for tp in degrees:
            if first // self.gpus_per_node != (first + tp - 1) // self.gpus_per_node:
                raise ValueError(
                    f"{self.initial_layout=}: a TP-{tp} instance would span two nodes of "
                    f"{self.gpus_per_node} GPUs (list wider instances first)"
                )
            first += tp
        if first > self.gpus:
            raise ValueError(f"{self.initial_layout=} needs {first} GPUs; {self.gpus=}")
        return degrees

    def parsed_stragglers(self) -> tuple[int, float]:
        """(how many of the first instances are slow, their step-time factor); (0, 1.0): none."""
        if self.stragglers is None:
            return 0, 1.0
        count, sep, factor = self.stragglers.partition(":")
        try:
            n, f = int(count), float(factor)
        except ValueError:
            n, f = -1, 0.0
        if not sep or n < 0 or f <= 0 or n > len(self.layout()):
            raise ValueError(
                f"{self.stragglers=} must be COUNT:FACTOR, at most the starting instances "
                f"({len(self.layout())}) and a positive factor, e.g. '2:1.5'"
            )
        return n, f
