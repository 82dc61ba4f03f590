"""Owner plans that know deadlines: minimize the Newton-Schulz time the next forward waits for.

With NS overlapped with the next forward (``Muon(overlap="forward"|"backward")``), what the
step pays is not the NS makespan but the part of it the forward cannot hide. What the code
enforces (:mod:`dmuon.owners.overlap`, :meth:`dmuon.hooks.unit.Publisher.issue`):

* ``opt.step()`` schedules one job per publish group (a unit's matrices on one owner) and
  returns without waiting for any. Each owner runs its jobs one after the other, in the
  units' forward order (the order the first forward ran them,
  :meth:`~dmuon.hooks.unit.Publisher.adopt_forward_order`), on one worker thread (CPU) or
  one side stream (CUDA), from when ``step()`` returns: time 0 here, which is taken as the
  start of forward 0 (whatever runs in between, e.g. data loading, only adds slack).
* The publication of unit ``k`` waits for unit ``k``'s jobs only. A prefetched publication
  whose job is not done is held back, not waited for, so forward ``k`` never waits for a later
  unit's NS.

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

:func:`dmuon.balance.solve` with ``deadlines`` minimizes ``E`` (then, with weight
``makespan_weight``, the makespan, which the overlapped NS still costs in contention): the greedy
below in deadline order (each unit's matrices by decreasing cost, each to the rank whose NS of
everything so far ends first; ties to the less loaded, then lower rank) refined by a move/swap
local search aimed at the critical (rank, unit) (from the rank that sets ``E`` and the one that
sets the makespan, try moving each of its matrices to every other rank, all targets at once
with per-rank prefix/suffix maxima of ``C[r, k] - d_k``, and, when no move helps, swapping it
with a matrix of another unit or class elsewhere; take the best strict improvement of ``E + w
* makespan``), then the MILP of :mod:`dmuon.balance.milp` warm-started from it.

Communication (the publication's broadcast) is not in ``E``: it is the same for every plan
up to the first unit's, and the simulator (``bench/simulate.py``) adds it. Nor is contention:
on CUDA the side stream shares the SMs with the forward.

:func:`refine_for_overlap` is the runtime's plan (``dedicate_params`` without a plan file):
the least ``E`` among plans within :data:`MAKESPAN_SLACK` of the makespan plan's makespan.
"""

from __future__ import annotations

import time
from typing import Hashable, Mapping, Sequence

import numpy as np

from dmuon.balance.grouping import publish_pairs

#: The makespan the runtime plan may add to the makespan plan's, as a fraction of it
#: (:func:`refine_for_overlap`).
MAKESPAN_SLACK = 0.02

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
        raise ValueError(f"dmuon: solve(num_ranks={num_ranks!r}) must be a positive int")
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
    if any(not (float(c) >= 0) or float(c) == float("inf") for c in costs):
        raise ValueError("dmuon: solve costs must be finite and >= 0")


_NEG = -np.inf


class _State:
    """Owners plus per-(rank, unit) counts of each class and the per-(rank, unit) loads."""

    def __init__(self, owners, costs, units, deadlines, num_ranks, classes, over):
        self.owners = list(owners)
        self.costs, self.units, self.classes, self.over = costs, units, classes, over
        self.d = np.asarray(deadlines, dtype=float)
        self.D, self.K = num_ranks, len(deadlines)
        self.count: dict[tuple, int] = {}
        self.in_unit: dict[tuple, int] = {}  # matrices per (rank, unit): its publish pairs
        self.per = np.zeros((self.D, self.K))
        for i, r in enumerate(self.owners):
            self._add(i, r, +1)

    def _add(self, i, r, sign):
        key = (r, self.units[i], self.classes[i])
        n = self.count.get(key, 0)
        pair = (r, self.units[i])
        self.in_unit[pair] = self.in_unit.get(pair, 0) + sign
        if sign > 0:
            self.per[r, self.units[i]] += self.costs[i] + (self.over[i] if n == 0 else 0.0)
            self.count[key] = n + 1
        else:
            self.per[r, self.units[i]] -= self.costs[i] + (self.over[i] if n == 1 else 0.0)
            self.count[key] = n - 1

    @property
    def pairs(self) -> int:
        """Distinct (rank, unit) pairs: the publish (group, owner) pairs of the plan."""
        return sum(1 for n in self.in_unit.values() if n > 0)

    def pair_delta(self, moves) -> int:
        """Change in :attr:`pairs` when the matrices ``i`` of ``moves`` ((i, rank) pairs, each
        from its current owner) move at once."""
        change: dict[tuple, int] = {}
        for i, r in moves:
            k = self.units[i]
            change[(self.owners[i], k)] = change.get((self.owners[i], k), 0) - 1
            change[(r, k)] = change.get((r, k), 0) + 1
        delta = 0
        for pair, d in change.items():
            n = self.in_unit.get(pair, 0)
            delta += (n + d > 0) - (n > 0)
        return delta

    def move(self, i, r):
        self._add(i, self.owners[i], -1)
        self._add(i, r, +1)
        self.owners[i] = r

    def row_with(self, r, remove=(), add=()):
        """``(max_k C[r, k] - d_k, load)`` of rank ``r`` after removing/adding matrices."""
        per = self.per[r].copy()
        count = {}
        for i in remove:
            key = (self.units[i], self.classes[i])
            count[key] = count.get(key, self.count.get((r,) + key, 0)) - 1
            per[self.units[i]] -= self.costs[i] + (self.over[i] if count[key] == 0 else 0.0)
        for i in add:
            key = (self.units[i], self.classes[i])
            n = count.get(key, self.count.get((r,) + key, 0))
            per[self.units[i]] += self.costs[i] + (self.over[i] if n == 0 else 0.0)
            count[key] = n + 1
        cum = np.cumsum(per)
        return float((cum - self.d).max()), float(cum[-1])


