"""The exposed-time MILP (:mod:`dmuon.balance.deadline`), solved by CBC through PuLP.

Matrices of one unit and one class are interchangeable (a class is one cost, or one shape where
it pays a batch overhead), so ``x[q, r]`` counts the matrices of key ``q = (unit, class)`` rank
``r`` owns, as in :mod:`dmuon.balance.milp`:

    minimize    E + w M
    subject to  sum_r x[q, r] = n_q                                      for every key q
                U[k, r] = sum_(q in unit k) c_q x[q, r] + f_q z[q, r]     (per-unit NS load)
                x[q, r] <= n_q z[q, r]            (z binary, only where the class has f_q > 0)
                C[k, r] = C[k-1, r] + U[k, r],  C[-1, r] = 0                 (completion)
                C[k, r] - d_k <= E                            for every unit k and rank r
                C[K-1, r] <= M,   C[K-1, 0] >= C[K-1, 1] >= ...     (makespan; rank symmetry)
                E >= max(0, exposed lower bound)                    (lets CBC stop early)

``E`` is the exposed time (the max of ``C[k, r] - d_k`` over owners and non-owners alike: see
:mod:`dmuon.balance.deadline` for why the non-owners add nothing), ``M`` the makespan.

PuLP goes through :mod:`dmuon.balance.pulp_api` (issue 38: PuLP 3's bundled CBC or PuLP 4's
``pulp[cbc]``), as :mod:`dmuon.balance.milp` does, whose hang guard it shares: PuLP missing,
no CBC, a model PuLP cannot build, every CBC failure and unreadable values are a
:class:`MilpFailure`, so the caller keeps the heuristic plan with one warning.
"""

from __future__ import annotations

import warnings
from typing import Hashable, Mapping, Sequence

from dmuon.balance import pulp_api
from dmuon.balance.milp import MilpFailure, solve_with_cbc


