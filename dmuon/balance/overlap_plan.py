"""The runtime's owner plan: the least exposed Newton-Schulz among plans as good as the makespan
plan.

``dedicate_params`` solves the plan before ``dmuon.Muon`` exists, so it cannot know whether NS
will overlap the next forward (``overlap="forward"``/``"backward"``, where the step pays the
*exposed time* ``E`` of :mod:`dmuon.balance.deadline`) or run inside ``step()``
(``overlap="off"``, where it pays the makespan). :func:`refine_for_overlap` serves both: given
the makespan plan (:func:`dmuon.balance.solve`, the plan ``dedicate_params`` used to keep; its
caller :func:`dmuon.owners.plan.build_plan` solves it), it returns, among the candidates below whose makespan is at most ``1 + makespan_slack`` times
that plan's (and, with a group cost, whose publish (unit, owner) pairs are no more than its), the
one with the least ``E`` (ties: the smaller makespan). The makespan plan is a candidate itself,
so the result's ``E`` never exceeds the makespan plan's, and its makespan never exceeds it by
more than the slack.

Candidates:

* the makespan plan;
* the makespan plan refined for ``E`` by :func:`dmuon.balance.deadline_search.improve_exposed`
  with every rank's load capped at the allowed makespan (and the pairs capped);
* without a group cost, the deadline plan (:func:`dmuon.balance.deadline_search.deadline_greedy`
  refined by ``improve_exposed``), which ignores the makespan.

Why both searches: on the FLOP model with 4096 tokens per rank, the capped refinement of the
makespan plan gets stuck far from the bound on Qwen2.5-7B (8 ranks: ``E`` 3.05e13 against the
deadline plan's 3.24e12, which is the bound), while the deadline plan alone costs Pi0 at 64 ranks
16% more makespan, where the capped refinement gets to 9.31e10 against the bound's 8.85e10
(1.43e11 on a loaded machine: the search is time-limited; ``tests/test_deadline.py`` prints the
figures). Why a slack of 2%: the deadline plan's extra makespan was 0.13% (Pi0, 8 ranks), 1.26%
(Qwen2.5-7B, 8) and 0.52% (Qwen2.5-7B, 64), and the FLOP model's error is larger than that;
with NS at 15-30% of a VLA step (issue 46), 2% of NS is at most 0.6% of the step with
``overlap="off"``.

No CBC here: it runs at every ``dedicate_params`` and must stay well under a second (the
runtime's makespan plan is ``solve(method="heuristic")``: at 16 to 64 ranks CBC's time-limited
makespan plan for Pi0 was its warm start, docs/performance.md); the deadline MILP is
:func:`dmuon.balance.deadline.solve_exposed`'s, for ``python -m dmuon.profile --objective
exposed``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Hashable, Mapping, Sequence

from dmuon.balance.deadline import check_units, completion_times, exposed_lower_bound, exposed_time
from dmuon.balance.grouping import publish_pairs

#: The makespan the runtime plan may add to the makespan plan's, as a fraction of it (module
#: docstring).
MAKESPAN_SLACK = 0.02


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OverlapChoice:
    """Result of :func:`refine_for_overlap`.

    Attributes:
        owners: owner rank per matrix, input order.
        loads: per-rank NS load (batch overheads per (rank, unit, class)), unit of the costs.
        makespan: ``max(loads)``.
        exposed: the plan's exposed time ``E``, unit of the costs.
        exposed_bound: :func:`dmuon.balance.deadline.exposed_lower_bound`.
        makespan_plan_exposed: ``E`` of the makespan plan given.
        makespan_plan_makespan: the makespan plan's makespan, in the same terms as ``makespan``.
        pairs: distinct (unit, owner) pairs of the plan.
        candidate: ``"makespan"``, ``"makespan+exposed_search"`` or ``"deadline"``.
        solve_s: wall-clock seconds.
    """

    owners: tuple[int, ...]
    loads: tuple[float, ...]
    makespan: float
    exposed: float
    exposed_bound: float
    makespan_plan_exposed: float
    makespan_plan_makespan: float
    pairs: int
    candidate: str
    solve_s: float


def refine_for_overlap(
    makespan_owners: Sequence[int],
    costs: Sequence[float],
    num_ranks: int,
    *,
    units: Sequence[int],
    deadlines: Sequence[float],
    classes: Sequence[Hashable] | None = None,
    batch_overhead: Mapping[Hashable, float] | None = None,
    keep_pairs: bool = False,
    makespan_slack: float = MAKESPAN_SLACK,
    time_limit_s: float = 0.5,
) -> OverlapChoice:
    """The plan of the module docstring.

    Args:
        makespan_owners: the makespan plan, owner rank per matrix.
        costs: NS cost per matrix, ``>= 0`` (FLOPs from the FLOP model, ms when profiled).
        num_ranks: ranks ``D``.
        units: unit (publish group) per matrix, ids ``0..K-1`` in forward order.
        deadlines: forward start ``d_k`` per unit, unit of ``costs``
            (:func:`dmuon.balance.deadline.deadlines_from_forward`).
        classes: per-matrix class (shape); default: equal cost.
        batch_overhead: per-class cost paid once per (rank, unit) owning that class.
        keep_pairs: no candidate has more publish (unit, owner) pairs than the makespan plan
            (which then minimized ``makespan + group_cost * pairs``).
        makespan_slack: the fraction (``>= 0``) of the makespan plan's makespan a candidate may
            add.
        time_limit_s: wall-clock seconds the two searches share, > 0.

    Returns:
        The :class:`OverlapChoice`; its ``exposed`` is at most ``makespan_plan_exposed``.

    Raises:
        ValueError: bad arguments (:func:`dmuon.balance.deadline.check_units`), an owner per
            matrix missing, or a negative ``makespan_slack``.
    """
    from dmuon.balance.deadline_search import deadline_greedy, improve_exposed

    start = time.perf_counter()
    costs = [float(c) for c in costs]
    units = [int(u) for u in units]
    check_units(costs, units, deadlines, num_ranks)
    if len(makespan_owners) != len(costs):
        raise ValueError(f"dmuon: refine_for_overlap got {len(makespan_owners)} owners for "
                         f"{len(costs)} costs; give the makespan plan's owner of every matrix")
    if not float(makespan_slack) >= 0:
        raise ValueError(f"dmuon: refine_for_overlap(makespan_slack={makespan_slack!r}) must be "
                         f">= 0 (a fraction of the makespan plan's makespan)")
    classes = list(costs) if classes is None else list(classes)
    deadlines = [float(d) for d in deadlines]
    kw = dict(classes=classes, batch_overhead=batch_overhead or None)

    def measure(owners):
        loads = completion_times(owners, costs, units, num_ranks, len(deadlines), **kw)[:, -1]
        return exposed_time(owners, costs, units, deadlines, num_ranks, **kw), float(loads.max())

    base = [int(r) for r in makespan_owners]
    # the makespan in the deadline model's terms (a batch overhead per (rank, unit, class), as
    # the NS runs unit by unit), so that the makespan plan itself is always allowed
    cap = measure(base)[1] * (1 + float(makespan_slack))
    pair_cap = publish_pairs(base, units) if keep_pairs else None
    search = dict(deadlines=deadlines, num_ranks=num_ranks, **kw)
    owners_of = {"makespan": base}
    owners_of["makespan+exposed_search"] = improve_exposed(
        list(base), costs, units, load_cap=cap, pair_cap=pair_cap,
        time_limit_s=time_limit_s / 2, **search)
    if not keep_pairs:  # the deadline plan spreads each unit over many owners: no pair cap holds
        owners_of["deadline"] = improve_exposed(
            deadline_greedy(costs, units, num_ranks, **kw), costs, units,
            time_limit_s=time_limit_s / 2, **search)
    scored = {name: measure(owners) for name, owners in owners_of.items()}
    allowed = [name for name, (_, m) in scored.items() if m <= cap * (1 + 1e-12)
               and (pair_cap is None or publish_pairs(owners_of[name], units) <= pair_cap)]
    best = min(allowed, key=lambda name: scored[name])  # "makespan" is always allowed
    owners = owners_of[best]
    loads = completion_times(owners, costs, units, num_ranks, len(deadlines), **kw)[:, -1]
    return OverlapChoice(
        owners=tuple(int(r) for r in owners), loads=tuple(float(x) for x in loads),
        makespan=float(loads.max()), exposed=scored[best][0],
        exposed_bound=float(exposed_lower_bound(costs, units, deadlines, num_ranks, **kw)),
        makespan_plan_exposed=scored["makespan"][0], makespan_plan_makespan=scored["makespan"][1],
        pairs=publish_pairs(owners, units), candidate=best, solve_s=time.perf_counter() - start)