def deadline_greedy(costs, units, num_ranks, *, classes, batch_overhead=None) -> list[int]:
    """The greedy of the module docstring; owners per matrix."""
    over = [float((batch_overhead or {}).get(c, 0.0)) for c in classes]
    load = [0.0] * num_ranks
    held: set[tuple] = set()
    owners = [0] * len(costs)
    order = sorted(range(len(costs)), key=lambda i: (units[i], -(costs[i] + over[i]), i))
    for i in order:
        def finish(r):
            extra = over[i] if (r, units[i], classes[i]) not in held else 0.0
            return load[r] + costs[i] + extra
        r = min(range(num_ranks), key=lambda q: (finish(q), load[q], q))
        load[r] = finish(r)
        held.add((r, units[i], classes[i]))
        owners[i] = r
    return owners


def improve_exposed(owners, costs, units, deadlines, num_ranks, *, classes, batch_overhead=None,
                    makespan_weight=1e-3, time_limit_s=5.0, load_cap=None,
                    pair_cap=None) -> list[int]:
    """The local search of the module docstring; returns improved owners (never worse).

    Args:
        load_cap: no move or swap takes a rank's load (batch overheads included) above this,
            in the unit of ``costs`` (``None``: no cap); owners that start above it may only
            shed load.
        pair_cap: no move or swap takes the distinct (rank, unit) pairs (publish pairs) above
            this (``None``: no cap).
    """
    over = [float((batch_overhead or {}).get(c, 0.0)) for c in classes]
    st = _State(owners, costs, units, deadlines, num_ranks, classes, over)
    st.load_cap = np.inf if load_cap is None else float(load_cap) * (1 + 1e-12)
    st.pair_cap = pair_cap
    w = float(makespan_weight)
    deadline = time.perf_counter() + time_limit_s
    eps = 1e-12 * max(1.0, sum(costs))
    while time.perf_counter() < deadline and num_ranks > 1:
        cum = np.cumsum(st.per, axis=1)
        slack = cum - st.d[None, :]
        rowmax, loads = slack.max(axis=1), cum[:, -1]
        score = max(0.0, rowmax.max()) + w * loads.max()
        st.npairs = st.pairs if st.pair_cap is not None else 0
        # prefix max over k' < k and suffix max over k' >= k, per rank
        pre = np.concatenate([np.full((num_ranks, 1), _NEG),
                              np.maximum.accumulate(slack, axis=1)[:, :-1]], axis=1)
        suf = np.maximum.accumulate(slack[:, ::-1], axis=1)[:, ::-1]
        best = (score - eps, None)
        for a in dict.fromkeys((int(rowmax.argmax()), int(loads.argmax()))):
            best = _best_move(st, a, rowmax, loads, pre, suf, w, best)
        if best[1] is None:
            for a in dict.fromkeys((int(rowmax.argmax()), int(loads.argmax()))):
                best = _best_swap(st, a, rowmax, loads, w, best, deadline)
        if best[1] is None:
            break
        for i, r in best[1]:
            st.move(i, r)
    return st.owners


def _others(values, a):
    """Vector over ranks ``b``: the max of ``values`` over the ranks other than ``a`` and ``b``."""
    v = values.copy()
    v[a] = _NEG
    order = np.argsort(-v)
    top, second = v[order[0]], (v[order[1]] if len(v) > 1 else _NEG)
    out = np.full(len(v), top)
    out[order[0]] = second
    return out


def _best_move(st, a, rowmax, loads, pre, suf, w, best):
    seen = set()
    for i, r in enumerate(st.owners):
        if r != a or (st.units[i], st.classes[i]) in seen:
            continue
        seen.add((st.units[i], st.classes[i]))
        k = st.units[i]
        row_a, load_a = st.row_with(a, remove=(i,))
        fresh = np.array([st.count.get((b, k, st.classes[i]), 0) == 0 for b in range(st.D)])
        delta = st.costs[i] + st.over[i] * fresh
        row_b = np.maximum(pre[:, k], suf[:, k] + delta)
        e = np.maximum.reduce([_others(rowmax, a), np.full(st.D, row_a), row_b,
                               np.zeros(st.D)])
        m = np.maximum.reduce([_others(loads, a), np.full(st.D, load_a), loads + delta])
        total = e + w * m
        total[a] = np.inf
        total[loads + delta > st.load_cap] = np.inf
        if st.pair_cap is not None:
            gain = np.array([st.in_unit.get((b, k), 0) == 0 for b in range(st.D)])
            lose = st.in_unit.get((a, k), 0) == 1
            total[st.npairs + gain - lose > st.pair_cap] = np.inf
        b = int(total.argmin())
        if total[b] < best[0]:
            best = (float(total[b]), [(i, b)])
    return best


