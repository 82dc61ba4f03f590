"""What every owner-assignment solver shares: the greedy, a plan's per-rank loads and the
makespan's lower bounds (imported by every other ``balance`` module, importing none).
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
    """Longest-processing-time first (LPT, Graham 1969), deterministic; arguments as
    :func:`dmuon.balance.solve`'s.

    Matrices are taken by unit (forward order), then by decreasing cost plus batch overhead
    (ties: input order); each goes to the rank with ``memory_cap`` room whose NS ends first
    with it (ties: the less loaded, then the lower rank). Without ``units`` and overheads that
    is plain LPT, at most ``4/3 - 1/(3 D)`` times the optimal makespan.

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
    """Per-rank load of a plan: :func:`completion_times` with one unit (a class's batch overhead
    paid once per owning rank)."""
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
    """``C[r, k]``, ``[num_ranks, num_units]`` float64: rank ``r``'s NS of units ``0..k``, each
    unit's load with the batch overhead of every class it owns there
    (:mod:`dmuon.balance.deadline`)."""
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
    """Per-matrix costs for the bounds: each class's batch overhead added to its first matrix."""
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
    """A lower bound on the makespan: the trivial bound and the pigeonhole bounds on
    ``P || C_max`` (Dell'Amico & Martello 1995, L1 generalized): with costs sorted decreasing,
    some rank owns ``k + 1`` of the ``k D + 1`` largest, so a load is at least
    ``c_{kD+1-k} + ... + c_{kD+1}``, for every ``k >= 1`` with ``k D + 1 <= n``.
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
