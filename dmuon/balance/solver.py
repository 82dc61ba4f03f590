"""Owner assignment: one :func:`solve` for the makespan, the exposed time and the runtime plan.

Every dedicated matrix needs one owner rank that runs its Newton-Schulz (NS). Run after
backward, the step waits for the most loaded rank: the objective is the *makespan* ``max_r
load_r``, the identical-machines scheduling problem ``P || C_max`` (Graham 1969; NP-hard,
Garey & Johnson 1979). Overlapped with the next forward, the step pays the *exposed time*
``E`` of :mod:`dmuon.balance.deadline` instead, of which the makespan is the one-unit,
zero-deadline case. :func:`solve` serves three objectives:

* makespan (no ``deadlines``): LPT (Graham 1969; at most ``4/3 - 1/(3 D)`` times the optimum),
  MULTIFIT and move/swap local search (:mod:`dmuon.balance.local_search`), then, with
  ``group_cost``, publish-group merging (:mod:`dmuon.balance.grouping`);
* exposed time (``units`` and ``deadlines``): the deadline greedy and its local search
  (:mod:`dmuon.balance.deadline`);
* the runtime's plan (``deadlines`` and ``makespan_slack``): the makespan plan, then the least
  exposed time among plans within ``1 + makespan_slack`` of its makespan
  (:func:`dmuon.balance.deadline.refine_for_overlap`).

Each heuristic plan then warm-starts the exact MILP (:mod:`dmuon.balance.milp`, one model for
all three) when ``method`` asks for it, so ``"milp"`` is never worse than ``"heuristic"``.
Measured on the shipped inventories at 8-256 ranks (``bench/bench_solvers.py``,
docs/performance.md) the heuristics' plans are within 1% of the MILP's on both objectives in
a fraction of its time, which is why the runtime uses ``"heuristic"``. The result carries the
trivial lower bound ``max(total / D, largest cost)`` and a stronger ``proven_bound``
(:func:`dmuon.balance.bounds.makespan_lower_bound`), so the optimality gap is always known.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from dmuon.balance import deadline as dl
from dmuon.balance.assignment import effective_costs, evaluate, greedy
from dmuon.balance.bounds import makespan_lower_bound, trivial_lower_bound
from dmuon.balance.grouping import group_lpt, merge_groups, objective, publish_pairs
from dmuon.balance.layout import apply_layout
from dmuon.balance.local_search import improve, multifit
from dmuon.balance.milp import milp_fallback

logger = logging.getLogger(__name__)

#: ``auto`` solves the makespan MILP when (distinct given classes, i.e. shapes) x (ranks) is at
#: most this. Pi0 (16 shapes, 11 MILP classes) and Qwen2.5-7B (4 shapes, 3 classes) at 256
#: ranks count 4096 and 1024 here and finish in a few seconds on the 2-core dev machine.
AUTO_MAX_INTEGER_VARS = 8192

#: ``auto`` solves the publish-group MILP when (distinct (group, shape) pairs) x (ranks) is at
#: most this: its root LP is harder (Qwen2.5-7B at 64 ranks, 7168, overran a 2 s limit to 9 s).
AUTO_MAX_GROUP_VARS = 2048

#: ``auto`` solves the exposed-time MILP when (distinct (unit, class) keys) x (ranks) is at most
#: this (Qwen2.5-7B: 28 units x 3 classes = 84 keys, so up to 48 ranks).
AUTO_MAX_DEADLINE_VARS = 4096

_METHODS = ("auto", "greedy", "milp", "heuristic")


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    """Result of :func:`solve`.

    Attributes:
        owners: owner rank of every matrix, in input order.
        loads: per-rank cost (same unit as the input costs), batching included (with
            ``deadlines``: a batch overhead per (rank, unit, class), as NS runs unit by unit).
        memory: per-rank memory in bytes (zeros when no memory was given).
        makespan: ``max(loads)``.
        lower_bound: ``max(total / num_ranks, largest cost)``, the bound the design reports.
        proven_bound: a lower bound on the makespan at least as strong (pigeonhole bounds, or
            the makespan itself when ``optimal``); ``makespan / proven_bound - 1`` is a
            proven gap.
        method: ``"milp"`` or ``"greedy"``: the solver whose plan was returned (``"milp"``
            whenever CBC's plan is at least as good as the heuristic's, even when it is the
            warm start itself; ``"greedy"`` also after a MILP failure, see ``milp_status``).
        optimal: True only where the makespan is proven optimal (MILP optimal, or makespan
            equal to a lower bound); False for the exposed-time objective.
        solve_s: wall-clock seconds spent solving.
        detail: the algorithm behind the plan: ``"lpt"``, ``"lpt+local_search"``,
            ``"multifit+local_search"``, ``"deadline_greedy+local_search"`` or ``"cbc"``;
            with a group cost, ``"+merge_groups"`` or ``"group_lpt+merge_groups"``; for the
            runtime plan, ``"; <candidate>"`` when another candidate than the makespan plan won.
        group_cost: step time of one publish (group, owner) pair, in the cost unit.
        publish_pairs: distinct (group, owner) pairs (0 without ``groups``).
        milp_status: what the MILP did, one line: ``"optimal"``, ``"time limit"`` (CBC's
            best plan when its time limit struck, not proven optimal), ``"not run: ..."``
            (with the reason), or, when CBC failed twice and the heuristic plan was kept,
            ``"failed: <why>; retry without warm start failed: <why>"``
            (:func:`dmuon.balance.milp.milp_fallback`). A retry that worked reads
            ``"optimal (retried ...)"``.
        problem: ``"makespan"``, ``"exposed"`` or ``"overlap"`` (the runtime plan).
        exposed: the plan's exposed time ``E`` with ``deadlines`` (else 0), unit of the costs.
        exposed_bound: :func:`dmuon.balance.deadline.exposed_lower_bound` (else 0).
        candidate: ``"overlap"`` only: the winning candidate of
            :func:`dmuon.balance.deadline.refine_for_overlap`.
        makespan_plan_exposed: ``"overlap"`` only: ``E`` of the makespan plan.
        makespan_plan_makespan: ``"overlap"`` only: the makespan plan's makespan, batch
            overheads per (rank, unit, class).
    """

    owners: tuple[int, ...]
    loads: tuple[float, ...]
    memory: tuple[float, ...]
    makespan: float
    lower_bound: float
    proven_bound: float
    method: str
    optimal: bool
    solve_s: float = 0.0
    detail: str = "lpt"
    group_cost: float = 0.0
    publish_pairs: int = 0
    milp_status: str = "not run"
    problem: str = "makespan"
    exposed: float = 0.0
    exposed_bound: float = 0.0
    candidate: str = ""
    makespan_plan_exposed: float = 0.0
    makespan_plan_makespan: float = 0.0

    @property
    def fell_back(self) -> bool:
        """True when the MILP failed and the plan is the heuristic's fallback."""
        return self.milp_status.startswith("failed")

    @property
    def objective(self) -> float:
        """What the makespan objective minimized: ``makespan + group_cost * publish_pairs``."""
        return self.makespan + self.group_cost * self.publish_pairs

    @property
    def gap(self) -> float:
        """Proven relative optimality gap ``makespan / proven_bound - 1`` (0 when optimal);
        with a group cost it bounds the makespan term only."""
        if self.optimal or self.proven_bound <= 0:
            return 0.0
        return self.makespan / self.proven_bound - 1.0


