"""Lower bounds on the makespan of ``P || C_max`` (identical ranks, indivisible matrices).

Used to prove how far a plan is from the best one achievable at one-matrix granularity
without running an exact solver.
"""

from __future__ import annotations

from typing import Sequence


def trivial_lower_bound(costs: Sequence[float], num_ranks: int) -> float:
    """``max(total / D, largest cost)``: the load must be spread and no matrix splits."""
    if not costs:
        return 0.0
    return max(sum(costs) / num_ranks, max(costs))


def makespan_lower_bound(costs: Sequence[float], num_ranks: int) -> float:
    """The strongest of the trivial bound and the pigeonhole bounds.

    Pigeonhole bound (a generalization of ``c_D + c_{D+1}``, e.g. Dell'Amico & Martello 1995,
    "Optimal scheduling of tasks on identical parallel processors", bound L1): sort costs
    decreasing ``c_1 >= c_2 >= ...``. Among the ``k D + 1`` largest matrices some rank owns at
    least ``k + 1``, so its load is at least the sum of the ``k + 1`` smallest of them,
    ``c_{kD+1-k} + ... + c_{kD+1}``, for every ``k >= 1`` with ``k D + 1 <= n``.

    Args:
        costs: per-matrix cost, ``>= 0``, any unit.
        num_ranks: number of ranks ``D >= 1``.

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
