"""Scheduling policies: DiLaServe, its ablations and the baselines, picked by name.

A policy is a small frozen value; the one `Scheduler` reads it. DESIGN section 3 lists them:
- `dilaserve`: dynamic thresholds (Alg. 1/5, at a calibrated quantile), load control (Alg.
  2/4, its work priced at the same quantile against the budget the requests it counts have
  left), step-level placement (Alg. 3) with migration only where the KV cache allows it (before
  a recompute step), ILP reconfiguration of the cluster every planning period, and requests
  that can no longer make their deadline served after the others (`lost_work.py`);
- ablations: `no-load-control`, `no-dynamic-threshold` (fixed default threshold),
  `no-migration`, `oracle-predictor`, `no-reconfig` (the cluster keeps its instances),
  `migrate-any-step` (migration between any two steps, losing the cache: papers.md Table 6),
  `no-lost-work` (lost requests served like the others, as the paper does), `no-placement`
  (Alg. 3 replaced by least-tokens placement, as `llumnix` places; a move still taken only
  when it pays, so migration and everything else stay `dilaserve`'s), `no-quality-budget`
  (no quality budget: thresholds as low as the ladder goes, lost requests at the lowest too;
  the default before 2026-12-05's budget);
- baselines with a fixed threshold and a fixed cluster: `fcfs` (a plain first-come queue:
  requests wait, in arrival order, until an instance is between steps, and the first free
  instance takes them; a request stays where it started), `infaas` (dispatch on arrival to the
  least-loaded instance by tokens, no migration) and `llumnix` (step-level load balancing,
  migration only at recompute steps);
- `dilaserve-paper`: the paper's algorithms as written (Alg. 1's point estimate, Alg. 2/4's
  one SLO window at the point estimate, lost requests served like the others);
- readings of load control beside the default's: `dilaserve-slo-load` (the default with Alg.
  2/4 as written: one SLO window, the point estimate, every request capped; the default before
  2026-12-05's load change), `dilaserve-budget` (the default's window at the point estimate)
  and `dilaserve-all-caps` (the default with Alg. 2/4's caps on every request, not only those
  in their last block; the default before 2026-12-06); see docs/control/thresholds.md;
- extensions, tuned deviations from the paper's algorithms, named so that they never pass
  for it: `dilaserve-headroom` (`dilaserve-paper` with Alg. 1 fitting the predicted time into
  half the remaining budget: `slo_headroom` 0.5);
- `dws-sjf`: `fcfs` whose waiting requests are served in order of their DWS expected cost
  (papers.md 2.8): shortest first, non-preemptive (a request that has started goes ahead of
  every waiting one), each waiting request's cost aged by 10% per 30 s waited.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from dilaserve.config import DEFAULT_THRESHOLD
from dilaserve.control.lost_work import Lost
from dilaserve.control.on_time import ON_TIME_TARGET
from dilaserve.control.quality_budget import QUALITY_BUDGET

DEFAULT_CANDIDATES = (0.7, 0.8, 0.9)  # where quality was measured (papers.md 1.1)
DEFAULT_FIXED = DEFAULT_THRESHOLD


class Migration(str, enum.Enum):
    ANY = "any"  # between any two steps (a cache step then recomputes on the new instance)
    RECOMPUTE = "recompute"  # only before a recompute (or full) step
    NONE = "none"  # a request stays on its first instance


class Placement(str, enum.Enum):
    FASTEST_STEP = "fastest-step"  # Alg. 3: lowest predicted step latency with this request
    LEAST_TOKENS = "least-tokens"  # fewest batch tokens (load balancing)
    ON_ARRIVAL = "on-arrival"  # bound at arrival to the instance with fewest tokens (INFaaS)
    FIRST_FREE = "first-free"  # a queue: only an instance between steps takes waiting requests


class LoadWindow(str, enum.Enum):
    SLO = "slo"  # Alg. 2/4 as written: capacity over one whole SLO window
    BUDGET_LEFT = "budget-left"  # over the mean budget left to the requests it counts


class LoadEstimate(str, enum.Enum):
    POINT = "point"  # Alg. 2/4 as written: the work in flight at its predicted steps
    QUANTILE = "quantile"  # that work times Alg. 1's calibrated factor (its on-time quantile)


class Order(str, enum.Enum):
    ARRIVAL = "arrival"  # priority, then arrival
    COST = "cost"  # started first, then the aged expected cost (DWS-SJF)


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    candidates: tuple[float, ...] = DEFAULT_CANDIDATES
    fixed_threshold: float | None = None  # None: SLO-aware selection within the allowed range
    load_control: bool = True
    load_window: LoadWindow = LoadWindow.SLO  # the time load control's capacity covers
    load_estimate: LoadEstimate = LoadEstimate.POINT  # how load control prices the work
    migration: Migration = Migration.RECOMPUTE
    placement: Placement = Placement.FASTEST_STEP
    predictor: str = "full"  # which step predictor: full | progress | one-shot | oracle
    reconfigure: bool = True  # run the ILP planner every period (when one is configured)
    order: Order = Order.ARRIVAL  # the service order of waiting requests
    aging: float = 0.10  # DWS-SJF: a waiting request's cost shrinks this much ...
    aging_period: float = 30.0  # ... per this many seconds waited
    # Alg. 1's share of the remaining budget; None: the SchedulerConfig's (1.0, the paper's)
    slo_headroom: float | None = None
    # Alg. 1 prices the remaining time at this quantile of how long requests took against
    # their estimate (`on_time.py`, calibrated online); None: the point estimate, as written
    on_time_target: float | None = None
    # which requests count as lost and are served after the others (`lost_work.py`)
    lost_work: Lost = Lost.NEVER
    # Alg. 2/4's caps reach a request only in its last block; one with blocks to go is left to
    # Alg. 1, which chooses again at its next refresh (`load_control.py`); False: as written
    last_block_caps: bool = False
    # a request with a home moves to placement's pick only when its next step ends sooner
    # there, net of what it costs the batch it joins (`Placer._move_pays`); the baselines move
    # whenever placement picks another instance
    priced_moves: bool = True
    # the relative quality loss (against the top threshold's) the requests may lose on average
    # before the lowest thresholds close (`quality_budget.py`); None: no bound, as written
    quality_budget: float | None = None
    # the TP degree of the instances a cluster starts as when its layout is not given (the
    # paper's admin input, "initial cluster configuration"): DiLaServe's 2, chosen on the
    # training traces (docs/generalization.md, "Where the cluster starts"); the baselines' 1,
    # their better start on the test traces
    start_tp: int = 1
    # Alg. 3 prices each instance's step at that instance's measured speed (`speed.py`), so a
    # straggler the profile does not know looks as slow as it runs; where every instance runs
    # at the same ratio the argmin is the paper's. False: the profile alone, as written.
    # DiLaServe's: on, from the straggler shapes (docs/control/scheduling.md, "Each instance
    # at its own speed"); `SchedulerConfig.instance_speed` overrides it
    instance_speed: bool = False

    def __post_init__(self):
        if self.fixed_threshold is not None and not 0 < self.fixed_threshold <= 1:
            raise ValueError(f"{self.fixed_threshold=} must be in (0, 1]")
        if not self.candidates or not all(0 < c <= 1 for c in self.candidates):
            raise ValueError(f"{self.candidates=} must be thresholds in (0, 1]")
        if self.slo_headroom is not None and not 0 < self.slo_headroom <= 1:
            raise ValueError(f"{self.slo_headroom=} must be in (0, 1]")
        if self.on_time_target is not None and not 0 < self.on_time_target < 1:
            raise ValueError(f"{self.on_time_target=} must be in (0, 1)")
        if self.quality_budget is not None and not 0 <= self.quality_budget < 1:
            raise ValueError(f"{self.quality_budget=} must be a relative loss in [0, 1)")
        if self.start_tp < 1:
            raise ValueError(f"{self.start_tp=} must be a positive TP degree")

    def prices_instances(self, setting: bool | None) -> bool:
        """Whether each instance is priced at its own measured speed: `setting` (a config's or
        a command line's), else this policy's `instance_speed`."""
        return self.instance_speed if setting is None else setting

    @property
    def is_dynamic(self) -> bool:
        return self.fixed_threshold is None


_DILASERVE = Policy(
    "dilaserve",
    load_window=LoadWindow.BUDGET_LEFT,
    load_estimate=LoadEstimate.QUANTILE,
    on_time_target=ON_TIME_TARGET,
    lost_work=Lost.LIKELY,
    quality_budget=QUALITY_BUDGET,
    last_block_caps=True,
    start_tp=2,
    instance_speed=True,
)
_PAPER_LOAD = {  # Alg. 2/4 as written
    "load_window": LoadWindow.SLO,
    "load_estimate": LoadEstimate.POINT,
    "last_block_caps": False,
}
# the baselines: a fixed threshold, no load control, a request stays where it started
_FCFS = Policy(
    "fcfs",
    fixed_threshold=DEFAULT_FIXED,
    load_control=False,
    migration=Migration.NONE,
    placement=Placement.FIRST_FREE,
    reconfigure=False,
    priced_moves=False,
)
POLICIES = {
    "dilaserve": _DILASERVE,
    "no-load-control": replace(_DILASERVE, name="no-load-control", load_control=False),
    "no-dynamic-threshold": replace(
        _DILASERVE, name="no-dynamic-threshold", fixed_threshold=DEFAULT_FIXED, load_control=False
    ),
    "no-migration": replace(_DILASERVE, name="no-migration", migration=Migration.NONE),
    "oracle-predictor": replace(_DILASERVE, name="oracle-predictor", predictor="oracle"),
    "no-reconfig": replace(_DILASERVE, name="no-reconfig", reconfigure=False),
    "migrate-any-step": replace(_DILASERVE, name="migrate-any-step", migration=Migration.ANY),
    "no-lost-work": replace(_DILASERVE, name="no-lost-work", lost_work=Lost.NEVER),
    "dilaserve-slo-load": replace(_DILASERVE, name="dilaserve-slo-load", **_PAPER_LOAD),
    "no-placement": replace(_DILASERVE, name="no-placement", placement=Placement.LEAST_TOKENS),
    "no-quality-budget": replace(_DILASERVE, name="no-quality-budget", quality_budget=None),
    "dilaserve-paper": replace(
        _DILASERVE,
        name="dilaserve-paper",
        instance_speed=False,
        on_time_target=None,
        quality_budget=None,
        lost_work=Lost.NEVER,
        **_PAPER_LOAD,
    ),
    "dilaserve-headroom": replace(
        _DILASERVE,
        name="dilaserve-headroom",
        instance_speed=False,
        on_time_target=None,
        quality_budget=None,
        slo_headroom=0.5,
        lost_work=Lost.NEVER,
        **_PAPER_LOAD,
    ),
    "dilaserve-budget": replace(
        _DILASERVE, name="dilaserve-budget", load_estimate=LoadEstimate.POINT
    ),
    "dilaserve-all-caps": replace(_DILASERVE, name="dilaserve-all-caps", last_block_caps=False),
    "fcfs": _FCFS,
    "infaas": replace(_FCFS, name="infaas", placement=Placement.ON_ARRIVAL),
    "llumnix": replace(
        _FCFS, name="llumnix", migration=Migration.RECOMPUTE, placement=Placement.LEAST_TOKENS
    ),
    "dws-sjf": replace(_FCFS, name="dws-sjf", order=Order.COST),
}


def get_policy(name: str, **overrides) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"policy={name!r} is not one of {sorted(POLICIES)}")
    return replace(POLICIES[name], **overrides)