def _check_inputs(costs, num_ranks, memory, memory_cap, method, groups, classes, group_cost, layout):
    if not (float(group_cost) >= 0.0) or float(group_cost) == float("inf"):
        raise ValueError(f"dmuon: solve(group_cost={group_cost!r}) must be finite and >= 0")
    if group_cost > 0 and groups is None:
        raise ValueError("dmuon: solve(group_cost=...) needs groups=... (publish group per matrix)")
    if group_cost > 0 and layout is not None:
        raise ValueError(
            "dmuon: solve(group_cost > 0) keeps a group's matrices on few owners while layout= "
            "spreads each group over ranks; give one of them"
        )
    if method not in _METHODS:
        raise ValueError(f"dmuon: solve(method={method!r}) is not one of {_METHODS}")
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"dmuon: solve(num_ranks={num_ranks!r}) must be a positive int")
    for name, seq in (("costs", costs), ("memory", memory)):
        if seq is None:
            continue
        for i, c in enumerate(seq):
            if not (float(c) >= 0.0) or float(c) == float("inf"):
                raise ValueError(
                    f"dmuon: solve({name}[{i}]={c!r}): every entry must be finite and >= 0"
                )
    for name, seq in (("memory", memory), ("groups", groups), ("classes", classes)):
        if seq is not None and len(seq) != len(costs):
            raise ValueError(
                f"dmuon: solve({name}=...) has {len(seq)} entries but costs has {len(costs)}; "
                f"give one entry per matrix"
            )
    if memory_cap is not None:
        if memory is None:
            raise ValueError("dmuon: solve(memory_cap=...) needs memory=... (bytes per matrix)")
        if not float(memory_cap) > 0:
            raise ValueError(f"dmuon: solve(memory_cap={memory_cap!r}) must be > 0 bytes")
    if layout is not None and layout[0] * layout[1] != num_ranks:
        raise ValueError(
            f"dmuon: solve(layout={layout!r}) has {layout[0] * layout[1]} ranks but "
            f"num_ranks={num_ranks}; nodes * gpus_per_node must equal num_ranks"
        )


