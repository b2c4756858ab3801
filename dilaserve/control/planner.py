"""Cluster reconfiguration, Stage 1 of the two-stage ILP planner (papers.md 1.8; DiLaServe §3.3).

**Stage 1, capacity planning** (`plan_capacity`). For workload classes k (prompt P_k, output O_k,
rate RPS_k, SLO_k), thresholds c (T_c tokens committed per step), TP degrees d and candidate
batch sizes b (L_db: step latency from the profile), choose how many TP-d instances run on each
node (x_nd), one batch size per TP degree (z_db), and how each class spreads its steps over
thresholds (s_kc) and TP degrees (s_kd), maximising lexicographically

1. the average threshold per output token, sum_k RPS_k * sum_c c T_c s_kc / O_k, then
2. the SLO slack, sum_k RPS_k (SLO_k - t_k),

(then, as our own last tie-break, the GPUs in use: an idle GPU serves nobody; no solve is
needed for it, see `_fill_idle_gpus`), subject to
token completeness (sum_c T_c s_kc = O_k), step consistency (sum_c s_kc = sum_d s_kd), the SLO
(t_k = sum_d sum_b z_db L_db s_kd <= SLO_k), one batch size per TP degree (sum_b z_db = 1),
GPUs per node (sum_d d x_nd <= G_n) and queueing stability (the token-steps per second the
classes send to TP-d instances fit their throughput: sum_k RPS_k s_kd (P_k + O_k) <=
sum_b z_db (b / L_db) sum_n x_nd). Each objective is solved to within `gap` (1%) of its
optimum, then held within `tolerance` of the value found while the next one is solved.

*Linearisation.* As printed, the SLO and stability constraints multiply variables: z_db * s_kd
(binary times continuous) and z_db * sum_n x_nd (binary times integer). Both go away exactly
with one family of variables w_kdb >= 0, "the steps of class k on TP d at batch size b":

    sum_b w_kdb = s_kd,        w_kdb <= M_k z_db,        M_k = O_k / min_c T_c,

where M_k bounds s_kd (a class never takes more steps than at its slowest threshold; with a
cache, recompute steps are exactly O_k / B and cache steps at most M_k - O_k / B, the tighter
big-Ms each family's w gets: 8% less solve time over the paper-sized simulation's plans).
Because exactly one z_db is 1, w_kdb equals s_kd at the chosen b and 0 elsewhere, so
z_db L_db s_kd = sum_b L_db w_kdb (the SLO is linear). Stability is divided through by the
chosen b / L_db, which is positive, giving the equivalent
sum_k RPS_k (P_k + O_k) sum_b (L_db / b) w_kdb <= sum_n x_nd:
"GPU-seconds per second demanded <= instances", linear again, with no product of z and x.

*With a KV cache* (`costs.cache_block` B set; papers.md 1.9): a class's steps are
recompute steps r_kd (one per block: sum_d r_kd = O_k / B) over the whole sequence and cache steps
q_kd over one block, each with its own batch-size choice (z_db from the recompute curve, z'_db
from the cache curve), so that sum_c s_kc = sum_d (r_kd + q_kd), t_k = sum (z L r + z' L' q),
and stability is sum_k RPS_k [(P_k + O_k) r_kd alpha_d + B q_kd beta_d] <= sum_n x_nd with
alpha_d = sum_b z_db L_db / b and beta_d = sum_b z'_db L'_db / b; both linearise as above.
With an exact (block-diffusion) cache the boundary step is a commit of 2B tokens on the commit
curve instead of a recompute of P + O (`costs.exact`; a request's one prefill is not planned).

If no configuration can meet the SLOs, the plan falls back to TP-1 instances on every GPU.
Stage 2 (where the instances go, and the order of the moves) is in `control/layout.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dilaserve.control.highs import add_switched, new_model, qsum, solution_reader, solved
from dilaserve.control.monitor import WorkloadClass
from dilaserve.control.profile import LatencyProfile
from dilaserve.control.step_costs import StepCosts

# stability terms below HiGHS's matrix tolerance (instance-seconds per second per step) are
# dropped, as HiGHS would drop them; a request class that small adds no measurable load
NEGLIGIBLE = 1e-9


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    gpus_per_node: tuple[int, ...]  # G_n for each node
    tokens_per_step: Mapping[float, float]  # T_c: mean tokens committed per step at threshold c
    tp_degrees: tuple[int, ...] = (1, 2, 4, 8)
    # the cache's step kinds and block length B (`costs.cache_block`: None without a cache);
    # an exact cache (block diffusion): a block's first step commits (2B tokens)
    costs: StepCosts = StepCosts()
    batch_sizes: tuple[int, ...] | None = None  # batch tokens; None: the profile's points
    cache_batch_sizes: tuple[int, ...] | None = None
    tolerance: float = 1e-3  # relative slack when an objective is held at its optimum
    # the relative MIP gap a solve stops at: the trigger reads objectives at `improvement`
    # (10%), so 1% is ten times finer than any decision (docs/simulator/speed.md)
    gap: float = 0.01
    time_limit: float = 30.0  # seconds per solve
    period: float = 300.0  # seconds between planning rounds
    improvement: float = 0.10  # apply a plan only if an objective improves this much
    guard_moves: bool = True  # skip a move whose steps leave too few GPUs serving the load ...
    startup_delay: float = 30.0  # ... for longer than this (an instance's start-up) > SLO slack
    # (a live cluster measures its starts; this prices moves until one is: `Reconfigurer`)
    price_moves: bool = True  # a guarded move must pass the trigger with its start-ups counted
    serial_launches: bool = False  # each launch waits for the last (rollout.py; the paper's)
    rate_trend: bool = True  # plan for the load's growth over the window (monitor.py)
    batch_limits: bool = False  # the plan's batch sizes bound instances (Alg. 3's maxBatchSize)

    def __post_init__(self):
        if not self.gpus_per_node or min(self.gpus_per_node) <= 0:
            raise ValueError(f"{self.gpus_per_node=} must list a positive GPU count per node")
        if not self.tokens_per_step or min(self.tokens_per_step.values()) <= 0:
            raise ValueError(f"{self.tokens_per_step=} must give positive tokens per step")
        if self.period <= 0:
            raise ValueError(f"{self.period=} must be positive")
        if not 0 < self.gap < 1:
            raise ValueError(f"{self.gap=} must be a relative MIP gap in (0, 1)")

    @property
    def thresholds(self) -> tuple[float, ...]:
        return tuple(sorted(self.tokens_per_step))


@dataclass(frozen=True)
class CapacityPlan:
    """Stage 1's answer: instances per (node, TP degree) and the operating point it assumes."""

    instances: dict[tuple[int, int], int]  # (node, tp) -> instances
    batch_tokens: dict[int, int]  # tp -> batch size of full / recompute steps
    cache_batch_tokens: dict[int, int]  # tp -> batch size of cache steps (with a KV cache)
    mean_threshold: float  # objective 1 over the total rate: threshold per output token
    slack: float  # objective 2: sum_k RPS_k (SLO_k - t_k)
    latency: tuple[float, ...]  # t_k per class
    threshold_mix: tuple[dict[float, float], ...]  # per class: share of its tokens at each c
    utilisation: dict[int, float]  # tp -> demanded / available instance-seconds per second
    feasible: bool = True  # False: no configuration meets the SLOs (fallback plan)

    def counts(self) -> dict[int, int]:
        """Instances per TP degree over all nodes."""
        return counts_by_tp(self.instances)

    def batch_limits(self) -> dict[int, tuple[int, int | None]]:
        """Alg. 3's maxBatchSize per TP degree: tp -> (full-sequence, cache-step) tokens, the
        batch sizes this plan chose (none for a degree it runs no instance of)."""
        return {
            tp: (self.batch_tokens[tp], self.cache_batch_tokens.get(tp))
            for tp in self.counts()
            if tp in self.batch_tokens
        }

    @property
    def gpus(self) -> int:
        return sum(tp * n for (_, tp), n in self.instances.items())


