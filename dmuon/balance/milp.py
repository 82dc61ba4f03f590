"""Exact makespan minimization as a MILP over matrix classes, solved by CBC through PuLP.

Matrices of one *class* (one shape: same cost, same memory) are interchangeable, so instead of
one binary per (matrix, rank) the model counts them: ``x[s, r]`` is the number of class-``s``
matrices rank ``r`` owns. For Qwen2.5-7B (196 matrices, 7 shapes) at 256 ranks that is 1,792
integers instead of 50,176 binaries.

    minimize    T
    subject to  sum_r x[s, r] = n_s                                   for every class s
                L_r = sum_s c_s x[s, r] + f_s z[s, r] <= T              for every rank r
                x[s, r] <= n_s z[s, r]        (z binary, only where f_s > 0: batch overhead)
                sum_s m_s x[s, r] <= cap                                (memory cap, optional)
                L_0 >= L_1 >= ... >= L_{D-1}                            (breaks rank symmetry)
                T >= proven lower bound                                 (lets CBC stop early)

``c_s`` is the marginal NS cost of one class-``s`` matrix, ``f_s`` the fixed cost of running a
batch of them (see :func:`dmuon.balance.cost.fit_batch_costs`), ``m_s`` its bytes. Solved by
CBC (bundled with PuLP) with one thread, so an untimed-out solve is reproducible.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Hashable, Mapping, Sequence

from dmuon.balance.bounds import makespan_lower_bound

logger = logging.getLogger(__name__)


def _class_table(costs, classes, memory):
    """Unique classes in first-appearance order with count, cost and memory; validated."""
    order: list[Hashable] = []
    table: dict[Hashable, list] = {}
    for i, s in enumerate(classes):
        m = 0.0 if memory is None else float(memory[i])
        if s not in table:
            order.append(s)
            table[s] = [0, float(costs[i]), m, []]
        row = table[s]
        if row[1] != float(costs[i]) or row[2] != m:
            raise ValueError(
                f"dmuon: matrices {row[3][0]} and {i} share class {s!r} but have costs "
                f"{row[1]} vs {costs[i]} and memory {row[2]} vs {m}; one class must be one "
                f"cost and one memory size (give classes=None to group by (cost, memory))"
            )
        row[0] += 1
        row[3].append(i)
    return order, table


def solve_milp(
    costs: Sequence[float],
    num_ranks: int,
    *,
    classes: Sequence[Hashable],
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
    batch_overhead: Mapping[Hashable, float] | None = None,
    warm_start: Sequence[int] | None = None,
    time_limit_s: float = 10.0,
) -> tuple[tuple[int, ...], bool] | None:
    """Solve the class-count MILP above with CBC.

    Args:
        costs: per-matrix marginal cost, ``>= 0``; equal within a class.
        num_ranks: number of ranks ``D``.
        classes: per-matrix class key (interchangeable matrices share one).
        memory: per-matrix bytes on the owner, equal within a class, or None.
        memory_cap: bytes per rank, or None.
        batch_overhead: per-class fixed cost of owning any matrix of that class.
        warm_start: an initial plan (owners per matrix) for CBC, e.g. greedy's.
        time_limit_s: CBC wall-clock limit, seconds.

    Returns:
        ``(owners, optimal)``: owners per matrix in input order, ``optimal`` True when CBC
        proved it; None when CBC found no feasible plan in time (or proved there is none).

    Raises:
        ValueError: when matrices of one class differ in cost or memory.
    """
    with warnings.catch_warnings():
        # PuLP 3.x announces API changes for 4.0; the calls used here work from 2.8 on.
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve_milp(costs, num_ranks, classes=classes, memory=memory,
                           memory_cap=memory_cap, batch_overhead=batch_overhead,
                           warm_start=warm_start, time_limit_s=time_limit_s)


def _solve_milp(costs, num_ranks, *, classes, memory, memory_cap, batch_overhead, warm_start,
                time_limit_s):
    import pulp

    start = time.perf_counter()
    order, table = _class_table(costs, classes, memory)
    overhead = {s: float((batch_overhead or {}).get(s, 0.0)) for s in order}
    ranks = range(num_ranks)
    prob = pulp.LpProblem("dmuon_owner_makespan", pulp.LpMinimize)
    x = {(k, r): pulp.LpVariable(f"x_{k}_{r}", 0, table[s][0], cat="Integer")
         for k, s in enumerate(order) for r in ranks}
    z = {(k, r): pulp.LpVariable(f"z_{k}_{r}", cat="Binary")
         for k, s in enumerate(order) if overhead[s] > 0 for r in ranks}
    t = pulp.LpVariable("makespan", lowBound=0)
    prob += t
    eff = list(costs)
    for s in order:
        for i in table[s][3]:
            eff[i] += overhead[s]
    prob += t >= makespan_lower_bound(eff, num_ranks)
    for k, s in enumerate(order):
        prob += pulp.lpSum(x[k, r] for r in ranks) == table[s][0]
        for r in ranks:
            if (k, r) in z:
                prob += x[k, r] <= table[s][0] * z[k, r]
    load = []
    for r in ranks:
        expr = pulp.lpSum(table[s][1] * x[k, r] for k, s in enumerate(order))
        expr += pulp.lpSum(overhead[s] * z[k, r] for k, s in enumerate(order) if (k, r) in z)
        load.append(expr)
        prob += expr <= t
        if memory_cap is not None:
            prob += pulp.lpSum(table[s][2] * x[k, r] for k, s in enumerate(order)) <= memory_cap
    for r in range(num_ranks - 1):
        prob += load[r] >= load[r + 1]

    if warm_start is not None:
        _set_warm_start(warm_start, order, classes, costs, overhead, num_ranks, x, z, t)
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(round(time_limit_s))),
                               threads=1, warmStart=warm_start is not None)
    prob.solve(solver)
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        logger.debug("dmuon: CBC found no plan (status %s)", pulp.LpStatus[prob.status])
        return None
    owners = [0] * len(costs)
    for k, s in enumerate(order):
        members = iter(table[s][3])
        for r in ranks:
            for _ in range(int(round(x[k, r].value() or 0))):
                owners[next(members)] = r
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    logger.debug("dmuon: CBC %s in %.2fs (%d classes x %d ranks)",
                 "optimal" if optimal else "incumbent", time.perf_counter() - start,
                 len(order), num_ranks)
    return tuple(owners), optimal


def _set_warm_start(owners, order, classes, costs, overhead, num_ranks, x, z, t):
    """Feed a plan to CBC, relabelling ranks by decreasing load to satisfy symmetry breaking."""
    index = {s: k for k, s in enumerate(order)}
    counts = [[0] * len(order) for _ in range(num_ranks)]
    loads = [0.0] * num_ranks
    for i, r in enumerate(owners):
        counts[r][index[classes[i]]] += 1
        loads[r] += float(costs[i])
    for r in range(num_ranks):
        loads[r] += sum(overhead[s] for k, s in enumerate(order) if counts[r][k])
    relabel = sorted(range(num_ranks), key=lambda r: (-loads[r], r))
    for new, old in enumerate(relabel):
        for k in range(len(order)):
            x[k, new].setInitialValue(counts[old][k])
            if (k, new) in z:
                z[k, new].setInitialValue(1 if counts[old][k] else 0)
    t.setInitialValue(max(loads))


def check_memory_cap(
    memory: Sequence[float], num_ranks: int, memory_cap: float, *, time_limit_s: float = 10.0
) -> None:
    """Raise ValueError when no plan can keep every rank within ``memory_cap`` bytes.

    The smallest feasible cap is itself a makespan problem (memory as cost): a cap at or above
    greedy's memory makespan is feasible; below it the MILP decides.

    Raises:
        ValueError: naming the smallest feasible cap (exact when CBC proves it, else the best
            found and the proven lower bound).
    """
    from dmuon.balance.solver import greedy, solve

    owners = greedy(memory, num_ranks)
    per_rank = [0.0] * num_ranks
    for i, r in enumerate(owners):
        per_rank[r] += float(memory[i])
    if memory_cap >= max(per_rank):
        return
    best = solve(memory, num_ranks, method="milp", time_limit_s=time_limit_s)
    if memory_cap >= best.makespan:
        return
    gib = 2.0 ** 30
    if best.optimal or memory_cap < best.proven_bound:
        exact = best.makespan if best.optimal else best.proven_bound
        raise ValueError(
            f"dmuon: memory_cap={memory_cap:.0f} bytes ({memory_cap / gib:.3f} GiB) is "
            f"infeasible for {len(memory)} matrices on {num_ranks} ranks; the smallest feasible "
            f"cap is {'' if best.optimal else 'at least '}{exact:.0f} bytes "
            f"({exact / gib:.3f} GiB). Raise the cap or add ranks"
        )
    # Between the proven bound and the best plan found: let the caller's MILP try.