def solve(
    costs: Sequence[float],
    num_ranks: int,
    *,
    units: Sequence[int] | None = None,
    deadlines: Sequence[float] | None = None,
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
    groups: Sequence[int] | None = None,
    classes: Sequence[Hashable] | None = None,
    batch_overhead: Mapping[Hashable, float] | None = None,
    layout: tuple[int, int] | None = None,
    method: str = "auto",
    time_limit_s: float = 10.0,
    group_cost: float = 0.0,
    makespan_weight: float = 1e-3,
    makespan_slack: float | None = None,
) -> Assignment:
    """Assign one owner rank to every matrix (module docstring: which objective when).

    Args:
        costs: per-matrix NS cost (ms when profiled, FLOPs from the FLOP model), ``>= 0``.
        num_ranks: number of ranks ``D``.
        units: with ``deadlines``: unit (FSDP2 block) per matrix, ids ``0..K-1`` in forward
            order.
        deadlines: forward start ``d_k`` per unit, unit of ``costs``
            (:func:`dmuon.balance.deadline.deadlines_from_forward`): minimize the exposed time
            ``E + makespan_weight * makespan`` (or, with ``makespan_slack``, the runtime plan).
            Takes none of ``memory_cap``, ``group_cost``, ``layout`` without ``makespan_slack``.
        memory: bytes each matrix costs its owner (fp32 master + momentum + gradient).
        memory_cap: bytes allowed per rank (needs ``memory``).
        groups: per-matrix group id (one layer = one group, ids increasing in forward order).
            With ``layout`` the owners are rearranged, at equal loads, so that a group spreads
            over different ranks and neighbouring groups differ in node and GPU
            (:func:`dmuon.balance.layout.apply_layout`).
        classes: per-matrix class (the shape); matrices of one class are interchangeable and
            batch together. Default: matrices with equal ``(cost, memory)`` form a class.
        batch_overhead: per-class cost paid once per rank (and unit, with ``deadlines``)
            owning any matrix of that class (the fixed part of a batched NS, from
            :func:`dmuon.balance.cost.fit_batch_costs`); ``costs`` then hold the marginal part.
        layout: ``(nodes, gpus_per_node)`` with ``nodes * gpus_per_node == num_ranks``.
        method: ``"greedy"``: plain LPT (the deadline greedy and its local search for the
            exposed time). ``"heuristic"``: the better of LPT and MULTIFIT refined by local
            search, no CBC (the runtime's). ``"milp"``: the heuristic plan, then CBC
            warm-started from it. ``"auto"``: ``"milp"`` up to :data:`AUTO_MAX_INTEGER_VARS`
            (:data:`AUTO_MAX_GROUP_VARS` with ``group_cost``, :data:`AUTO_MAX_DEADLINE_VARS`
            with ``deadlines``) integer variables, and never once the heuristic plan meets the
            lower bound. The runtime plan's refinement never runs CBC.
        time_limit_s: CBC wall-clock limit, seconds; on timeout the best plan found is kept.
            The local searches get part of it.
        group_cost: step time one (group, owner) pair costs (its broadcasts and reduce), in the
            unit of ``costs``; with ``groups``, the objective becomes ``makespan + group_cost *
            pairs``. 0 (default) minimizes the makespan alone.
        makespan_weight: exposed time only: the makespan's weight beside ``E``, so that among
            plans of one ``E`` the smaller makespan wins; 0 minimizes ``E`` alone.
        makespan_slack: with ``deadlines``: the runtime plan, the least ``E`` among plans whose
            makespan is at most ``1 + makespan_slack`` times the makespan plan's (and whose
            publish pairs are no more than its, with ``group_cost``).

    Returns:
        The :class:`Assignment`. With the same input it is the same on every run, unless the
        MILP hits its time limit (then the incumbent may depend on timing: solve once and
        share the plan file). A CBC failure is no error: the MILP is retried once without the
        warm start, then the heuristic plan is returned with one warning naming the cause
        (:func:`dmuon.balance.milp.milp_fallback`; ``Assignment.milp_status``).

    Raises:
        ValueError: on bad arguments (unit ids, deadlines: :func:`dmuon.balance.deadline.
            check_units`), or when ``memory_cap`` is infeasible (the message gives the
            smallest feasible cap) or only the MILP could meet it and it failed (the message
            gives the cause), ``group_cost`` without ``groups`` or with ``layout``.
    """
    start = time.perf_counter()
    costs = [float(c) for c in costs]
    _check_inputs(costs, num_ranks, memory, memory_cap, method, groups, classes, group_cost, layout)
    memory = None if memory is None else [float(m) for m in memory]
    if classes is None:
        classes = [(c, 0.0 if memory is None else memory[i]) for i, c in enumerate(costs)]
    if deadlines is not None:
        units = [int(u) for u in (units if units is not None else [])]
        dl.check_units(costs, units, deadlines, num_ranks)
        deadlines = [float(d) for d in deadlines]
        if makespan_slack is None:
            given = [k for k, v in (("memory_cap", memory_cap is not None),
                                    ("group_cost", group_cost != 0), ("layout", layout is not None))
                     if v]
            if given:
                raise ValueError(f"dmuon: solve(deadlines=...) (the exposed-time objective) takes "
                                 f"no {given}; leave them out or drop deadlines")
            return _solve_exposed(costs, num_ranks, start, units=units, deadlines=deadlines,
                                  classes=classes, batch_overhead=batch_overhead or None,
                                  memory=memory, method=method, time_limit_s=time_limit_s,
                                  weight=makespan_weight)
    result = _solve_makespan(costs, num_ranks, start, memory=memory, memory_cap=memory_cap,
                             groups=groups, classes=classes, batch_overhead=batch_overhead,
                             layout=layout, method=method, time_limit_s=time_limit_s,
                             group_cost=group_cost)
    if deadlines is None:
        return result
    return _overlap(result, costs, units, deadlines, classes, batch_overhead, memory,
                    makespan_slack, time_limit_s, start)


