"""Cluster reconfiguration, Stage 2: where the planned instances go, and the order of the moves.

`plan_layout` (papers.md 1.8; DiLaServe Appendix B, Table 5): given R_d instances of each TP
degree, place them in per-node slots (slot l of TP d on node n, with the GPUs assigned to it) so
that as many running instances as possible keep their exact GPUs. `launch_order` then starts the
new instances one at a time, before each launch stopping only the running instances whose GPUs
it needs, and stops the remaining retired ones last.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dilaserve.control.decisions import InstanceSpec, Reconfiguration, RolloutStep
from dilaserve.control.highs import new_model, qsum, solution_reader, solved
from dilaserve.control.planner import CapacityPlan


@dataclass(frozen=True, slots=True)
class InstanceSlot:
    """A running instance as the planner sees it: where it is and which GPUs it holds."""

    instance_id: str
    node: int
    tp: int
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SlotPlacement:
    node: int
    tp: int
    gpus: tuple[int, ...]
    keep: str | None = None  # the existing instance that stays in this slot, if any


def plan_layout(
    counts: Mapping[int, int],
    gpus_per_node: Sequence[int],
    existing: Sequence[InstanceSlot],
    time_limit: float = 30.0,
) -> list[SlotPlacement]:
    """Stage 2: place R_d = counts[d] instances in node slots keeping most existing ones."""
    h = new_model(time_limit)
    nodes = range(len(gpus_per_node))
    degrees = sorted(d for d, r in counts.items() if r > 0)
    u, a = {}, {}
    for n in nodes:
        for d in degrees:
            for slot in range(gpus_per_node[n] // d):
                u[n, d, slot] = h.addBinary()
                assigned = [h.addBinary() for _ in range(gpus_per_node[n])]
                for g, var in enumerate(assigned):
                    a[n, d, slot, g] = var
                h.addConstr(qsum(assigned) == d * u[n, d, slot])
                if slot:  # symmetry: slots of one (node, tp) fill in order
                    h.addConstr(u[n, d, slot] <= u[n, d, slot - 1])
        for g in range(gpus_per_node[n]):
            on_gpu = [a[n, d, s, g] for d in degrees for s in range(gpus_per_node[n] // d)]
            if on_gpu:
                h.addConstr(qsum(on_gpu) <= 1)
    for d in degrees:
        h.addConstr(
            qsum(u[n, d, s] for n in nodes for s in range(gpus_per_node[n] // d)) == counts[d]
        )
    keep = {}  # (instance, node, tp, slot) -> binary: the instance stays in that slot
    for inst in existing:
        if inst.tp not in degrees or inst.node not in nodes or len(inst.gpus) != inst.tp:
            continue
        choices = []
        for slot in range(gpus_per_node[inst.node] // inst.tp):
            var = h.addBinary()
            keep[inst.instance_id, inst.node, inst.tp, slot] = var
            choices.append(var)
            h.addConstr(var <= u[inst.node, inst.tp, slot])
            for g in inst.gpus:
                h.addConstr(var <= a[inst.node, inst.tp, slot, g])
        h.addConstr(qsum(choices) <= 1)
    if keep:
        h.maximize(qsum(keep.values()))
    else:
        h.run()
    if not solved(h):
        raise ValueError(f"no placement of {dict(counts)} fits nodes with {gpus_per_node} GPUs")
    val = solution_reader(h)
    kept = {(n, d, slot): rid for (rid, n, d, slot), var in keep.items() if val(var) > 0.5}
    out = []
    for (n, d, slot), var in u.items():
        if val(var) > 0.5:
            gpus = tuple(g for g in range(gpus_per_node[n]) if val(a[n, d, slot, g]) > 0.5)
            out.append(SlotPlacement(n, d, gpus, kept.get((n, d, slot))))
    return out


def launch_order(
    layout: Sequence[SlotPlacement],
    existing: Sequence[InstanceSlot],
    plan: CapacityPlan,
    name_prefix: str,
    serial: bool = False,
) -> Reconfiguration:
    """Start new instances in turn; before each, stop only the old ones in its way.

    The next launch is always the one that needs the fewest running instances stopped, so
    capacity is added before it is taken away; retired instances nobody's GPUs need stop last.
    """
    kept = {p.keep for p in layout if p.keep}
    retiring = {i.instance_id: i for i in existing if i.instance_id not in kept}
    owner = {(i.node, g): i.instance_id for i in retiring.values() for g in i.gpus}
    pending = [p for p in layout if p.keep is None]
    steps = []

    def blockers(p: SlotPlacement) -> set[str]:
        return {owner[p.node, g] for g in p.gpus if (p.node, g) in owner}

    while pending:
        nxt = min(pending, key=lambda p: (len(blockers(p)), p.node, p.gpus))
        pending.remove(nxt)
        stop = tuple(sorted(blockers(nxt)))
        for rid in stop:
            inst = retiring.pop(rid)
            for g in inst.gpus:
                del owner[inst.node, g]
        spec = InstanceSpec(
            f"{name_prefix}-n{nxt.node}-tp{nxt.tp}-g{nxt.gpus[0]}", nxt.node, nxt.tp, nxt.gpus
        )
        steps.append(RolloutStep(stop, spec))
    return Reconfiguration(tuple(steps), tuple(sorted(retiring)), plan.counts(), serial)