def _best_swap(st, a, rowmax, loads, w, best, deadline=np.inf):
    """The best swap of one of ``a``'s matrices with another rank's; the search stops at
    ``deadline`` (``time.perf_counter()``), each candidate costing two prefix sums (Pi0 on 8
    ranks: ~0.3 s for all of them)."""
    mine = {}
    for i, r in enumerate(st.owners):
        if r == a:
            mine.setdefault((st.units[i], st.classes[i]), i)
    theirs = {}
    for j, r in enumerate(st.owners):
        if r != a:
            theirs.setdefault((r, st.units[j], st.classes[j]), j)
    for key_i, i in mine.items():
        if time.perf_counter() > deadline:
            break
        for (b, *key_j), j in theirs.items():
            if tuple(key_j) == key_i:
                continue
            row_a, load_a = st.row_with(a, remove=(i,), add=(j,))
            row_b, load_b = st.row_with(b, remove=(j,), add=(i,))
            if max(load_a, load_b) > st.load_cap:
                continue
            if st.pair_cap is not None and st.npairs + st.pair_delta(((i, b), (j, a))) > st.pair_cap:
                continue
            keep = np.ones(st.D, dtype=bool)
            keep[[a, b]] = False
            e_rest = rowmax[keep].max() if keep.any() else _NEG
            m_rest = loads[keep].max() if keep.any() else _NEG
            total = max(0.0, e_rest, row_a, row_b) + w * max(m_rest, load_a, load_b)
            if total < best[0]:
                best = (total, [(i, b), (j, a)])
    return best


def refine_for_overlap(
    makespan_owners: Sequence[int],
    costs: Sequence[float],
    num_ranks: int,
    *,
    units: Sequence[int],
    deadlines: Sequence[float],
    classes: Sequence[Hashable],
    batch_overhead: Mapping[Hashable, float] | None = None,
    keep_pairs: bool = False,
    makespan_slack: float = MAKESPAN_SLACK,
    time_limit_s: float = 0.5,
) -> tuple[list[int], str]:
    """The runtime's plan: among the candidates below whose makespan is at most ``1 +
    makespan_slack`` times the makespan plan's (and, with ``keep_pairs``, whose publish (unit,
    owner) pairs are no more than its), the one with the least ``E`` (ties: the smaller
    makespan). The makespan plan is a candidate itself, so the result's ``E`` never exceeds
    its ``E``, nor its makespan the slack.

    Candidates: ``"makespan"``, the makespan plan; ``"makespan+exposed_search"``, it refined by
    :func:`improve_exposed` with every rank's load capped at the allowed makespan (and the
    pairs capped); without ``keep_pairs``, ``"deadline"``: :func:`deadline_greedy` refined by
    :func:`improve_exposed`, which ignores the makespan. Both searches are needed: on the FLOP
    model the capped refinement gets stuck far from the bound on Qwen2.5-7B at 8 ranks, while
    the deadline plan alone costs Pi0 at 64 ranks 16% more makespan. The slack of 2%: the
    deadline plan's extra makespan was 0.1-1.3% on Pi0 and Qwen2.5-7B, below the FLOP model's
    error; with NS at 15-30% of a VLA step it is at most 0.6% of the step with
    ``overlap="off"``.

    Args:
        makespan_owners: the makespan plan, owner rank per matrix.
        costs, num_ranks, units, deadlines, classes, batch_overhead: as :func:`exposed_time`.
        keep_pairs: cap the publish pairs at the makespan plan's (it minimized ``makespan +
            group_cost * pairs``).
        makespan_slack: the fraction (``>= 0``) of the makespan plan's makespan a candidate may
            add.
        time_limit_s: wall-clock seconds the two searches share, > 0.

    Returns:
        ``(owners, candidate)``.

    Raises:
        ValueError: an owner per matrix missing, or a negative ``makespan_slack``.
    """
    if len(makespan_owners) != len(costs):
        raise ValueError(f"dmuon: refine_for_overlap got {len(makespan_owners)} owners for "
                         f"{len(costs)} costs; give the makespan plan's owner of every matrix")
    if not float(makespan_slack) >= 0:
        raise ValueError(f"dmuon: refine_for_overlap(makespan_slack={makespan_slack!r}) must be "
                         f">= 0 (a fraction of the makespan plan's makespan)")
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
    return owners_of[best], best
