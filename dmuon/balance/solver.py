"""Owner assignment: one :func:`solve` for the makespan, the exposed time and the runtime plan.

* makespan ``max_r load_r`` (``P || C_max``, Graham 1969; no ``deadlines``): LPT, MULTIFIT and
  move/swap local search (:mod:`dmuon.balance.local_search`), then, with ``group_cost``,
  publish-group merging (:mod:`dmuon.balance.grouping`);
* exposed time ``E`` (``units`` and ``deadlines``, :mod:`dmuon.balance.deadline`): the greedy in
  unit order and :func:`dmuon.balance.deadline.improve_exposed`;
* the runtime plan (``deadlines`` and ``makespan_slack``): the least ``E`` among plans within
  ``1 + makespan_slack`` of the makespan plan's makespan (:func:`_overlap`).

Where ``method`` asks for it, each heuristic plan warm-starts the MILP (:mod:`dmuon.balance.milp`),
so ``"milp"`` is never worse than ``"heuristic"``. The heuristics are within 1% of the MILP on the
shipped inventories at 8-256 ranks (docs/performance.md), so the runtime uses ``"heuristic"``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Hashable, Mapping, Sequence

import numpy as np

from dmuon.balance import deadline as dl
from dmuon.balance.assignment import (effective_costs, evaluate, greedy, makespan_lower_bound,
                                      trivial_lower_bound)
from dmuon.balance.grouping import group_lpt, merge_groups, objective, publish_pairs
from dmuon.balance.layout import apply_layout
from dmuon.balance.local_search import improve, multifit
from dmuon.balance.milp import milp_fallback

logger = logging.getLogger(__name__)

#: ``auto`` solves the makespan MILP up to this many (distinct classes) x (ranks): Pi0 at 256
#: ranks counts 4096 and solves in a few seconds on 2 CPU cores.
AUTO_MAX_INTEGER_VARS = 8192
#: ... the publish-group MILP up to this many (distinct (group, class) pairs) x (ranks): its
#: root LP is harder.
AUTO_MAX_GROUP_VARS = 2048
#: ... the exposed-time MILP up to this many (distinct (unit, class) keys) x (ranks).
AUTO_MAX_DEADLINE_VARS = 4096

_METHODS = ("auto", "greedy", "milp", "heuristic")


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    """Result of :func:`solve`; loads and times in the unit of the costs.

    Attributes:
        owners: owner rank of every matrix, in input order.
        loads: per-rank cost, batching included (with ``deadlines``: an overhead per (rank, unit,
            class)).
        memory: per-rank bytes (zeros without ``memory``).
        makespan: ``max(loads)``.
        lower_bound: ``max(total / num_ranks, largest cost)``.
        proven_bound: :func:`dmuon.balance.assignment.makespan_lower_bound`, or the makespan
            when ``optimal``.
        method: ``"milp"`` when CBC's plan is returned (whenever it is at least as good as the
            heuristic's), else ``"greedy"``.
        optimal: the makespan is proven optimal (always False for the exposed time).
        solve_s: wall-clock seconds spent solving.
        detail: the algorithm: ``"lpt"``, ``"lpt+local_search"``, ``"multifit+local_search"``,
            ``"deadline_greedy+local_search"`` or ``"cbc"``; ``"+merge_groups"`` or
            ``"group_lpt+merge_groups"`` with a group cost; ``"; <candidate>"`` when the
            runtime plan is not the makespan plan.
        group_cost: step time of one publish (group, owner) pair.
        publish_pairs: distinct (group, owner) pairs (0 without ``groups``).
        milp_status: ``"optimal"``, ``"time limit"`` (CBC's incumbent), ``"not run: <why>"``,
            ``"failed: <why>..."`` (heuristic plan kept,
            :func:`dmuon.balance.milp.milp_fallback`) or ``"optimal (retried ...)"``.
        problem: ``"makespan"``, ``"exposed"`` or ``"overlap"`` (the runtime plan).
        exposed: exposed time ``E`` with ``deadlines``, else 0.
        exposed_bound: :func:`dmuon.balance.deadline.exposed_lower_bound`, else 0.
        candidate, makespan_plan_exposed, makespan_plan_makespan: ``"overlap"`` only: the
            winning candidate of :func:`_overlap`, and ``E`` and makespan of the makespan plan.
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


def _check_inputs(costs, num_ranks, *, memory, memory_cap, method, groups, classes, group_cost,
                  layout, units, deadlines, makespan_slack):
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
        for i, c in enumerate(seq or ()):
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
    if deadlines is None:
        return
    if len(units) != len(costs):
        raise ValueError(f"dmuon: solve got {len(units)} units for {len(costs)} costs; "
                         f"give one unit id per matrix")
    k = len(deadlines)
    bad = [u for u in units if not (isinstance(u, (int, np.integer)) and 0 <= u < k)]
    if bad:
        raise ValueError(f"dmuon: solve unit id {bad[0]!r} is not in 0..{k - 1} (one "
                         f"deadline per unit); number units 0..K-1 in forward order")
    d = [float(x) for x in deadlines]
    if any(not (x >= 0) for x in d) or any(b < a for a, b in zip(d, d[1:])):
        raise ValueError(f"dmuon: solve(deadlines={d[:8]}...) must be >= 0 and "
                         f"non-decreasing (forward starts in forward order); use "
                         f"deadlines_from_forward(forward_times)")
    if makespan_slack is None:
        given = [k for k, v in (("memory_cap", memory_cap is not None),
                                ("group_cost", group_cost != 0), ("layout", layout is not None))
                 if v]
        if given:
            raise ValueError(f"dmuon: solve(deadlines=...) (the exposed-time objective) takes "
                             f"no {given}; leave them out or drop deadlines")
    elif not float(makespan_slack) >= 0:
        raise ValueError(f"dmuon: solve(makespan_slack={makespan_slack!r}) must be >= 0 (a "
                         f"fraction of the makespan plan's makespan)")


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
        units: with ``deadlines``: unit (FSDP2 block) id per matrix, ``0..K-1`` in forward order.
        deadlines: forward start ``d_k`` per unit, unit of ``costs``
            (:func:`dmuon.balance.deadline.deadlines_from_forward`): minimize
            ``E + makespan_weight * makespan`` (or the runtime plan, with ``makespan_slack``).
            Without ``makespan_slack`` takes none of ``memory_cap``, ``group_cost``, ``layout``.
        memory: bytes each matrix costs its owner (fp32 master + momentum + gradient).
        memory_cap: bytes allowed per rank (needs ``memory``).
        groups: per-matrix group id (one layer = one group, increasing in forward order);
            with ``layout``, :func:`dmuon.balance.layout.apply_layout` spreads each group.
        classes: per-matrix class (the shape): interchangeable matrices that batch together.
            Default: equal ``(cost, memory)``.
        batch_overhead: per-class cost paid once per rank (and unit, with ``deadlines``) owning
            that class (:func:`dmuon.balance.cost.fit_batch_costs`); ``costs`` are then marginal.
        layout: ``(nodes, gpus_per_node)`` with ``nodes * gpus_per_node == num_ranks``.
        method: ``"greedy"`` (plain LPT; for the exposed time as ``"heuristic"``),
            ``"heuristic"`` (no CBC: the runtime's), ``"milp"`` (then CBC warm-started from the
            heuristic plan) or ``"auto"`` (``"milp"`` up to :data:`AUTO_MAX_INTEGER_VARS`,
            :data:`AUTO_MAX_GROUP_VARS` or :data:`AUTO_MAX_DEADLINE_VARS`, unless the heuristic
            plan meets the lower bound). The runtime plan's refinement never runs CBC.
        time_limit_s: CBC wall-clock limit, seconds; the local searches get part of it.
        group_cost: step time of one (group, owner) pair (broadcasts and reduce), unit of
            ``costs``: the objective becomes ``makespan + group_cost * pairs`` (needs ``groups``).
        makespan_weight: exposed time only: the makespan's weight beside ``E`` (0: ``E`` alone).
        makespan_slack: with ``deadlines``: the runtime plan, the least ``E`` among plans whose
            makespan is at most ``1 + makespan_slack`` (``>= 0``) times the makespan plan's.

    Returns:
        The :class:`Assignment`, the same on every run unless the MILP hits its time limit. A
        CBC failure is no error: the heuristic plan is returned with one warning naming the
        cause (:func:`dmuon.balance.milp.milp_fallback`).

    Raises:
        ValueError: on bad arguments (named in the message), or when ``memory_cap`` is
            infeasible (the message gives the smallest feasible cap) or only the MILP could
            meet it and it failed (the message gives the cause).
    """
    start = time.perf_counter()
    costs = [float(c) for c in costs]
    if deadlines is not None:
        units = [int(u) for u in (units if units is not None else [])]
    _check_inputs(costs, num_ranks, memory=memory, memory_cap=memory_cap, method=method,
                  groups=groups, classes=classes, group_cost=group_cost, layout=layout,
                  units=units, deadlines=deadlines, makespan_slack=makespan_slack)
    memory = None if memory is None else [float(m) for m in memory]
    if classes is None:
        classes = [(c, 0.0 if memory is None else memory[i]) for i, c in enumerate(costs)]
    if deadlines is not None:
        deadlines = [float(d) for d in deadlines]
        if makespan_slack is None:
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


def _skip_milp(method, n_vars, limit_name, limit):
    """Why CBC does not run (``"not run: ..."``), or None where ``method`` asks for it with
    ``n_vars`` integer variables (``"auto"``: up to ``limit``, the constant ``limit_name``)."""
    if method in ("greedy", "heuristic"):
        return f"not run: method={method!r}"
    if method == "auto" and n_vars > limit:
        return f"not run: {n_vars} integer variables > {limit_name}={limit}"
    return None


def _per_rank(owners, values, num_ranks):
    return (0.0,) * num_ranks if values is None else tuple(evaluate(owners, values, num_ranks))


def _solve_exposed(costs, num_ranks, start, *, units, deadlines, classes, batch_overhead, memory,
                   method, time_limit_s, weight):
    """The exposed-time objective: the greedy in unit order and its local search, then the MILP."""
    kw = dict(classes=classes, batch_overhead=batch_overhead)
    bound = dl.exposed_lower_bound(costs, units, deadlines, num_ranks, **kw)
    owners = greedy(costs, num_ranks, units=units, **kw)
    owners = dl.improve_exposed(owners, costs, units, deadlines, num_ranks, makespan_weight=weight,
                                time_limit_s=time_limit_s / 2, **kw)
    used, detail = "greedy", "deadline_greedy+local_search"
    best = dl.measure(owners, costs, units, deadlines, num_ranks, **kw)  # (exposed, loads)
    e0 = best[0]
    status = _skip_milp(method, len(set(zip(units, classes))) * num_ranks,
                        "AUTO_MAX_DEADLINE_VARS", AUTO_MAX_DEADLINE_VARS)
    if method == "auto" and e0 <= bound + 1e-12 * max(1.0, sum(costs)):
        status = "not run: the heuristic plan meets the lower bound"
    if status is None:
        res, status = milp_fallback(
            costs, num_ranks, warm_start=owners, fallback=detail,
            score=lambda o: f"exposed {e0:.6g}, bound {bound:.6g}", what="deadline",
            units=units, deadlines=deadlines, time_limit_s=time_limit_s, makespan_weight=weight,
            bound=bound, **kw)
        if res is not None:
            milp = dl.measure(res[0], costs, units, deadlines, num_ranks, **kw)
            if milp[0] + weight * milp[1].max() <= (e0 + weight * best[1].max()) * (1 + 1e-9) + 1e-12:
                owners, used, detail, best = res[0], "milp", "cbc", milp
    exposed, loads = best
    makespan = float(loads.max())
    return Assignment(
        owners=tuple(int(r) for r in owners), loads=tuple(float(x) for x in loads),
        memory=_per_rank(owners, memory, num_ranks), makespan=makespan,
        lower_bound=trivial_lower_bound(costs, num_ranks),
        proven_bound=min(makespan_lower_bound(costs, num_ranks), makespan), method=used,
        optimal=False, solve_s=time.perf_counter() - start, detail=detail, milp_status=status,
        problem="exposed", exposed=exposed, exposed_bound=bound)


def _overlap(result, costs, units, deadlines, classes, batch_overhead, memory, slack, time_limit_s,
             start):
    """The runtime's plan from the makespan plan ``result``: the least ``E`` (ties: smaller
    makespan) among candidates within ``1 + slack`` of its makespan (and, with a group cost,
    its publish pairs): ``"makespan"`` itself, ``"makespan+exposed_search"`` (it refined by
    :func:`dmuon.balance.deadline.improve_exposed` under those caps) and, without a group cost,
    ``"deadline"`` (the unit-order greedy, refined uncapped). Both searches are needed: the
    capped one stalls on Qwen2.5-7B at 8 ranks, the deadline plan alone costs Pi0 at 64 ranks
    16% more makespan.
    """
    num_ranks = len(result.loads)
    kw = dict(classes=classes, batch_overhead=batch_overhead or None)

    def measure(owners):
        return dl.measure(owners, costs, units, deadlines, num_ranks, **kw)  # (exposed, loads)

    base = [int(r) for r in result.owners]
    base_exposed, base_loads = measure(base)
    base_makespan = float(base_loads.max())
    # in the deadline model's terms (overheads per (rank, unit, class)): the base is allowed
    cap = base_makespan * (1 + float(slack))
    keep_pairs = result.group_cost > 0
    pair_cap = publish_pairs(base, units) if keep_pairs else None
    search = dict(deadlines=deadlines, num_ranks=num_ranks, **kw)
    owners_of = {"makespan": base}
    owners_of["makespan+exposed_search"] = dl.improve_exposed(
        list(base), costs, units, load_cap=cap, pair_cap=pair_cap,
        time_limit_s=time_limit_s / 2, **search)
    if not keep_pairs:  # the deadline plan spreads each unit over many owners: no pair cap holds
        owners_of["deadline"] = dl.improve_exposed(
            greedy(costs, num_ranks, units=units, **kw), costs, units,
            time_limit_s=time_limit_s / 2, **search)
    scored = {name: measure(owners) for name, owners in owners_of.items()}
    pairs = {name: publish_pairs(owners, units) for name, owners in owners_of.items()} if keep_pairs else {}
    allowed = [name for name, (_, loads) in scored.items() if float(loads.max()) <= cap * (1 + 1e-12)
               and (pair_cap is None or pairs[name] <= pair_cap)]
    # the least exposed time, ties: the smaller makespan; "makespan" is always allowed
    candidate = min(allowed, key=lambda name: (scored[name][0], float(scored[name][1].max())))
    owners = owners_of[candidate]
    exposed, loads = scored[candidate]
    moved = candidate != "makespan"
    return replace(
        result, owners=tuple(int(r) for r in owners), loads=tuple(float(x) for x in loads),
        makespan=float(loads.max()), memory=_per_rank(owners, memory, num_ranks),
        optimal=result.optimal and not moved,
        proven_bound=min(result.proven_bound, float(loads.max())),
        publish_pairs=pairs[candidate] if keep_pairs else result.publish_pairs,
        detail=f"{result.detail}; {candidate}" if moved else result.detail,
        solve_s=time.perf_counter() - start, problem="overlap", exposed=exposed,
        exposed_bound=float(dl.exposed_lower_bound(costs, units, deadlines, num_ranks, **kw)),
        candidate=candidate, makespan_plan_exposed=base_exposed,
        makespan_plan_makespan=base_makespan)


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
    lower = trivial_lower_bound(eff, num_ranks)
    bound = makespan_lower_bound(eff, num_ranks)
    owners = greedy(costs, num_ranks, memory=memory, memory_cap=memory_cap)
    used = "greedy"
    optimal = False
    status = _skip_milp(method, len(set(classes)) * num_ranks, "AUTO_MAX_INTEGER_VARS",
                        AUTO_MAX_INTEGER_VARS)
    want_milp = status is None
    status = status or "not run"
    heuristic = "lpt"
    if method != "greedy" and not batch_overhead:  # "greedy" is plain LPT
        packed = multifit(costs, num_ranks, memory=memory, memory_cap=memory_cap)
        if packed is not None and (owners is None or max(evaluate(packed, costs, num_ranks))
                                   < max(evaluate(owners, costs, num_ranks))):
            owners, heuristic = packed, "multifit"
        if owners is not None:
            heuristic += "+local_search"
            owners = improve(owners, costs, num_ranks, classes=classes, memory=memory,
                             memory_cap=memory_cap, time_limit_s=time_limit_s / 2)
    if owners is not None:
        loads = evaluate(owners, costs, num_ranks, **batching)
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
            m_loads = evaluate(m_owners, costs, num_ranks, **batching)
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
    if group_cost > 0:
        owners, used, optimal, heuristic, status = _place_groups(
            owners, heuristic, costs, num_ranks, groups=groups, group_cost=group_cost,
            classes=classes, batch_overhead=batch_overhead, memory=memory,
            memory_cap=memory_cap, method=method, time_limit_s=time_limit_s)
    pairs = 0 if groups is None else publish_pairs(owners, groups)
    if layout is not None and groups is not None:
        owners = apply_layout(owners, classes, groups, *layout)
    loads = evaluate(owners, costs, num_ranks, **batching)
    makespan = max(loads)
    # optimal where CBC proved it, or where both terms are at their minimum
    optimal = optimal or (makespan <= bound * (1 + 1e-12)
                          and (group_cost <= 0 or pairs == len(set(groups))))
    result = Assignment(
        owners=tuple(int(r) for r in owners), loads=tuple(loads),
        memory=_per_rank(owners, memory, num_ranks), makespan=makespan, lower_bound=lower,
        proven_bound=makespan if optimal else bound, method=used, optimal=optimal,
        detail=heuristic, group_cost=float(group_cost), publish_pairs=pairs,
        solve_s=time.perf_counter() - start, milp_status=status)
    logger.debug("dmuon: solve(%d matrices, %d ranks) -> %s makespan %.4g, bound %.4g",
                 n, num_ranks, used, makespan, result.proven_bound)
    return result


def _place_groups(owners, heuristic, costs, num_ranks, *, groups, group_cost, classes,
                  batch_overhead, memory, memory_cap, method, time_limit_s):
    """The better of ``owners`` and group-LPT, each refined by merge_groups, then the group MILP
    warm-started from it; ``(owners, method, optimal, detail, milp_status)``."""
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
    status = _skip_milp(method, len(set(zip(groups, classes))) * num_ranks, "AUTO_MAX_GROUP_VARS",
                        AUTO_MAX_GROUP_VARS)
    if status is None:
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
    """Raise ValueError when no plan keeps every rank within ``memory_cap`` bytes: the smallest
    feasible cap is the makespan with memory as cost (greedy's is feasible; below, the MILP).

    Raises:
        ValueError: naming the smallest feasible cap (exact when CBC proves it, else the best
            found and the proven lower bound).
    """
    if memory_cap >= max(evaluate(greedy(memory, num_ranks), memory, num_ranks)):
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
