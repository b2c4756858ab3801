"""When to reconfigure the cluster: the planner's trigger (papers.md 1.8).

Every `period` (5 minutes by default) the workload monitor's classes go through Stage 1 twice:
free (the proposal) and with instance counts pinned to what runs now (the current configuration
under the same workload; skipped when the proposal keeps the running counts, since the
objectives depend on instances per TP degree only). The proposal is carried out only if it
raises the mean threshold or the SLO slack by at least `improvement` (10%), or if the current
configuration can no longer meet the SLOs at all (then, when no configuration can, the TP-1
fallback is taken only if it carries more tokens over the next period, its start-ups paid:
`_fallback_pays`). Stage 2 then places the proposal keeping as
many running instances as it can, and `launch_order` sequences the moves. Called from
`Scheduler.on_tick(now)`. With `PlannerConfig.batch_limits` (off by default;
docs/control/reconfiguration.md) a plan also carries its batch sizes as Alg. 3's maxBatchSize, and
a round whose proposal keeps the running instances sets them alone (the same instances, new
limits: nothing to weigh).

Our addition, on by default (`PlannerConfig.guard_moves`; the paper says nothing of the cost of
a move): a move from a configuration that meets the SLOs is skipped when, at some step of it,
the instances still serving have fewer GPUs than the observed load needs (each class's
token-steps at the lowest threshold, at TP-1's best throughput; a lenient bound) for longer
than the SLOs can absorb: an instance's start-up (`startup_delay`: `PlannerConfig`'s until a
start is measured, then the longest of the latest `STARTUPS` measured) exceeds the
smallest slack the current configuration leaves a class (SLO_k - t_k). Stopping instances to
load others takes their GPUs away for a whole start-up: 4 TP-1 instances replaced by one TP-4
serve nobody for 30 s, which at a 4.6 s SLO misses every request that comes meanwhile, while a
2 s gap within a 27 s SLO costs little (docs/simulator/mechanisms.md). With it
(`PlannerConfig.price_moves`, `_move_pays`) a move must also pass the trigger once its start-ups are
paid: each configuration serving while it is carried out (`move_timeline`, a start-up per wave of
launches) scores for as long as it serves within the next period, twice over for a move to less
throughput, which the next climb of the load undoes at the same cost
(docs/control/reconfiguration.md, "Start-ups priced").

Two more of ours, for what the paper leaves open, each measured on its Table 4 trace
(docs/simulator/paper-figures.md, Fig. 10): the monitor's buffer carries the load's rise
(`PlannerConfig.rate_trend`, `monitor.py`), so the planner leaves a few wide instances before
the day's peak rather than after it; and a move's launches whose GPUs are free load together
(`control/rollout.py`; `PlannerConfig.serial_launches` waits for each in turn).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from dilaserve.control.decisions import Reconfiguration
from dilaserve.control.layout import InstanceSlot, launch_order, plan_layout
from dilaserve.control.monitor import WorkloadClass, WorkloadMonitor
from dilaserve.control.planner import CapacityPlan, PlannerConfig, counts_by_tp, plan_capacity
from dilaserve.control.profile import LatencyProfile
from dilaserve.request import Request

HISTORY_ROUNDS = 1000  # rounds a server keeps for its logs (3.5 days at the paper's 5 minutes)
# what came of a round: nothing worth a move, a move the guard skipped, a move begun
OUTCOMES = ("kept", "guarded", "applied")
STARTUPS = 8  # the latest instance starts measured, whose longest prices a move: a server's
# boot and its last few moves or replacements


def worth_applying(proposal: CapacityPlan, current: CapacityPlan, gain: float) -> bool:
    if proposal.counts() == current.counts():
        return False
    if not current.feasible:
        return True  # a feasible plan, or the TP-1 fallback, beats a configuration that fails
    if not proposal.feasible:
        return False
    return improves(objectives(proposal), objectives(current), gain)


def objectives(plan: CapacityPlan) -> tuple[float, float]:
    """(mean threshold, SLO slack) of a plan; a configuration that cannot meet the SLOs scores
    0 on both, below every one that can."""
    return (plan.mean_threshold, plan.slack) if plan.feasible else (0.0, 0.0)


def improves(new: tuple[float, float], old: tuple[float, float], gain: float) -> bool:
    """The trigger: the mean threshold or the SLO slack rises by at least `gain` (a share)."""
    return any(n >= (1 + gain) * o for n, o in zip(new, old))


def gpus_needed(
    classes: Sequence[WorkloadClass], profile: LatencyProfile, config: PlannerConfig
) -> float:
    """GPUs the classes keep busy at the least: every class at the lowest threshold (the most
    tokens per step), every step at TP-1's best token throughput."""
    most_per_step = max(config.tokens_per_step.values())
    costs = config.costs
    block = costs.cache_block
    full_rate = profile.curve(1, costs.boundary_kind).best_throughput()[1]
    cache_rate = profile.curve(1, costs.inner_kind).best_throughput()[1] if block else 1.0
    total = 0.0
    for cls in classes:
        steps = cls.output_len / most_per_step
        full_steps = steps if block is None else max(cls.output_len / block, 1.0)
        cache_tokens = 0.0 if block is None else max(steps - full_steps, 0.0) * block
        full_tokens = full_steps * costs.boundary_batch_tokens(cls.num_tokens)
        total += cls.rate * (full_tokens / full_rate + cache_tokens / cache_rate)
    return total