def _per_rank(owners, values, num_ranks):
    out = [0.0] * num_ranks
    if values is not None:
        for i, r in enumerate(owners):
            out[r] += values[i]
    return tuple(out)


def _solve_exposed(costs, num_ranks, start, *, units, deadlines, classes, batch_overhead, memory,
                   method, time_limit_s, weight):
    """The exposed-time objective: the deadline greedy and local search, then the MILP."""
    kw = dict(classes=classes, batch_overhead=batch_overhead)

    def score(owners):
        makespan = dl.completion_times(owners, costs, units, num_ranks, len(deadlines), **kw).max()
        return dl.exposed_time(owners, costs, units, deadlines, num_ranks, **kw) + weight * makespan

    bound = dl.exposed_lower_bound(costs, units, deadlines, num_ranks, **kw)
    owners = dl.deadline_greedy(costs, units, num_ranks, **kw)
    owners = dl.improve_exposed(owners, costs, units, deadlines, num_ranks, makespan_weight=weight,
                                time_limit_s=time_limit_s / 2, **kw)
    used, detail = "greedy", "deadline_greedy+local_search"
    e0 = dl.exposed_time(owners, costs, units, deadlines, num_ranks, **kw)
    n_keys = len(set(zip(units, classes)))
    if method in ("greedy", "heuristic"):
        status = f"not run: method={method!r}"
    elif method == "auto" and e0 <= bound + 1e-12 * max(1.0, sum(costs)):
        status = "not run: the heuristic plan meets the lower bound"
    elif method == "auto" and n_keys * num_ranks > AUTO_MAX_DEADLINE_VARS:
        status = (f"not run: {n_keys * num_ranks} integer variables > "
                  f"AUTO_MAX_DEADLINE_VARS={AUTO_MAX_DEADLINE_VARS}")
    else:
        res, status = milp_fallback(
            costs, num_ranks, warm_start=owners, fallback="deadline_greedy+local_search",
            score=lambda o: f"exposed {e0:.6g}, bound {bound:.6g}", what="deadline",
            units=units, deadlines=deadlines, time_limit_s=time_limit_s, makespan_weight=weight,
            bound=bound, **kw)
        if res is not None and score(res[0]) <= score(owners) * (1 + 1e-9) + 1e-12:
            owners, used, detail = res[0], "milp", "cbc"
    loads = dl.completion_times(owners, costs, units, num_ranks, len(deadlines), **kw)[:, -1]
    makespan = float(loads.max())
    return Assignment(
        owners=tuple(int(r) for r in owners), loads=tuple(float(x) for x in loads),
        memory=_per_rank(owners, memory, num_ranks), makespan=makespan,
        lower_bound=trivial_lower_bound(costs, num_ranks),
        proven_bound=min(makespan_lower_bound(costs, num_ranks), makespan), method=used,
        optimal=False, solve_s=time.perf_counter() - start, detail=detail, milp_status=status,
        problem="exposed", exposed=dl.exposed_time(owners, costs, units, deadlines, num_ranks, **kw),
        exposed_bound=bound)