def solve_deadline_milp(
    costs: Sequence[float],
    num_ranks: int,
    *,
    units: Sequence[int],
    deadlines: Sequence[float],
    classes: Sequence[Hashable],
    batch_overhead: Mapping[Hashable, float] | None = None,
    warm_start: Sequence[int] | None = None,
    time_limit_s: float = 10.0,
    makespan_weight: float = 1e-3,
    exposed_bound: float = 0.0,
) -> tuple[tuple[int, ...], bool]:
    """Solve the MILP above with CBC.

    Args:
        costs, num_ranks, units, deadlines, classes, batch_overhead, makespan_weight: as
            :func:`dmuon.balance.deadline.solve_exposed` (already checked there).
        warm_start: owners per matrix of a plan to start CBC from.
        time_limit_s: CBC wall-clock limit, seconds.
        exposed_bound: a proven lower bound on ``E``.

    Returns:
        ``(owners, optimal)``: owners per matrix, input order; ``optimal`` when CBC proved it.

    Raises:
        MilpFailure: PuLP or CBC missing, CBC crashed or hung, no plan by the time limit, or
            values that are not a plan.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.x announcing 4.0
        return _solve(costs, num_ranks, units, deadlines, classes, batch_overhead or {},
                      warm_start, time_limit_s, float(makespan_weight), float(exposed_bound))


def _keys(costs, units, classes, overhead):
    """Per matrix its key (unit, class); per key [count, cost, overhead, members]."""
    keys = []
    for i, c in enumerate(costs):
        f = float(overhead.get(classes[i], 0.0))
        keys.append((units[i], ("shape", classes[i]) if f > 0 else ("cost", float(c))))
    table: dict = {}
    for i, q in enumerate(keys):
        f = float(overhead.get(classes[i], 0.0))
        row = table.setdefault(q, [0, float(costs[i]), f, []])
        if row[1] != float(costs[i]):
            raise ValueError(f"dmuon: matrices {row[3][0]} and {i} share class {classes[i]!r} "
                             f"but cost {row[1]} vs {costs[i]}; one class must be one cost")
        row[0] += 1
        row[3].append(i)
    return keys, table


def _solve(costs, num_ranks, units, deadlines, classes, overhead, warm_start, time_limit_s, w,
           exposed_bound):
    # CBC on raw FLOPs (coefficients ~1e10, deadlines ~1e13) returned "solutions" whose counts
    # were all 0 (Pi0 on 8 ranks, issue 39): the model is solved in units of the largest cost.
    scale = max([float(c) for c in costs] + [float(v) for v in overhead.values()] + [0.0]) or 1.0
    costs = [float(c) / scale for c in costs]
    overhead = {k: float(v) / scale for k, v in overhead.items()}
    deadlines = [float(d) / scale for d in deadlines]
    exposed_bound = exposed_bound / scale
    keys, table = _keys(costs, units, classes, overhead)
    owners, optimal, _, _ = solve_with_cbc(
        lambda pulp: _build(pulp, keys, table, num_ranks, deadlines, warm_start, w, exposed_bound),
        lambda x: _read(x, list(table), table, num_ranks, len(costs)),
        time_limit_s=time_limit_s, warm_start=warm_start is not None)
    return tuple(owners), optimal


def _build(pulp, keys, table, num_ranks, deadlines, warm_start, w, exposed_bound):
    """The PuLP problem of the module docstring and its count variables ``x``."""
    new_var = pulp_api.variable
    order = list(table)
    K, ranks = len(deadlines), range(num_ranks)
    prob = pulp.LpProblem("dmuon_owner_exposed", pulp.LpMinimize)
    x = {(n, r): new_var(prob, f"x_{n}_{r}", 0, table[q][0], "Integer")
         for n, q in enumerate(order) for r in ranks}
    z = {(n, r): new_var(prob, f"z_{n}_{r}", 0, 1, "Binary")
         for n, q in enumerate(order) if table[q][2] > 0 for r in ranks}
    comp = {(k, r): new_var(prob, f"C_{k}_{r}", 0, None, "Continuous")
            for k in range(K) for r in ranks}
    e = new_var(prob, "exposed", 0, None, "Continuous")
    m = new_var(prob, "makespan", 0, None, "Continuous")
    prob += e + w * m
    prob += e >= max(0.0, exposed_bound)
    by_unit: dict[int, list[int]] = {k: [] for k in range(K)}
    for n, q in enumerate(order):
        by_unit[q[0]].append(n)
        prob += pulp.lpSum(x[n, r] for r in ranks) == table[q][0]
        for r in ranks:
            if (n, r) in z:
                prob += x[n, r] <= table[q][0] * z[n, r]
    for r in ranks:
        for k in range(K):
            unit = pulp.lpSum(table[order[n]][1] * x[n, r] + table[order[n]][2] * z[n, r]
                              if (n, r) in z else table[order[n]][1] * x[n, r]
                              for n in by_unit[k])
            prob += comp[k, r] == (comp[k - 1, r] if k else 0) + unit
            prob += comp[k, r] - float(deadlines[k]) <= e
        prob += comp[K - 1, r] <= m
        if r + 1 < num_ranks:
            prob += comp[K - 1, r] >= comp[K - 1, r + 1]
    if warm_start is not None:
        _warm(warm_start, keys, order, table, deadlines, num_ranks, x, z, comp, e, m)
    return prob, x


def _read(x, order, table, num_ranks, n):
    owners = [0] * n
    for k, q in enumerate(order):
        counts = []
        for r in range(num_ranks):
            v = pulp_api.value(x[k, r])
            ok = isinstance(v, (int, float)) and v == v and abs(v) != float("inf")
            if not ok or abs(v - round(v)) > 1e-6 or round(v) < 0:
                raise MilpFailure(f"CBC returned an unusable solution: {x[k, r].name} = {v!r} "
                                  f"is not a count of matrices (a non-negative integer)")
            counts.append(int(round(v)))
        members = table[q][3]
        if sum(counts) != len(members):
            raise MilpFailure(f"CBC returned an unusable solution: key {q!r} has {len(members)} "
                              f"matrices but its counts sum to {sum(counts)}")
        it = iter(members)
        for r, c in enumerate(counts):
            for _ in range(c):
                owners[next(it)] = r
    return owners


def _warm(owners, keys, order, table, deadlines, num_ranks, x, z, comp, e, m):
    """Feed a plan to CBC, ranks relabelled by decreasing load (the symmetry constraint)."""
    index = {q: n for n, q in enumerate(order)}
    K = len(deadlines)
    counts = [[0] * len(order) for _ in range(num_ranks)]
    for i, r in enumerate(owners):
        counts[r][index[keys[i]]] += 1
    cum = []
    for r in range(num_ranks):
        per = [0.0] * K
        for n, q in enumerate(order):
            if counts[r][n]:
                per[q[0]] += table[q][1] * counts[r][n] + table[q][2]
        row, t = [], 0.0
        for k in range(K):
            t += per[k]
            row.append(t)
        cum.append(row)
    relabel = sorted(range(num_ranks), key=lambda r: (-cum[r][-1], r))
    for new, old in enumerate(relabel):
        for n in range(len(order)):
            x[n, new].setInitialValue(counts[old][n])
            if (n, new) in z:
                z[n, new].setInitialValue(1 if counts[old][n] else 0)
        for k in range(K):
            comp[k, new].setInitialValue(cum[old][k])
    e.setInitialValue(max(0.0, max(c - d for row in cum for c, d in zip(row, deadlines))))
    m.setInitialValue(max(row[-1] for row in cum))
