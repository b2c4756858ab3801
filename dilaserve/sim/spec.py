"""What one simulation run is made of (`SimulationSpec`): trace, latency model, behaviour,
predictor, policy and cluster, each a field with its default."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_THRESHOLD = 0.9
THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)


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
    slo: float | None = None  # seconds; None: slo_multiple x isolated TP-1 latency
    slo_multiple: float = 5.0
    kv_cache: str = "dual"  # none | dual | block (a block-causal model's exact cache)
    block_len: int = 32
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
        if self.rate_scale <= 0:
            raise ValueError(f"{self.rate_scale=} must be positive")
        if self.slo is not None and self.slo <= 0:
            raise ValueError(f"{self.slo=} must be positive")
        if self.slo_multiple <= 0:
            raise ValueError(f"{self.slo_multiple=} must be positive")