def _overlap(result, costs, units, deadlines, classes, batch_overhead, memory, slack, time_limit_s,
             start):
    """The makespan plan ``result`` refined for overlap
    (:func:`dmuon.balance.deadline.refine_for_overlap`)."""
    from dataclasses import replace

    num_ranks = len(result.loads)
    kw = dict(classes=classes, batch_overhead=batch_overhead or None)
    owners, candidate = dl.refine_for_overlap(
        result.owners, costs, num_ranks, units=units, deadlines=deadlines,
        keep_pairs=result.group_cost > 0, makespan_slack=slack, time_limit_s=time_limit_s, **kw)

    def loads_of(plan):
        return dl.completion_times(plan, costs, units, num_ranks, len(deadlines), **kw)[:, -1]

    loads = loads_of(owners)
    moved = candidate != "makespan"
    return replace(
        result, owners=tuple(int(r) for r in owners), loads=tuple(float(x) for x in loads),
        makespan=float(loads.max()), memory=_per_rank(owners, memory, num_ranks),
        optimal=result.optimal and not moved,
        proven_bound=min(result.proven_bound, float(loads.max())),
        publish_pairs=publish_pairs(owners, units) if result.group_cost > 0 else result.publish_pairs,
        detail=f"{result.detail}; {candidate}" if moved else result.detail,
        solve_s=time.perf_counter() - start, problem="overlap",
        exposed=dl.exposed_time(owners, costs, units, deadlines, num_ranks, **kw),
        exposed_bound=float(dl.exposed_lower_bound(costs, units, deadlines, num_ranks, **kw)),
        candidate=candidate,
        makespan_plan_exposed=dl.exposed_time(result.owners, costs, units, deadlines, num_ranks, **kw),
        makespan_plan_makespan=float(loads_of(result.owners).max()))