def counts_by_tp(instances: Mapping[tuple[int, int], int]) -> dict[int, int]:
    """(node, tp) -> instances, summed over nodes: tp -> instances (degrees with none left out)."""
    out: dict[int, int] = {}
    for (_, tp), n in instances.items():
        if n:
            out[tp] = out.get(tp, 0) + n
    return dict(sorted(out.items()))


# -- Stage 1 ---------------------------------------------------------------------------------


class _Stage1:
    """The Stage-1 model in HiGHS, built piece by piece, with handles on its variables."""

    def __init__(self, profile: LatencyProfile, cfg: PlannerConfig, degrees, fixed):
        self.h = new_model(cfg.time_limit, cfg.gap)
        self.cfg, self.degrees = cfg, tuple(degrees)
        self.nodes = range(len(cfg.gpus_per_node))
        self.families = {d: _families(profile, cfg, d) for d in self.degrees}
        self.x: dict[tuple[int, int], Any] = {}  # (node, tp) -> instances (HiGHS variables)
        self.z: dict[tuple[str, int, int], Any] = {}  # (step family, tp, batch) -> binary
        self.latency: dict[tuple[str, int, int], float] = {}  # (family, tp, batch) -> seconds
        self.thr_steps: dict[tuple[int, float], Any] = {}  # s_kc
        self.demand: dict[int, list] = {d: [] for d in self.degrees}  # instance-s/s on TP d
        self._instances(fixed)
        self._batch_choices(profile)

    def _instances(self, fixed) -> None:
        """x_nd (pinned to `fixed` when given), within each node's GPUs."""
        h, gpus = self.h, self.cfg.gpus_per_node
        for n in self.nodes:
            for d in self.degrees:
                most = gpus[n] // d if fixed is None else fixed.get((n, d), 0)
                self.x[n, d] = h.addIntegral(lb=0 if fixed is None else most, ub=most)
            h.addConstr(qsum(d * self.x[n, d] for d in self.degrees) <= gpus[n])

    def _batch_choices(self, profile: LatencyProfile) -> None:
        """z_db: one batch size per TP degree and step family."""
        for d in self.degrees:
            for fam, kind, sizes in self.families[d]:
                for b in sizes:
                    self.z[fam, d, b] = self.h.addBinary()
                    self.latency[fam, d, b] = profile.step_latency(d, b, kind)
                self.h.addConstr(qsum(self.z[fam, d, b] for b in sizes) == 1)

    def add_class(self, k: int, cls: WorkloadClass):
        """A class's steps over thresholds and (TP degree, batch size); returns t_k."""
        h, cfg, tps = self.h, self.cfg, self.cfg.tokens_per_step
        costs = cfg.costs
        block = costs.cache_block
        most_steps = cls.output_len / min(tps.values())  # the big-M: a true bound on steps
        for c in cfg.thresholds:
            self.thr_steps[k, c] = h.addVariable(lb=0, ub=most_steps)
        steps = [self.thr_steps[k, c] for c in cfg.thresholds]
        h.addConstr(qsum(tps[c] * self.thr_steps[k, c] for c in cfg.thresholds) == cls.output_len)
        by_family: dict[str, list] = {}
        latency_terms = []
        bound = {"full": most_steps, "cache": 0.0}  # the big-M of each family's w_kdb
        if block is not None:  # exactly one recompute step per block; the rest cache
            bound["full"] = cls.output_len / block
            bound["cache"] = max(most_steps - bound["full"], 0.0)
        boundary = costs.boundary_batch_tokens(cls.num_tokens)
        for d in self.degrees:
            for fam, _, sizes in self.families[d]:
                tokens = boundary if fam == "full" else block or 0  # cached: set
                switches = [self.z[fam, d, b] for b in sizes]
                for b, w in zip(sizes, add_switched(h, bound[fam], switches)):  # w_kdb
                    by_family.setdefault(fam, []).append(w)
                    lat = self.latency[fam, d, b]
                    latency_terms.append(lat * w)
                    coefficient = cls.rate * tokens * lat / b
                    if coefficient > NEGLIGIBLE:
                        self.demand[d].append(coefficient * w)
        h.addConstr(qsum(steps) == qsum(w for ws in by_family.values() for w in ws))
        if block is not None:  # one recompute step per block
            h.addConstr(qsum(by_family["full"]) == cls.output_len / block)
        t_k = qsum(latency_terms)
        h.addConstr(t_k <= cls.slo)
        return t_k

    def add_stability(self) -> None:
        for d in self.degrees:
            if self.demand[d]:
                self.h.addConstr(qsum(self.demand[d]) <= qsum(self.x[n, d] for n in self.nodes))

    def objectives(self, classes: Sequence[WorkloadClass], t_exprs) -> tuple:
        """Mean threshold per output token, then SLO slack (both over the total rate: the same
        optimum, better-scaled coefficients)."""
        tps = self.cfg.tokens_per_step
        total_rate = sum(c.rate for c in classes) or 1.0
        share = [cls.rate / total_rate for cls in classes]
        mean_threshold = qsum(
            (share[k] * c * tps[c] / cls.output_len) * self.thr_steps[k, c]
            for k, cls in enumerate(classes)
            for c in self.cfg.thresholds
        )
        slack = qsum(share[k] * (cls.slo - t) for k, (cls, t) in enumerate(zip(classes, t_exprs)))
        return mean_threshold, slack


