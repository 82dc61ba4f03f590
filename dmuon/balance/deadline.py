"""Owner plans that know deadlines: minimize the Newton-Schulz time the next forward waits for.

With NS overlapped with the next forward (``Muon(overlap="forward"|"backward")``), what the
step pays is not the NS makespan but the part of it the forward cannot hide. What the code
enforces (issue 46; :mod:`dmuon.owners.overlap`, :meth:`dmuon.hooks.unit.UnitContext.issue`):

* ``opt.step()`` schedules one job per publish group (a unit's matrices on one owner) and
  returns without waiting for any. Each owner runs its jobs one after the other, in the
  units' forward order (the order the first forward ran them,
  :meth:`~dmuon.hooks.unit.UnitContext.adopt_forward_order`), on one worker thread (CPU) or
  one side stream (CUDA), from when ``step()`` returns: time 0 here, which is taken as the
  start of forward 0 (whatever runs in between, e.g. data loading, only adds slack).
* The publication of unit ``k`` waits for unit ``k``'s jobs only. A prefetched publication
  whose job is not done is held back, not waited for, so forward ``k`` never waits for a later
  unit's NS. (Before issue 46 forward ``k`` waited for unit ``k + 1``'s jobs too, and
  ``step()`` for unit 0's: ``P_(k+1)`` against ``d_k``; this model never described that.)

So the constraint is, per owner ``r`` and unit ``k``: the end of ``r``'s jobs for units
``0..k`` (forward order) against the start of unit ``k``'s forward.

The same holds on CUDA: each job records an event on the jobs' side stream, and a
publication is issued on a publication stream that waits for its own unit's job event only
(:meth:`dmuon.owners.overlap.PendingSteps.stream_for`).

Model (``K`` units in forward order, ``D`` identical ranks):

* ``f_j``: forward time of unit ``j``; unit ``k``'s *deadline* ``d_k = f_0 + ... + f_(k-1)`` is
  when its forward starts when nothing waits (``d_0 = 0``).
* ``C[r, k]``: when rank ``r`` has finished the NS of every matrix it owns in units ``0..k``
  (its jobs run in unit order back to back, so ``C[r, k]`` is the prefix sum of its per-unit
  loads, each plus the batch overhead ``f_s`` of every shape it owns in that unit: one job
  batches a unit's matrices by shape).
* ``P_k = max_r C[r, k]`` over the owners of unit ``k``: when publication ``k`` can go.
* Forward ``k`` starts at ``S_k = max(S_(k-1) + f_(k-1), P_k)`` (publication ``k`` gates
  forward ``k``, forward ``k+1`` waits for forward ``k``).

By induction ``S_k - d_k = max_(j <= k) (P_j - d_j)^+``, so the step grows by the **exposed time**

    E = max(0, max_k (P_k - d_k)) = max(0, max_(r, k) (C[r, k] - d_k))

(the second form also takes ranks that own nothing of unit ``k``: their ``C[r, k]`` equals their
``C[r, j]`` for the last unit ``j < k`` they own, with ``d_j <= d_k``, so it adds nothing). The
*maximum*, not the sum: one late publication delays every later forward by the same amount and
a later late one only adds what exceeds it; a sum would count the same delay once per unit.

:func:`solve_exposed` minimizes ``E`` (then, with weight ``makespan_weight``, the makespan, which
the overlapped NS still costs in contention): a greedy in deadline order (each unit's matrices by
decreasing cost, each to the rank that finishes it first) refined by move/swap local search
aimed at the critical (rank, unit), then the MILP of :mod:`dmuon.balance.deadline_milp`
warm-started from it; a CBC failure keeps the heuristic plan with one warning, as
:func:`dmuon.balance.milp.milp_fallback` does for the makespan MILP.

Communication (the publication's broadcast) is not in ``E``: it is the same for every plan
up to the first unit's, and the simulator (``bench/simulate.py``) adds it. Nor is contention:
on CUDA the side stream shares the SMs with the forward.

Without a plan file, ``dedicate_params`` takes the least ``E`` among plans within 2% of the
makespan plan's makespan (:mod:`dmuon.balance.overlap_plan`, forward times from shapes:
:mod:`dmuon.hooks.default_plan`); :func:`solve_exposed` is ``python -m dmuon.profile
--objective exposed``'s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Hashable, Mapping, Sequence

import numpy as np

logger = logging.getLogger(__name__)

#: ``method="auto"`` runs the deadline MILP when (distinct (unit, class) keys) x (ranks) is at
#: most this (Qwen2.5-7B: 28 units x 3 classes = 84 keys, so up to 48 ranks).
AUTO_MAX_DEADLINE_VARS = 4096


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeadlineAssignment:
    """Result of :func:`solve_exposed`.

    Attributes:
        owners: owner rank per matrix, input order.
        loads: per-rank NS load (batch overheads per (unit, shape) included), unit of costs.
        exposed: the plan's exposed time ``E`` (module docstring), unit of costs.
        exposed_bound: a lower bound on ``E`` over all plans (:func:`exposed_lower_bound`).
        makespan: ``max(loads)``.
        method: ``"milp"`` or ``"greedy"`` (the heuristic; also after a MILP failure).
        detail: ``"deadline_greedy+local_search"`` or ``"cbc"``.
        optimal: True where proven (CBC optimal, or ``exposed`` equal to the bound).
        milp_status: as :attr:`dmuon.balance.solver.Assignment.milp_status`.
        solve_s: wall-clock seconds.
    """

    owners: tuple[int, ...]
    loads: tuple[float, ...]
    exposed: float
    exposed_bound: float
    makespan: float
    method: str
    detail: str
    optimal: bool
    milp_status: str
    solve_s: float

    @property
    def fell_back(self) -> bool:
        return self.milp_status.startswith("failed")


def deadlines_from_forward(forward: Sequence[float]) -> list[float]:
    """``d_k = forward[0] + ... + forward[k-1]``: when each unit's forward starts.

    Args:
        forward: forward time per unit, forward order, ``>= 0`` (any unit, that of the costs).
    """
    out, t = [], 0.0
    for f in forward:
        out.append(t)
        t += float(f)
    return out


def _overheads(classes, batch_overhead, n):
    if not batch_overhead:
        return [0.0] * n
    return [float(batch_overhead.get(c, 0.0)) for c in classes]


def completion_times(owners, costs, units, num_ranks, num_units, *, classes=None,
                     batch_overhead=None) -> np.ndarray:
    """``C[r, k]`` of the module docstring: ``[num_ranks, num_units]`` float64."""
    per = np.zeros((num_ranks, num_units))
    seen = set()
    over = _overheads(classes, batch_overhead, len(costs))
    for i, (r, k) in enumerate(zip(owners, units)):
        per[r, k] += costs[i]
        if over[i] and (r, k, classes[i]) not in seen:
            seen.add((r, k, classes[i]))
            per[r, k] += over[i]
    return np.cumsum(per, axis=1)


def exposed_time(owners: Sequence[int], costs: Sequence[float], units: Sequence[int],
                 deadlines: Sequence[float], num_ranks: int, *, classes=None,
                 batch_overhead: Mapping[Hashable, float] | None = None) -> float:
    """Exposed NS time ``E`` of a plan (module docstring), in the unit of ``costs``.

    Args:
        owners: owner rank per matrix.
        costs: NS cost per matrix (marginal when ``batch_overhead`` is given).
        units: unit id per matrix, ``0..K-1`` in forward order.
        deadlines: ``d_k`` per unit (:func:`deadlines_from_forward`).
        num_ranks: ranks ``D``.
        classes, batch_overhead: per-matrix class and per-class cost paid once per (rank,
            unit) owning any matrix of that class (the NS runs unit by unit).
    """
    if not len(costs):
        return 0.0
    c = completion_times(owners, [float(x) for x in costs], units, num_ranks, len(deadlines),
                         classes=classes, batch_overhead=batch_overhead)
    return max(0.0, float((c - np.asarray(deadlines, dtype=float)[None, :]).max()))


def exposed_lower_bound(costs: Sequence[float], units: Sequence[int], deadlines: Sequence[float],
                        num_ranks: int, *, classes=None, batch_overhead=None) -> float:
    """A bound no plan's ``E`` is below: every matrix finishes no earlier than its own cost
    after 0 (``c_i + f_i - d_(unit i)``), and units ``0..k`` hold ``W_k`` of work that ``D``
    ranks finish no earlier than ``W_k / D`` (``W_k / D - d_k``)."""
    over = _overheads(classes, batch_overhead, len(costs))
    best = 0.0
    work = np.zeros(len(deadlines))
    for i, (c, k) in enumerate(zip(costs, units)):
        best = max(best, float(c) + over[i] - float(deadlines[k]))
        work[k] += float(c)
    prefix = np.cumsum(work)
    for k, d in enumerate(deadlines):
        best = max(best, prefix[k] / num_ranks - float(d))
    return best


def check_units(costs, units, deadlines, num_ranks) -> None:
    """Raise ValueError on inconsistent inputs (naming the field, the value and the fix)."""
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"dmuon: solve_exposed(num_ranks={num_ranks!r}) must be a positive int")
    if len(units) != len(costs):
        raise ValueError(f"dmuon: solve_exposed got {len(units)} units for {len(costs)} costs; "
                         f"give one unit id per matrix")
    k = len(deadlines)
    bad = [u for u in units if not (isinstance(u, (int, np.integer)) and 0 <= u < k)]
    if bad:
        raise ValueError(f"dmuon: solve_exposed unit id {bad[0]!r} is not in 0..{k - 1} (one "
                         f"deadline per unit); number units 0..K-1 in forward order")
    d = [float(x) for x in deadlines]
    if any(not (x >= 0) for x in d) or any(b < a for a, b in zip(d, d[1:])):
        raise ValueError(f"dmuon: solve_exposed(deadlines={d[:8]}...) must be >= 0 and "
                         f"non-decreasing (forward starts in forward order); use "
                         f"deadlines_from_forward(forward_times)")
    if any(not (float(c) >= 0) or float(c) == float("inf") for c in costs):
        raise ValueError("dmuon: solve_exposed costs must be finite and >= 0")


def solve_exposed(
    costs: Sequence[float],
    num_ranks: int,
    *,
    units: Sequence[int],
    deadlines: Sequence[float],
    classes: Sequence[Hashable] | None = None,
    batch_overhead: Mapping[Hashable, float] | None = None,
    method: str = "auto",
    time_limit_s: float = 10.0,
    makespan_weight: float = 1e-3,
) -> DeadlineAssignment:
    """Owner per matrix minimizing the exposed NS time ``E + makespan_weight * makespan``.

    Args:
        costs: NS cost per matrix, ``>= 0`` (ms when profiled, FLOPs from the FLOP model).
        num_ranks: ranks ``D``.
        units: unit (FSDP2 block) per matrix, ids ``0..K-1`` in forward order.
        deadlines: forward start ``d_k`` per unit, same unit as ``costs``
            (:func:`deadlines_from_forward`).
        classes: per-matrix class (shape); matrices of one class in one unit are
            interchangeable. Default: equal ``cost``.
        batch_overhead: per-class cost paid once per (rank, unit) owning any of that class.
        method: ``"greedy"`` (heuristic only), ``"milp"`` (always CBC) or ``"auto"`` (CBC up to
            :data:`AUTO_MAX_DEADLINE_VARS` integer variables, and never once the heuristic
            meets :func:`exposed_lower_bound`).
        time_limit_s: CBC wall-clock limit (the local search gets half of it), seconds.
        makespan_weight: weight of the makespan in the objective, so that among plans of one
            ``E`` the one with the smaller makespan wins; 0 minimizes ``E`` alone.

    Returns:
        The :class:`DeadlineAssignment`.

    Raises:
        ValueError: on bad arguments (:func:`check_units`), or an unknown ``method``.
    """
    from dmuon.balance.deadline_search import deadline_greedy, improve_exposed

    start = time.perf_counter()
    costs = [float(c) for c in costs]
    units = [int(u) for u in units]
    check_units(costs, units, deadlines, num_ranks)
    if method not in ("auto", "greedy", "milp"):
        raise ValueError(f"dmuon: solve_exposed(method={method!r}) is not one of "
                         f"('auto', 'greedy', 'milp')")
    if classes is None:
        classes = list(costs)
    deadlines = [float(d) for d in deadlines]
    kw = dict(classes=classes, batch_overhead=batch_overhead)
    score = _scorer(costs, units, deadlines, num_ranks, makespan_weight, **kw)
    bound = exposed_lower_bound(costs, units, deadlines, num_ranks, **kw)
    owners = deadline_greedy(costs, units, num_ranks, **kw)
    owners = improve_exposed(owners, costs, units, deadlines, num_ranks,
                             makespan_weight=makespan_weight, time_limit_s=time_limit_s / 2, **kw)
    method_used, detail, optimal = "greedy", "deadline_greedy+local_search", False
    e0 = exposed_time(owners, costs, units, deadlines, num_ranks, **kw)
    n_keys = len(set(zip(units, classes)))
    meets = e0 <= bound + 1e-12 * max(1.0, sum(costs))
    if method == "greedy":
        status = "not run: method='greedy'"
    elif meets and method == "auto":
        status, optimal = "not run: the heuristic plan meets the lower bound", makespan_weight == 0
    elif method == "auto" and n_keys * num_ranks > AUTO_MAX_DEADLINE_VARS:
        status = (f"not run: {n_keys * num_ranks} integer variables > "
                  f"AUTO_MAX_DEADLINE_VARS={AUTO_MAX_DEADLINE_VARS}")
    else:
        res, status = _milp_with_fallback(costs, units, deadlines, num_ranks, owners, score,
                                          bound, time_limit_s, makespan_weight, **kw)
        if res is not None and score(res[0]) <= score(owners) * (1 + 1e-9) + 1e-12:
            owners, optimal = res
            method_used, detail = "milp", "cbc"
    exposed = exposed_time(owners, costs, units, deadlines, num_ranks, **kw)
    loads = completion_times(owners, costs, units, num_ranks, len(deadlines), **kw)[:, -1]
    optimal = optimal or (makespan_weight == 0 and exposed <= bound + 1e-12 * max(1.0, sum(costs)))
    return DeadlineAssignment(
        owners=tuple(int(r) for r in owners), loads=tuple(float(x) for x in loads),
        exposed=exposed, exposed_bound=bound, makespan=float(loads.max()), method=method_used,
        detail=detail, optimal=optimal, milp_status=status, solve_s=time.perf_counter() - start)


def _scorer(costs, units, deadlines, num_ranks, weight, *, classes, batch_overhead):
    def score(owners):
        c = completion_times(owners, costs, units, num_ranks, len(deadlines), classes=classes,
                             batch_overhead=batch_overhead)
        e = max(0.0, float((c - np.asarray(deadlines)[None, :]).max()))
        return e + weight * float(c[:, -1].max())
    return score


def _milp_with_fallback(costs, units, deadlines, num_ranks, warm, score, bound, time_limit_s,
                        weight, *, classes, batch_overhead):
    """The deadline MILP with the warm start, then once without (not when PuLP or CBC is
    missing); after the failure one warning line and ``(None, "failed: ...")``, as
    :func:`dmuon.balance.milp.milp_fallback`."""
    from dmuon.balance.deadline_milp import solve_deadline_milp
    from dmuon.balance.milp import milp_fallback

    res, status = milp_fallback(
        costs, num_ranks, warm_start=warm, fallback=None, score=None, solve_fn=solve_deadline_milp,
        units=units, deadlines=deadlines, classes=classes, batch_overhead=batch_overhead,
        time_limit_s=time_limit_s, makespan_weight=weight, exposed_bound=bound)
    if res is not None:
        return res, status
    e0 = exposed_time(warm, costs, units, deadlines, num_ranks, classes=classes,
                      batch_overhead=batch_overhead)
    logger.warning("dmuon: deadline MILP %s. Using the deadline_greedy+local_search plan instead "
                   "(exposed %.6g, bound %.6g)", status, e0, bound)
    return None, status