def _solve_makespan(costs, num_ranks, start, *, memory, memory_cap, groups, classes,
                    batch_overhead, layout, method, time_limit_s, group_cost):
    """The makespan objective (module docstring)."""
    n = len(costs)
    batching = dict(classes=classes, batch_overhead=batch_overhead)
    if n == 0:
        return Assignment(owners=(), loads=(0.0,) * num_ranks, memory=(0.0,) * num_ranks,
                          makespan=0.0, lower_bound=0.0, proven_bound=0.0, method="greedy",
                          optimal=True, solve_s=0.0)
    if memory_cap is not None:
        check_memory_cap(memory, num_ranks, float(memory_cap), time_limit_s=time_limit_s / 2)

    eff = effective_costs(costs, classes, batch_overhead)
    lower = max(sum(eff) / num_ranks, max(eff))
    bound = makespan_lower_bound(eff, num_ranks)

    owners = greedy(costs, num_ranks, memory=memory, memory_cap=memory_cap)
    used = "greedy"
    optimal = False
    n_vars = len(set(classes)) * num_ranks
    want_milp = method == "milp" or (method == "auto" and n_vars <= AUTO_MAX_INTEGER_VARS)
    status = (f"not run: method={method!r}" if method in ("greedy", "heuristic") else
              f"not run: {n_vars} integer variables > AUTO_MAX_INTEGER_VARS="
              f"{AUTO_MAX_INTEGER_VARS}" if not want_milp else "not run")
    heuristic = "lpt"
    if method == "greedy":
        pass  # plain LPT, as documented
    elif not batch_overhead:
        packed = multifit(costs, num_ranks, memory=memory, memory_cap=memory_cap)
        if packed is not None and (owners is None or max(evaluate(packed, costs, num_ranks))
                                   < max(evaluate(owners, costs, num_ranks))):
            owners, heuristic = packed, "multifit"
        if owners is not None:
            heuristic += "+local_search"
            owners = improve(owners, costs, num_ranks, classes=classes, memory=memory,
                             memory_cap=memory_cap, time_limit_s=time_limit_s / 2)
    if owners is not None:
        loads = evaluate(owners, costs, num_ranks, classes=classes, batch_overhead=batch_overhead)
        if max(loads) <= bound * (1 + 1e-12):
            optimal, want_milp = True, False  # greedy met a lower bound: nothing to improve
            status = "not run: the heuristic plan meets the lower bound"
    if group_cost > 0:
        want_milp = False  # the group MILP below subsumes the makespan one
        status = "not run"
    if want_milp or owners is None:
        res, status = milp_fallback(
            costs, num_ranks, warm_start=owners, fallback=None if owners is None else heuristic,
            score=lambda o: f"{max(evaluate(o, costs, num_ranks, **batching)) / bound:.4f}x the bound",
            classes=classes, memory=memory, memory_cap=memory_cap,
            batch_overhead=batch_overhead, time_limit_s=time_limit_s)
        if res is not None:
            m_owners, m_optimal = res
            m_loads = evaluate(m_owners, costs, num_ranks, classes=classes,
                               batch_overhead=batch_overhead)
            # CBC's plan whenever it is at least as good: at the time limit its incumbent may
            # be the warm start itself, and the plan is then still the MILP's answer.
            if owners is None or max(m_loads) <= max(loads) * (1 + 1e-12):
                owners, used, optimal, heuristic = m_owners, "milp", m_optimal, "cbc"
    if owners is None:
        raise ValueError(
            f"dmuon: no assignment of {n} matrices to {num_ranks} ranks fits "
            f"memory_cap={memory_cap:.0f} bytes within time_limit_s={time_limit_s} (MILP: "
            f"{status}); raise the cap or the time limit"
        )
    pairs = 0
    if group_cost > 0:
        owners, used, optimal, heuristic, status = _place_groups(
            owners, heuristic, costs, num_ranks, groups=groups, group_cost=group_cost,
            classes=classes, batch_overhead=batch_overhead, memory=memory,
            memory_cap=memory_cap, method=method, time_limit_s=time_limit_s)
    if groups is not None:
        pairs = publish_pairs(owners, groups)
    if layout is not None and groups is not None:
        owners = apply_layout(owners, classes, groups, *layout)
    loads = evaluate(owners, costs, num_ranks, classes=classes, batch_overhead=batch_overhead)
    makespan = max(loads)
    if group_cost > 0:  # optimal only if both terms are at their minimum (or CBC proved it)
        optimal = optimal or (makespan <= bound * (1 + 1e-12) and pairs == len(set(groups)))
    else:
        optimal = optimal or makespan <= bound * (1 + 1e-12)
    result = Assignment(
        owners=tuple(int(r) for r in owners), loads=tuple(loads),
        memory=_per_rank(owners, memory, num_ranks),
        makespan=makespan, lower_bound=lower,
        proven_bound=makespan if optimal else bound, method=used, optimal=optimal,
        detail=heuristic, group_cost=float(group_cost), publish_pairs=pairs,
        solve_s=time.perf_counter() - start, milp_status=status,
    )
    logger.debug("dmuon: solve(%d matrices, %d ranks) -> %s makespan %.4g, bound %.4g",
                 n, num_ranks, used, makespan, result.proven_bound)
    return result


