"""The deadline heuristic: a greedy in forward (deadline) order and a move/swap local search on
the exposed time (:mod:`dmuon.balance.deadline` defines ``C[r, k]``, ``d_k`` and ``E``).

Greedy: units in forward order; each unit's matrices by decreasing cost, each to the rank whose
NS of everything so far ends first (its running load plus this matrix, batch overhead included),
ties to the less loaded, then lower rank. Unit 0, due at once, is spread first; later units fill
the ranks that their own deadline leaves time on.

Local search: from the rank that sets ``E`` (and the one that sets the makespan), try moving each
of its matrices to every other rank (all targets at once, with per-rank prefix/suffix maxima of
``C[r, k] - d_k``) and, when no move helps, swapping it with a matrix of another unit or class
elsewhere; take the best strict improvement of ``E + w * makespan``; stop when none is left or
the time limit strikes.
"""

from __future__ import annotations

import time

import numpy as np

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
