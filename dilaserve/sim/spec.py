"""What one simulation run is made of (`SimulationSpec`): trace, latency model, behaviour,
predictor, policy and cluster, each a field with its default."""

from __future__ import annotations

from dataclasses import dataclass

from dilaserve.config import DEFAULT_BLOCK_LEN, DEFAULT_THRESHOLD, setting
from dilaserve.control.step_costs import StepCosts


@dataclass(frozen=True)
class SimulationSpec:
    """Every field is a `dilaserve simulate` option of the same name (`cli_args.spec_options`),
    its help the text given here."""

    policy: str = setting("dilaserve", "dilaserve, fcfs, infaas, llumnix, dws-sjf or an ablation")
    profile: str = setting(
        "llada-8b-h100", "latency profile: a preset (llada-8b-h100, ..., llada2-mini-h200) or JSON"
    )
    trace: str = setting(
        "paper",
        "paper | poisson:RPS:SECONDS | bursty/code:RPS:SECONDS[:CV] | "
        "fixed:RPS:SECONDS:PROMPT:OUTPUT[/OUTPUT...] | CSV path (sim/workload.py)",
    )
    peak_rps: float = setting(20.0, "the paper trace's peak requests per second")
    minutes_per_hour: float = setting(
        5.0, "the paper trace: each hour of the day becomes this many minutes"
    )
    duration: float | None = setting(None, "keep only the first N seconds of the trace")
    rate_scale: float = setting(1.0, "arrivals this many times as fast (a real trace, scaled)")
    gpus: int = setting(16, "GPUs of the simulated cluster")
    gpus_per_node: int = setting(4, "GPUs per node (a TP group never spans two)")
    initial_tp: int | None = setting(
        None,
        "the cluster starts as GPUS / INITIAL_TP instances of this degree; default: the "
        "policy's (dilaserve: 2, the baselines: 1) where the profile has it and it fits, else 1",
    )
    initial_layout: str | None = setting(
        None,
        "or starts as this mix, TPxCOUNT,...: 4x2,1x8 is two TP-4 then eight TP-1 instances, "
        "packed onto the nodes in that order (the state a reconfiguration leaves)",
    )
    stragglers: str | None = setting(
        None,
        "COUNT:FACTOR[@SECONDS[/PERIOD]]: the first COUNT starting instances take FACTOR "
        "times as long per step as the profile says (a throttled GPU, a noisy neighbour), from "
        "simulated second SECONDS on (default 0); with PERIOD, every PERIOD seconds the "
        "slowdown moves on to the next COUNT starting instances (a neighbour that moves); "
        "the control plane is not told",
    )
    measured_speed: bool = setting(
        False,
        "report step times to the control plane as the live cluster does, which then prices "
        "steps at the cluster's measured slowdown (control/speed.py)",
    )
    instance_speed: bool | None = setting(
        None,
        "Alg. 3 prices each instance at its own measured speed, a straggler's too (implies "
        "the measured speed); default: the policy's (DiLaServe's on, dilaserve-paper's off)",
    )
    slo: float | None = setting(None, "seconds per request; default: SLO_MULTIPLE x isolated")
    slo_multiple: float = setting(5.0, "the SLO as a multiple of a request's isolated TP-1 latency")
    kv_cache: str = setting(
        "dual",
        "none | dual | block (a block-causal model's exact cache, with an llada2-* profile)",
        choices=("none", "dual", "block"),
    )
    block_len: int = setting(DEFAULT_BLOCK_LEN, "tokens per semi-autoregressive block")
    threshold: float = setting(
        DEFAULT_THRESHOLD,
        "the default threshold: requests start at it, fixed-threshold policies keep it, the "
        "SLO's isolated latency is taken at it (DWS: 0.95)",
    )
    max_batch_tokens: int = setting(65536, "tokens one step batch of an instance may hold (Alg. 3)")
    max_requests_per_instance: int = setting(64, "the load model's batch size (Alg. 2/4)")
    max_batch_requests: int | None = setting(
        None, "requests one step batch may hold; default: no limit but the batch tokens"
    )
    refresh_every_tokens: int = setting(8, "a request's prediction is refreshed every K commits")
    slo_headroom: float = setting(
        1.0, "Alg. 1 fits the predicted time into this share of the budget left (1: the paper's)"
    )
    refresh_interval: float = setting(0.05, "seconds between batched prediction refreshes")
    planner_period: float = setting(300.0, "seconds between ILP planner rounds")
    startup_delay: float = setting(30.0, "seconds a new instance loads before it takes work")
    serial_launches: bool = setting(
        False, "a reconfiguration launches each instance only once the one before it is up"
    )
    rate_trend: bool = setting(
        True, "the planner plans for the load's growth (no: the last window's rates)"
    )
    plan_batch_limits: bool = setting(
        False, "the planner's batch sizes bound each instance's batch (Alg. 3's maxBatchSize)"
    )
    latency_noise: float = setting(
        0.0, "sigma of a log-normal factor on each simulated step's duration (0: none)"
    )
    interval: float = setting(300.0, "seconds per row of the per-interval metrics")
    predictor_prompts: int = setting(100, "sample requests the simulated step predictor trains on")
    behaviour: str = setting("parametric", "parametric | replay:TRAJECTORIES.npz (engine steps)")
    predictor_path: str | None = setting(
        None, "replay: a trained step predictor folder; default: the bundled one"
    )
    quality: str | None = setting(
        None, "an eval summary.json for the quality model; default: LLaDA-8B's GSM8K curve"
    )
    candidates: tuple[float, ...] | None = setting(
        None,
        "a dynamic policy's thresholds, e.g. 0.5,0.6,0.7,0.8,0.9,0.95; default: the policy's",
        metavar="C,C,...",
    )
    lost_work: str | None = setting(
        None,
        "a dynamic policy's rule for requests that can no longer meet their deadline "
        "(control/lost_work.py); default: the policy's",
        choices=("never", "late", "point", "likely"),
    )
    quality_budget: float | None = setting(
        None,
        "a dynamic policy's quality budget: the relative quality loss (against the top "
        "threshold's) recent requests may lose before the lowest thresholds close "
        "(control/quality_budget.py); 1: no bound; default: the policy's (dilaserve: 0.01)",
    )
    seed: int = setting(0, "random seed of the trace, behaviour and predictor")

    def __post_init__(self):
        tp = self.initial_tp or 1
        if self.gpus <= 0 or tp <= 0 or self.gpus % tp:
            raise ValueError(f"{self.gpus=} must be a positive multiple of {self.initial_tp=}")
        self.layout()  # a malformed layout or straggler count fails here, not mid-run
        self.parsed_stragglers()
        StepCosts(self.kv_cache, self.block_len)  # a bad cache mode or block fails here
        if self.rate_scale <= 0:
            raise ValueError(f"{self.rate_scale=} must be positive")
        if self.slo is not None and self.slo <= 0:
            raise ValueError(f"{self.slo=} must be positive")
        if self.quality_budget is not None and not 0 <= self.quality_budget <= 1:
            raise ValueError(f"{self.quality_budget=} must be a relative loss in [0, 1]")
        if self.slo_multiple <= 0:
            raise ValueError(f"{self.slo_multiple=} must be positive")

    @property
    def costs(self) -> StepCosts:
        """The cache mode and block length: what the simulator reads the cache through."""
        return StepCosts(self.kv_cache, self.block_len)

    def layout(self) -> list[int]:
        """The starting instances' TP degrees, in the order they are packed onto nodes."""
        if self.initial_layout is None:
            tp = self.initial_tp or 1  # (None: 1 until `sim.run.with_start` resolves it)
            return [tp] * (self.gpus // tp)
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

    def parsed_stragglers(self) -> tuple[int, float, float, float]:
        """(how many of the first instances are slow, their step-time factor, the simulated
        second they slow from, the seconds after which the slowdown moves on to the next
        ones, 0: never); (0, 1.0, 0.0, 0.0): none."""
        if self.stragglers is None:
            return 0, 1.0, 0.0, 0.0
        slow, at, when = self.stragglers.partition("@")
        count, sep, factor = slow.partition(":")
        start, every, period = when.partition("/")
        try:
            n, f = int(count), float(factor)
            s, p = (float(start) if at else 0.0), (float(period) if every else 0.0)
        except ValueError:
            n, f, s, p = -1, 0.0, 0.0, 0.0
        if not sep or n < 0 or not (f > 0 and s >= 0 and p >= 0) or (every and not p):  # (nan)
            n = -1
        if n < 0 or n > len(self.layout()):
            raise ValueError(
                f"{self.stragglers=} must be COUNT:FACTOR[@SECONDS[/PERIOD]], at most the "
                f"starting instances ({len(self.layout())}), a positive factor, a start >= 0 "
                "and a positive period, e.g. '2:1.5', '1:3@120' or '1:3@60/10'"
            )
        return n, f, s, p