def _families(profile: LatencyProfile, cfg: PlannerConfig, tp: int):
    """Step families with their batch-size candidates: (name, kind, batch sizes)."""
    costs = cfg.costs
    full_kind = costs.boundary_kind
    out = [("full", full_kind, cfg.batch_sizes or profile.curve(tp, full_kind).tokens)]
    if costs.cached:
        sizes = cfg.cache_batch_sizes or profile.curve(tp, costs.inner_kind).tokens
        out.append(("cache", costs.inner_kind, sizes))
    return out


def _build_stage1(
    classes: Sequence[WorkloadClass],
    profile: LatencyProfile,
    cfg: PlannerConfig,
    degrees: Sequence[int],
    fixed: Mapping[tuple[int, int], int] | None,
):
    m = _Stage1(profile, cfg, degrees, fixed)
    t_exprs = [m.add_class(k, cls) for k, cls in enumerate(classes)]
    m.add_stability()
    return m, m.objectives(classes, t_exprs), t_exprs, m.demand


def _maximise_in_order(h, objectives, tolerance: float) -> list[float] | None:
    """Lexicographic: maximise each objective, then hold it near its optimum for the next."""
    values = []
    for i, objective in enumerate(objectives):
        h.maximize(objective)
        if not solved(h):
            return None
        value = h.val(objective)
        values.append(value)
        if i < len(objectives) - 1:
            h.addConstr(objective >= value - tolerance * max(abs(value), 1.0))
    return values