def _place_groups(owners, heuristic, costs, num_ranks, *, groups, group_cost, classes,
                  batch_overhead, memory, memory_cap, method, time_limit_s):
    """The best of: ``owners`` and group-LPT, each refined by merge_groups, then the group
    MILP warm-started from it (when ``method`` allows it at this size). Returns ``(owners,
    method, optimal, detail, milp_status)``."""
    score = dict(groups=groups, group_cost=group_cost, classes=classes,
                 batch_overhead=batch_overhead)
    common = dict(score, memory=memory, memory_cap=memory_cap, time_limit_s=time_limit_s / 4)
    candidates = [(merge_groups(owners, costs, num_ranks, **common), heuristic + "+merge_groups")]
    start = group_lpt(costs, num_ranks, groups=groups, memory=memory, memory_cap=memory_cap)
    if start is not None:
        candidates.append((merge_groups(start, costs, num_ranks, **common),
                           "group_lpt+merge_groups"))
    best, detail = min(candidates, key=lambda c: objective(c[0], costs, num_ranks, **score))
    used, optimal = "greedy", False
    keys = len(set(zip(groups, classes)))
    status = (f"not run: {keys * num_ranks} integer variables > AUTO_MAX_GROUP_VARS="
              f"{AUTO_MAX_GROUP_VARS}" if method == "auto" else f"not run: method={method!r}")
    if method == "milp" or (method == "auto" and keys * num_ranks <= AUTO_MAX_GROUP_VARS):
        start_obj = objective(best, costs, num_ranks, **score)
        res, status = milp_fallback(
            costs, num_ranks, warm_start=best, fallback=detail,
            score=lambda o: f"{objective(o, costs, num_ranks, **score) / start_obj:.4f}x the start",
            classes=classes, memory=memory, memory_cap=memory_cap,
            batch_overhead=batch_overhead, time_limit_s=time_limit_s, groups=groups,
            group_cost=group_cost)
        if res is not None and (objective(res[0], costs, num_ranks, **score)
                                <= start_obj * (1 + 1e-12)):
            best, used, optimal, detail = res[0], "milp", res[1], "cbc"
    return best, used, optimal, detail, status


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
    if memory_cap >= max(_per_rank(greedy(memory, num_ranks), memory, num_ranks)):
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
