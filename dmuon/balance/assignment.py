"""What every owner-assignment solver shares: LPT, the per-rank load of an assignment, and
the costs the lower bounds use.

The orchestrator (:func:`dmuon.balance.solver.solve`) and every solver below it (the MILP in
:mod:`dmuon.balance.milp`, the publish-group heuristics in :mod:`dmuon.balance.grouping`, the
local search) import from here, so imports in ``balance/`` run one way: ``solver`` ->
``milp``/``grouping``/``local_search``/``layout`` -> ``assignment``/``bounds``.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Mapping, Sequence


def greedy(
    costs: Sequence[float],
    num_ranks: int,
    *,
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
) -> tuple[int, ...] | None:
    """Longest-processing-time-first assignment (Graham 1969), deterministic.

    Matrices are taken by decreasing cost (equal costs in input order) and each goes to the
    least loaded rank that still has ``memory_cap`` room (equal loads: lowest rank).

    Args:
        costs: per-matrix cost, any unit, ``>= 0``.
        num_ranks: number of ranks ``D >= 1``.
        memory: per-matrix bytes on its owner, or None.
        memory_cap: bytes per rank, or None for no cap.

    Returns:
        Owner rank per matrix in input order, or None when greedy found no rank with room
        for some matrix under ``memory_cap`` (a MILP may still find a plan).
    """
    order = sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i))
    owners = [0] * len(costs)
    if memory_cap is None:
        heap = [(0.0, r) for r in range(num_ranks)]
        for i in order:
            load, r = heapq.heappop(heap)
            owners[i] = r
            heapq.heappush(heap, (load + float(costs[i]), r))
        return tuple(owners)
    loads = [0.0] * num_ranks
    mem = [0.0] * num_ranks
    for i in order:
        need = float(memory[i])
        best = None
        for r in range(num_ranks):
            if mem[r] + need <= memory_cap and (best is None or loads[r] < loads[best]):
                best = r
        if best is None:
            return None
        owners[i] = best
        loads[best] += float(costs[i])
        mem[best] += need
    return tuple(owners)


def evaluate(
    owners: Sequence[int],
    costs: Sequence[float],
    num_ranks: int,
    *,
    classes: Sequence[Hashable] | None = None,
    batch_overhead: Mapping[Hashable, float] | None = None,
) -> list[float]:
    """Per-rank load of an assignment, with the batching model of :func:`solve`.

    A rank that owns ``k >= 1`` matrices of class ``s`` pays ``batch_overhead[s]`` once plus
    the ``k`` per-matrix costs (NS of same-shape matrices runs as one batch).
    """
    loads = [0.0] * num_ranks
    seen: set[tuple[int, Hashable]] = set()
    for i, r in enumerate(owners):
        loads[r] += float(costs[i])
        if batch_overhead and classes is not None:
            key = (r, classes[i])
            if key not in seen:
                seen.add(key)
                loads[r] += float(batch_overhead.get(classes[i], 0.0))
    return loads


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