def fewest_serving_gpus(plan: Reconfiguration, running: Sequence[InstanceSlot]) -> int:
    """The fewest GPUs serving at any point of the plan's moves (a new instance serves only
    once it is up, after the instances in its way have stopped)."""
    live = {slot.instance_id: slot.tp for slot in running}
    serving = fewest = sum(live.values())
    for step in plan.steps:
        serving -= sum(live.pop(i, 0) for i in step.stop)
        fewest = min(fewest, serving)
        serving += step.start.tp
    return fewest


def slot_counts(running: Sequence[InstanceSlot]) -> dict[tuple[int, int], int]:
    """Instances per (node, TP degree) of the running slots (`counts_by_tp` sums the nodes)."""
    out: dict[tuple[int, int], int] = {}
    for slot in running:
        out[slot.node, slot.tp] = out.get((slot.node, slot.tp), 0) + 1
    return out


def within(timeline, period: float):
    """The stretches of a `move_timeline` that fall within the first `period` seconds."""
    left = period
    for seconds, serving in timeline:
        seconds = min(seconds, left)
        if seconds <= 0:
            return
        yield seconds, serving
        left -= seconds


def move_timeline(
    plan: Reconfiguration, running: Sequence[InstanceSlot], startup: float
) -> list[tuple[float, dict[tuple[int, int], int]]]:
    """What serves while `plan` is carried out, as `Rollout` carries it out: (seconds, instances
    per (node, TP degree)) for each stretch until the last launch is up. A launch that stops nothing
    starts at once; one that stops instances (or any, in a serial plan) waits until every
    earlier launch is up, then stops them (draining is taken as instant) and loads for
    `startup` seconds. The instances retired last serve until the end."""
    live = {slot.instance_id: (slot.node, slot.tp) for slot in running}
    changes: list[tuple[float, tuple[int, int], int]] = []  # (time, (node, tp), +1 up / -1 off)
    now, loading = 0.0, []  # up times of the launches in flight
    for step in plan.steps:
        if loading and (plan.serial or step.stop):
            now, loading = max(loading), []
        changes += [(now, live.pop(i), -1) for i in step.stop if i in live]
        loading.append(now + startup)
        changes.append((now + startup, (step.start.node, step.start.tp), +1))
    serving = slot_counts(running)
    timeline, last = [], 0.0
    for time, key, sign in sorted(changes):
        if time > last:
            timeline.append((time - last, {k: n for k, n in sorted(serving.items()) if n}))
            last = time
        serving[key] = serving.get(key, 0) + sign
    return timeline


