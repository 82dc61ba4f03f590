"""Exposed time: the Newton-Schulz time the next forward waits for, and its local search.

With NS overlapped with the next forward (:mod:`dmuon.owners.overlap`), each owner runs its
jobs in the units' forward order, back to back from the start of forward 0, and publication
``k`` waits for unit ``k``'s jobs only. Model (``K`` units in forward order, ``D`` ranks):

* ``f_j``: forward time of unit ``j``; unit ``k``'s *deadline* ``d_k = f_0 + ... + f_(k-1)``.
* ``C[r, k]``: when rank ``r`` has finished its NS of units ``0..k``: the prefix sum of its
  per-unit loads, each with the batch overhead of every shape it owns in that unit.
* ``P_k = max_r C[r, k]`` over unit ``k``'s owners; forward ``k`` starts at
  ``S_k = max(S_(k-1) + f_(k-1), P_k)``.

By induction ``S_k - d_k = max_(j <= k) (P_j - d_j)^+``, so the step grows by the exposed time

    E = max(0, max_k (P_k - d_k)) = max(0, max_(r, k) (C[r, k] - d_k))

(a rank owning nothing of unit ``k`` adds nothing: its ``C[r, k]`` is an earlier unit's, with
an earlier deadline). Communication and SM contention are not in ``E``.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from dmuon.balance.assignment import class_overheads, completion_times

#: The makespan the runtime plan may add to the makespan plan's, as a fraction of it
#: (:func:`dmuon.balance.solve`'s ``makespan_slack``): below the FLOP model's error; with NS at
#: 15-30% of a VLA step, at most 0.6% of the step with ``overlap="off"``.
MAKESPAN_SLACK = 0.02


def deadlines_from_forward(forward: Sequence[float]) -> list[float]:
    """``d_k = forward[0] + ... + forward[k-1]`` from forward times per unit (forward order,
    ``>= 0``, unit of the costs): when each unit's forward starts."""
    out, t = [], 0.0
    for f in forward:
        out.append(t)
        t += float(f)
    return out


def measure(owners, costs, units, deadlines, num_ranks, *, classes=None,
            batch_overhead=None) -> tuple[float, np.ndarray]:
    """``(E, loads)`` of a plan: its exposed time and per-rank loads ``C[:, -1]``
    (``[num_ranks]`` float64), unit of ``costs``; arguments as :func:`dmuon.balance.solve`'s.
    """
    c = completion_times(owners, [float(x) for x in costs], units, num_ranks, len(deadlines),
                         classes=classes, batch_overhead=batch_overhead)
    return max(0.0, float((c - np.asarray(deadlines, dtype=float)[None, :]).max())), c[:, -1]


def exposed_lower_bound(costs: Sequence[float], units: Sequence[int], deadlines: Sequence[float],
                        num_ranks: int, *, classes=None, batch_overhead=None) -> float:
    """A lower bound on ``E``: each matrix finishes no earlier than ``c_i + f_i``, and units
    ``0..k`` hold work ``W_k`` that ``D`` ranks finish no earlier than ``W_k / D``."""
    over = class_overheads(classes, batch_overhead, len(costs))
    best = 0.0
    work = np.zeros(len(deadlines))
    for i, (c, k) in enumerate(zip(costs, units)):
        best = max(best, float(c) + over[i] - float(deadlines[k]))
        work[k] += float(c)
    prefix = np.cumsum(work)
    for k, d in enumerate(deadlines):
        best = max(best, prefix[k] / num_ranks - float(d))
    return best


_NEG = -np.inf


class _State:
    """Owners, per-(rank, unit, class) counts and per-(rank, unit) loads ``per``."""

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
        """Change in :attr:`pairs` when every ``(i, rank)`` of ``moves`` is applied at once."""
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


def improve_exposed(owners, costs, units, deadlines, num_ranks, *, classes, batch_overhead=None,
                    makespan_weight=1e-3, time_limit_s=5.0, load_cap=None,
                    pair_cap=None) -> list[int]:
    """Owners whose ``E + makespan_weight * makespan`` is at most that of ``owners``.

    Each round applies the best strict improvement among the moves of a matrix off the rank
    that sets ``E`` or the makespan (all targets at once, through per-rank prefix/suffix maxima
    of ``C[r, k] - d_k``), or, when no move helps, among the swaps with another rank.

    Args:
        load_cap: no step takes a rank's load (overheads included) above this (None: no cap);
            ranks above it may only shed load.
        pair_cap: no step takes the distinct (rank, unit) publish pairs above this.
    """
    over = class_overheads(classes, batch_overhead, len(costs))
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
    """The best swap of one of ``a``'s matrices with another rank's, until ``deadline``
    (``time.perf_counter()``)."""
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
