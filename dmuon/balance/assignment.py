"""What every owner-assignment solver shares: the greedy, the per-rank load of a plan, and the
makespan's lower bounds.

Imports in ``balance/`` run one way: ``solver`` -> ``milp``/``grouping``/``local_search``/
``deadline``/``layout`` -> ``assignment``.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Mapping, Sequence

import numpy as np


def greedy(
    costs: Sequence[float],
    num_ranks: int,
    *,
    units: Sequence[int] | None = None,
    classes: Sequence[Hashable] | None = None,
    batch_overhead: Mapping[Hashable, float] | None = None,
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
) -> tuple[int, ...] | None:
    """Longest-processing-time first (LPT, Graham 1969), deterministic.

    Matrices are taken by unit (forward order), then by decreasing cost plus batch overhead
    (equal ones in input order); each goes to the rank whose NS of everything so far ends first
    with it, among the ranks with ``memory_cap`` room (ties: the less loaded, then the lower
    rank). A batch overhead is paid once per (rank, unit, class). Without ``units`` (one unit)
    and overheads that is plain LPT, at most ``4/3 - 1/(3 D)`` times the optimal makespan;
    with them it is the deadline greedy of :mod:`dmuon.balance.deadline`.

    Args:
        costs: per-matrix cost, any unit, ``>= 0``.
        num_ranks: number of ranks ``D >= 1``.
        units: per-matrix unit id ``0..K-1`` in forward order, or None (one unit).
        classes: per-matrix class; needed with ``batch_overhead``.
        batch_overhead: per-class cost paid once per (rank, unit) owning that class.
        memory: per-matrix bytes on its owner, or None.
        memory_cap: bytes per rank, or None for no cap.

    Returns:
        Owner rank per matrix in input order, or None when no rank has room for some matrix
        under ``memory_cap`` (a MILP may still find a plan).
    """
    n = len(costs)
    over = class_overheads(classes, batch_overhead, n)
    unit = [0] * n if units is None else units
    order = sorted(range(n), key=lambda i: (unit[i], -(float(costs[i]) + over[i]), i))
    owners = [0] * n
    if units is None and not batch_overhead and memory_cap is None:
        heap = [(0.0, r) for r in range(num_ranks)]
        for i in order:
            load, r = heapq.heappop(heap)
            owners[i] = r
            heapq.heappush(heap, (load + float(costs[i]), r))
        return tuple(owners)
    load = [0.0] * num_ranks
    used = [0.0] * num_ranks
    held: set[tuple] = set()
    for i in order:
        key = None if classes is None else classes[i]
        need = 0.0 if memory is None else float(memory[i])
        room = [r for r in range(num_ranks) if memory_cap is None or used[r] + need <= memory_cap]
        if not room:
            return None

        def finish(r):
            return load[r] + float(costs[i]) + (over[i] if (r, unit[i], key) not in held else 0.0)

        r = min(room, key=lambda q: (finish(q), load[q], q))
        load[r] = finish(r)
        used[r] += need
        held.add((r, unit[i], key))
        owners[i] = r
    return tuple(owners)


def evaluate(
    owners: Sequence[int],
    costs: Sequence[float],
    num_ranks: int,
    *,
    classes: Sequence[Hashable] | None = None,
    batch_overhead: Mapping[Hashable, float] | None = None,
) -> list[float]:
    """Per-rank load of a plan: a rank that owns ``k >= 1`` matrices of class ``s`` pays
    ``batch_overhead[s]`` once plus the ``k`` per-matrix costs (same-shape NS runs as one batch);
    :func:`completion_times` with one unit."""
    c = completion_times(owners, costs, [0] * len(owners), num_ranks, 1, classes=classes,
                         batch_overhead=batch_overhead)
    return [float(x) for x in c[:, 0]]


def class_overheads(classes, batch_overhead, n) -> list[float]:
    """Per-matrix batch overhead of its class (zeros without ``batch_overhead``)."""
    if not batch_overhead or classes is None:
        return [0.0] * n
    return [float(batch_overhead.get(c, 0.0)) for c in classes]


def completion_times(owners, costs, units, num_ranks, num_units, *, classes=None,
                     batch_overhead=None) -> np.ndarray:
    """``C[r, k]``, ``[num_ranks, num_units]`` float64: when rank ``r`` has finished the NS of
    everything it owns in units ``0..k`` (:mod:`dmuon.balance.deadline`), its per-unit loads
    summed, each with the batch overhead of every class it owns in that unit."""
    per = np.zeros((num_ranks, num_units))
    seen = set()
    over = class_overheads(classes, batch_overhead, len(costs))
    for i, (r, k) in enumerate(zip(owners, units)):
        per[r, k] += costs[i]
        if over[i] and (r, k, classes[i]) not in seen:
            seen.add((r, k, classes[i]))
            per[r, k] += over[i]
    return np.cumsum(per, axis=1)


def effective_costs(costs, classes, batch_overhead):
    """Per-matrix costs for the bounds: the batch overhead is paid at least once per class,
    so adding it to one matrix of each class keeps ``total`` a valid lower bound."""
    if not batch_overhead:
        return list(costs)
    eff = list(costs)
    done = set()
    for i, s in enumerate(classes):
        if s not in done:
            done.add(s)
            eff[i] += float(batch_overhead.get(s, 0.0))
    return eff


def trivial_lower_bound(costs: Sequence[float], num_ranks: int) -> float:
    """``max(total / D, largest cost)``: the load must be spread and no matrix splits."""
    if not costs:
        return 0.0
    return max(sum(costs) / num_ranks, max(costs))


def makespan_lower_bound(costs: Sequence[float], num_ranks: int) -> float:
    """The strongest of the trivial bound and the pigeonhole bounds on ``P || C_max``.

    Pigeonhole bound (Dell'Amico & Martello 1995, bound L1, generalized): with costs sorted
    decreasing ``c_1 >= c_2 >= ...``, among the ``k D + 1`` largest matrices some rank owns at
    least ``k + 1``, so its load is at least ``c_{kD+1-k} + ... + c_{kD+1}``, for every ``k >=
    1`` with ``k D + 1 <= n``.

    Returns:
        A value no plan's makespan can be below (same unit as ``costs``).
    """
    if not costs:
        return 0.0
    c = sorted((float(x) for x in costs), reverse=True)
    best = trivial_lower_bound(c, num_ranks)
    k = 1
    while k * num_ranks + 1 <= len(c):
        top = k * num_ranks + 1  # 1-based index of the last of the top set
        best = max(best, sum(c[top - 1 - k: top]))
        k += 1
    return best