class Reconfigurer:
    def __init__(
        self,
        profile: LatencyProfile,
        config: PlannerConfig,
        monitor: WorkloadMonitor | None = None,
        history_rounds: int | None = HISTORY_ROUNDS,  # None: every round (a simulation's log)
    ):
        self.profile = profile
        self.config = config
        self.monitor = monitor or WorkloadMonitor(window=config.period, trend=config.rate_trend)
        self._next_round = config.period
        self._rounds = 0
        # one entry per planning round, for run logs; a server up for months keeps the latest
        self.history: deque[dict] = deque(maxlen=history_rounds)
        self.outcomes = dict.fromkeys(OUTCOMES, 0)  # rounds with classes, by what came of them
        self._startups: deque[float] = deque(maxlen=STARTUPS)  # measured, the latest

    @property
    def startup_delay(self) -> float:
        """Seconds a move's new instances are priced to take to come up: the longest of the
        latest starts measured (a move waits for its slowest; a spare worker makes one start
        fast and the next slow: docs/cluster.md), or `PlannerConfig.startup_delay` before any."""
        return max(self._startups) if self._startups else self.config.startup_delay

    def started(self, seconds: float) -> None:
        """An instance came up `seconds` after it was started (the live cluster measures it)."""
        if seconds >= 0:
            self._startups.append(seconds)

    def record(self, request: Request, now: float) -> None:
        assert request.deadline is not None  # the scheduler sets it at arrival
        # the SLO its client gave it: deadline - arrival would take its wait for the controller
        # off, a class per millisecond of wait (hundreds over a loaded server's window), and a
        # planner round that long held the controller over a second (docs/serving/reliability.md)
        slo = request.slo if request.slo is not None else request.deadline - request.arrival_time
        self.monitor.record(now, request.prompt_len, request.gen_len, slo)

    def on_tick(self, now: float, running: Sequence[InstanceSlot]) -> Reconfiguration | None:
        if now < self._next_round:
            return None
        self._next_round = now + self.config.period
        classes = self.monitor.classes(now)
        if not classes:
            return None
        self._rounds += 1
        proposal = plan_capacity(classes, self.profile, self.config)
        pinned = slot_counts(running)
        if proposal.counts() == counts_by_tp(pinned):
            # nothing to change, and nothing to compare: the objectives depend on instances per
            # TP degree, not their nodes, so the pinned optimum is the proposal's
            current = proposal
        else:
            current = plan_capacity(classes, self.profile, self.config, fixed=pinned)
        apply = worth_applying(proposal, current, self.config.improvement)
        self.history.append(
            {
                "time": now,
                "classes": len(classes),
                "current": current.counts(),
                "current_feasible": current.feasible,
                "proposal": proposal.counts(),
                "proposal_feasible": proposal.feasible,
                "mean_threshold": (current.mean_threshold, proposal.mean_threshold),
                "slack": (current.slack, proposal.slack),
                "applied": apply,
                "utilisation": {d: round(u, 3) for d, u in proposal.utilisation.items()},
            }
        )
        limits = proposal.batch_limits() if self.config.batch_limits else None
        if limits is not None:
            self.history[-1]["batch_limits"] = limits
        if not apply:
            self.outcomes["kept"] += 1
            if limits and current is proposal:  # new batch sizes on the same instances: free
                return Reconfiguration((), (), proposal.counts(), batch_limits=limits)
            return None
        layout = plan_layout(
            proposal.counts(), self.config.gpus_per_node, running, self.config.time_limit
        )
        plan = launch_order(
            layout, running, proposal, f"r{self._rounds}", self.config.serial_launches
        )
        if self.config.guard_moves and not self._guard_passes(
            plan, running, classes, proposal, current
        ):
            self.history[-1]["applied"] = False
            self.outcomes["guarded"] += 1
            return None
        self.outcomes["applied"] += 1
        return replace(plan, batch_limits=limits)

    def _guard_passes(self, plan, running, classes, proposal, current) -> bool:
        """The guard, from a configuration that meets the SLOs (`_move_pays_off`) or from one
        that fails them: to a plan that meets them, the move must not leave fewer GPUs serving
        than the load needs (a failing configuration has no slack to absorb the gap); to the
        TP-1 fallback, it must carry more tokens (`_fallback_pays`)."""
        if current.feasible:
            return self._move_pays_off(plan, running, classes, proposal, current)
        if proposal.feasible:
            return not self._move_hurts(plan, running, classes, current)
        return self._fallback_pays(plan, running, proposal)

    def _fallback_pays(self, plan: Reconfiguration, running, proposal) -> bool:
        """Whether the TP-1 fallback carries more tokens than the running instances over the
        next period, its start-ups paid. Both fail the SLOs, so Stage 1 scores them alike (0 on
        both objectives); the fallback is there for throughput, so throughput decides. Wider
        instances carry almost as much per GPU (TP-2: 1.93 times TP-1 on `llada-8b-h100`), so
        stopping them mid-burst costs more than the move wins back: on the Azure training half
        started as 4 TP-2 + 8 TP-1 the unguarded fallback cost 3-4 points
        (docs/control/reconfiguration.md, "The fallback, priced")."""
        period = left = self.config.period
        carried = 0.0
        timeline = move_timeline(plan, running, self.startup_delay)
        for seconds, serving in within(timeline, period):
            carried += seconds * self._throughput(counts_by_tp(serving))
            left -= seconds
        carried += left * self._throughput(proposal.counts())
        staying = period * self._throughput(counts_by_tp(slot_counts(running)))
        self.history[-1].update(carried=round(carried), staying=round(staying))
        return carried > staying

    def _move_pays_off(self, plan, running, classes, proposal, current) -> bool:
        """The guard: the move neither leaves too few GPUs serving too long nor, with
        `price_moves`, falls short of the trigger once its start-ups are paid."""
        if self._move_hurts(plan, running, classes, current):
            return False
        return not self.config.price_moves or self._move_pays(
            plan, running, classes, proposal, current
        )

    def _move_hurts(self, plan: Reconfiguration, running, classes, current) -> bool:
        """Whether the move leaves too few GPUs serving for longer than the SLOs' slack (none
        where the running configuration fails them)."""
        needed = gpus_needed(classes, self.profile, self.config)
        fewest = fewest_serving_gpus(plan, running)
        slack = (
            min(c.slo - t for c, t in zip(classes, current.latency)) if current.feasible else 0.0
        )
        self.history[-1].update(
            gpus_needed=round(needed, 2), fewest_serving=fewest, class_slack=round(slack, 3)
        )
        return fewest < needed and self.startup_delay > slack

    def _move_pays(self, plan: Reconfiguration, running, classes, proposal, current) -> bool:
        """Whether the move still passes the trigger once its start-ups are paid. Over the next
        period (what a plan serves before the planner looks again) each configuration that
        serves while the move is carried out (`move_timeline`; its counts pinned in Stage 1, 0
        on both objectives if it cannot meet the SLOs) stands in for the proposal for as long
        as it serves. A move to less throughput than runs now (wider instances, for slack) is
        made for a load that will pass: when the load rises again it is undone by a move that
        costs as much, so its cost counts twice."""
        period, gained = self.config.period, objectives(proposal)
        lost, left = [0.0, 0.0], period
        scored: dict[tuple, tuple[float, float]] = {}  # counts per TP degree -> objectives
        timeline = move_timeline(plan, running, self.startup_delay)
        for seconds, serving in within(timeline, period):
            key = tuple(sorted(counts_by_tp(serving).items()))
            if key not in scored:
                pinned = plan_capacity(classes, self.profile, self.config, fixed=serving)
                scored[key] = objectives(pinned)
            lost = [x + seconds * (g - v) for x, g, v in zip(lost, gained, scored[key])]
            left -= seconds
        before = counts_by_tp(slot_counts(running))
        trips = 2 if self._throughput(proposal.counts()) < self._throughput(before) else 1
        priced = tuple(g - trips * x / period for g, x in zip(gained, lost))
        self.history[-1].update(
            move_seconds=round(period - left, 1),
            trips=trips,
            priced=(round(priced[0], 4), round(priced[1], 3)),
        )
        return improves(priced, objectives(current), self.config.improvement)

    def _throughput(self, counts: dict[int, int]) -> float:
        """Tokens per second the instances carry at their best batch (cache steps with a
        cache, full steps without): what a layout can serve at the most."""
        costs = self.config.costs
        kind = costs.inner_kind if costs.cached else None
        kind = kind or self.config.costs.boundary_kind
        curve = self.profile.curve
        return sum(n * curve(tp, kind).best_throughput()[1] for tp, n in counts.items())
