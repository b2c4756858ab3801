"""When to reconfigure the cluster: the planner's trigger (papers.md 1.8).

Every `period` (5 minutes by default) the workload monitor's classes go through Stage 1 twice:
free (the proposal) and with instance counts pinned to what runs now (the current configuration
under the same workload; skipped when the proposal keeps the running counts, since the
objectives depend on instances per TP degree only). The proposal is carried out only if it
raises the mean threshold or the SLO slack by at least `improvement` (10%), or if the current
configuration can no longer meet the SLOs at all. Stage 2 then places the proposal keeping as
many running instances as it can, and `launch_order` sequences the moves. Called from
`Scheduler.on_tick(now)`.
"""

from __future__ import annotations

from collections.abc import Sequence

from dilaserve.control.decisions import Reconfiguration
from dilaserve.control.layout import InstanceSlot, launch_order, plan_layout
from dilaserve.control.monitor import WorkloadMonitor
from dilaserve.control.planner import CapacityPlan, PlannerConfig, counts_by_tp, plan_capacity
from dilaserve.control.profile import LatencyProfile
from dilaserve.request import Request


def worth_applying(proposal: CapacityPlan, current: CapacityPlan, gain: float) -> bool:
    if proposal.counts() == current.counts():
        return False
    if not current.feasible:
        return True  # a feasible plan, or the TP-1 fallback, beats a configuration that fails
    if not proposal.feasible:
        return False
    return (
        proposal.mean_threshold >= (1 + gain) * current.mean_threshold
        or proposal.slack >= (1 + gain) * current.slack
    )


class Reconfigurer:
    def __init__(
        self,
        profile: LatencyProfile,
        config: PlannerConfig,
        monitor: WorkloadMonitor | None = None,
    ):
        self.profile = profile
        self.config = config
        self.monitor = monitor or WorkloadMonitor(window=config.period)
        self._next_round = config.period
        self._rounds = 0
        self.history: list[dict] = []  # one entry per planning round, for run logs

    def record(self, request: Request, now: float) -> None:
        slo = request.deadline - request.arrival_time
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
        pinned: dict[tuple[int, int], int] = {}
        for inst in running:
            pinned[inst.node, inst.tp] = pinned.get((inst.node, inst.tp), 0) + 1
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
            }
        )
        if not apply:
            return None
        layout = plan_layout(
            proposal.counts(), self.config.gpus_per_node, running, self.config.time_limit
        )
        return launch_order(layout, running, proposal, f"r{self._rounds}")
