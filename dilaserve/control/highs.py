"""The HiGHS calls both planning stages share: a model, whether a solve found a plan, reading
its solution, and HiGHS's own sum of terms (highspy is imported lazily, by each call)."""

from __future__ import annotations

# HiGHS's MIP search, and so which of several near-equal plans it returns, depends on its number
# of threads, by default derived from the machine's hardware threads: with one thread 3 of the
# paper-sized simulation's 40 planning rounds pick another plan. A fixed count gives every machine
# the same search (and the simulator the same decision log); 2 reproduces the published runs.
HIGHS_THREADS = 2


def qsum(terms):
    """HiGHS's sum of variables and expressions (one expression, not a chain of additions)."""
    import highspy

    return highspy.qsum(list(terms))


def new_model(time_limit: float, gap: float | None = None):
    """An empty, quiet HiGHS model with a time limit per solve; `gap` is the relative MIP gap
    a solve may stop at (HiGHS's default is 1e-4). Stage 1 passes `PlannerConfig.gap`, 1%:
    its objectives are read at the trigger's 10%, and a busy round's solve spends most of its
    time closing the last 1% (the Table 4 run planned in 40 s instead of 115, with the same
    decisions: docs/simulator/speed.md)."""
    import highspy

    h = highspy.Highs()
    h.silent()
    h.setOptionValue("threads", HIGHS_THREADS)
    h.setOptionValue("time_limit", time_limit)
    if gap is not None:
        h.setOptionValue("mip_rel_gap", gap)
    return h


def add_switched(h, bound: float, switches) -> list:
    """Variables 0 <= w_i <= `bound`, each held at 0 unless its binary is on (w_i <= bound *
    switches[i]). The same columns and rows, in the same order, as `addVariable` and `addConstr`
    once per variable, but in one call each, without highspy's expression layer: building the
    paper-sized simulation's 42 Stage-1 models took 2.9 s instead of 6.2 (under cProfile;
    docs/simulator/speed.md)."""
    import highspy
    import numpy as np

    n, first = len(switches), h.numVariables
    none = np.empty(0, dtype=np.int32)
    h.addCols(n, np.zeros(n), np.zeros(n), np.full(n, float(bound)), 0, none, none, np.empty(0))
    index = np.empty(2 * n, dtype=np.int32)  # each row: its switch, then its w (sorted)
    index[0::2] = [z.index for z in switches]
    index[1::2] = np.arange(first, first + n)
    value = np.empty(2 * n)
    value[0::2], value[1::2] = -bound, 1.0
    starts = np.arange(0, 2 * n, 2, dtype=np.int32)
    h.addRows(n, np.full(n, -highspy.kHighsInf), np.zeros(n), 2 * n, starts, index, value)
    return [highspy.highs_var(first + i, h) for i in range(n)]


def solved(h) -> bool:
    """Whether the last solve left a plan to read: optimal, or feasible within its time."""
    import highspy

    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kOptimal:
        return True
    # a time limit with a feasible incumbent still gives a usable plan
    return h.getInfo().primal_solution_status == 2


def solution_reader(h):
    """The solved model's value of a variable or expression, the solution read once
    (`h.val` copies the whole solution on every call: 8 s of a paper-sized simulation)."""
    import highspy

    solution = h.getSolution().col_value
    return lambda item: highspy.Highs.internal_get_value(solution, item)