def usable_degrees(profile: LatencyProfile, cfg: PlannerConfig) -> tuple[int, ...]:
    return tuple(
        d for d in cfg.tp_degrees if d in profile.tp_degrees and d <= max(cfg.gpus_per_node)
    )


def is_feasible(
    classes: Sequence[WorkloadClass], profile: LatencyProfile, cfg: PlannerConfig
) -> bool:
    """Whether any configuration meets every class's SLO (Stage 1's constraints, no objective)."""
    m, *_ = _build_stage1(classes, profile, cfg, usable_degrees(profile, cfg), None)
    m.h.run()
    return solved(m.h)


def plan_capacity(
    classes: Sequence[WorkloadClass],
    profile: LatencyProfile,
    cfg: PlannerConfig,
    fixed: Mapping[tuple[int, int], int] | None = None,
) -> CapacityPlan:
    """Stage 1. `fixed` pins the instance counts (node, tp) -> n to evaluate a configuration."""
    if not classes:
        raise ValueError("capacity planning needs at least one workload class")
    degrees = usable_degrees(profile, cfg)
    if not degrees:
        raise ValueError(
            f"no TP degree of {cfg.tp_degrees} is both in the profile "
            f"({profile.tp_degrees}) and fits a node ({cfg.gpus_per_node} GPUs)"
        )
    m, objectives, t_exprs, demand = _build_stage1(classes, profile, cfg, degrees, fixed)
    values = _maximise_in_order(m.h, objectives, cfg.tolerance)
    if values is None:
        return _infeasible(classes, cfg, fixed)
    val = solution_reader(m.h)
    instances = {key: round(val(v)) for key, v in m.x.items()}
    if fixed is None:
        _fill_idle_gpus(instances, cfg.gpus_per_node, degrees)
    chosen = {key for key, v in m.z.items() if val(v) > 0.5}
    mix = []
    for k, cls in enumerate(classes):
        tokens = {c: cfg.tokens_per_step[c] * val(m.thr_steps[k, c]) for c in cfg.thresholds}
        mix.append({c: t / cls.output_len for c, t in tokens.items() if t > 1e-9})
    total_rate = sum(cls.rate for cls in classes)
    utilisation = {}
    for d in degrees:
        available = sum(n for (_, tp), n in instances.items() if tp == d)
        used = sum(val(term) for term in demand[d])
        if available:
            utilisation[d] = used / available
    return CapacityPlan(
        instances=instances,
        batch_tokens={d: b for fam, d, b in sorted(chosen) if fam == "full"},
        cache_batch_tokens={d: b for fam, d, b in sorted(chosen) if fam == "cache"},
        mean_threshold=values[0],
        slack=values[1] * total_rate,
        latency=tuple(val(t) for t in t_exprs),
        threshold_mix=tuple(mix),
        utilisation=utilisation,
    )


def _fill_idle_gpus(
    instances: dict[tuple[int, int], int], gpus_per_node: Sequence[int], degrees: Sequence[int]
) -> None:
    """The last objective, GPUs in use (an idle GPU serves nobody), without a third solve: more
    instances only loosen the stability constraints and leave both objectives as they are. Each
    node's idle GPUs get instances of the smallest TP degree: the most throughput per GPU for
    load above the forecast, and the degree a cluster most likely runs already (fewer moves)."""
    for n, gpus in enumerate(gpus_per_node):
        idle = gpus - sum(d * instances.get((n, d), 0) for d in degrees)
        for d in sorted(degrees):
            instances[n, d] = instances.get((n, d), 0) + idle // d
            idle %= d


def _infeasible(classes, cfg: PlannerConfig, fixed) -> CapacityPlan:
    """No configuration meets the SLOs: TP-1 instances on every GPU (or the pinned ones)."""
    tp1 = {(n, 1): g for n, g in enumerate(cfg.gpus_per_node)}
    instances = dict(fixed) if fixed is not None else tp1
    return CapacityPlan(
        instances=instances,
        batch_tokens={},
        cache_batch_tokens={},
        mean_threshold=0.0,
        slack=0.0,
        latency=tuple(float("inf") for _ in classes),
        threshold_mix=tuple({} for _ in classes),
        utilisation={},
        feasible=False,
    )
