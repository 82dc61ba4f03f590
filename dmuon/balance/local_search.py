"""Makespan local search (the 2-exchange neighbourhood, Finn & Horowitz 1979) and MULTIFIT."""

from __future__ import annotations

import logging
import time
from typing import Hashable, Sequence

logger = logging.getLogger(__name__)


def improve(
    owners: Sequence[int],
    costs: Sequence[float],
    num_ranks: int,
    *,
    classes: Sequence[Hashable],
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
    time_limit_s: float = 5.0,
) -> tuple[int, ...]:
    """A plan whose makespan is at most that of ``owners``, owner per matrix in input order.

    Repeatedly takes the most loaded rank ``a`` (lowest index among ties) and applies the first
    step, scanning ranks by index and classes by cost, that lowers its load without raising
    another rank to it: move ``c`` to ``b`` when ``load_b + c < load_a``, or swap ``c_a > c_b``
    with ``b`` when ``load_b - c_b + c_a < load_a``.

    Args:
        owners: initial owner per matrix.
        costs, memory: per-matrix cost and bytes (or None), equal within a class.
        num_ranks: number of ranks.
        classes: per-matrix class (interchangeable matrices share one).
        memory_cap: bytes per rank that no move may exceed, or None.
        time_limit_s: wall-clock seconds after which the current plan is returned.
    """
    deadline = time.perf_counter() + time_limit_s
    first = {s: float(costs[i]) for i, s in reversed(list(enumerate(classes)))}
    keys = sorted(first, key=lambda s: (-first[s], repr(s)))
    kid = {s: k for k, s in enumerate(keys)}
    cost = [0.0] * len(keys)
    mem = [0.0] * len(keys)
    for i, s in enumerate(classes):
        cost[kid[s]] = float(costs[i])
        mem[kid[s]] = 0.0 if memory is None else float(memory[i])
    cap = float("inf") if memory_cap is None else float(memory_cap)
    counts = [[0] * len(keys) for _ in range(num_ranks)]
    for i, r in enumerate(owners):
        counts[r][kid[classes[i]]] += 1
    load = [sum(n * c for n, c in zip(row, cost)) for row in counts]
    used = [sum(n * m for n, m in zip(row, mem)) for row in counts]
    steps = 0
    while time.perf_counter() < deadline:
        a = max(range(num_ranks), key=lambda r: (load[r], -r))
        top = load[a]
        step = _find_step(a, top, counts, load, used, cost, mem, cap, num_ranks)
        if step is None:
            break
        b, ka, kb = step
        counts[a][ka] -= 1
        counts[b][ka] += 1
        delta = cost[ka] - (cost[kb] if kb is not None else 0.0)
        dmem = mem[ka] - (mem[kb] if kb is not None else 0.0)
        if kb is not None:
            counts[b][kb] -= 1
            counts[a][kb] += 1
        load[a] -= delta
        load[b] += delta
        used[a] -= dmem
        used[b] += dmem
        steps += 1
    logger.debug("dmuon: local search made %d moves", steps)
    # Rebuild per-matrix owners: class members in input order fill ranks in index order.
    out = [0] * len(owners)
    members: dict[int, list[int]] = {}
    for i, s in enumerate(classes):
        members.setdefault(kid[s], []).append(i)
    for k, idx in members.items():
        it = iter(idx)
        for r in range(num_ranks):
            for _ in range(counts[r][k]):
                out[next(it)] = r
    return tuple(out)


def _find_step(a, top, counts, load, used, cost, mem, cap, num_ranks):
    """First improving (rank b, class moved a->b, class moved b->a or None) in scan order."""
    mine = [k for k, n in enumerate(counts[a]) if n]
    eps = 1e-12 * top
    for b in range(num_ranks):
        if b == a:
            continue
        for ka in mine:
            if load[b] + cost[ka] < top - eps and used[b] + mem[ka] <= cap:
                return b, ka, None
        for ka in mine:
            for kb, nb in enumerate(counts[b]):
                if not nb or cost[kb] >= cost[ka]:
                    continue
                if (load[b] - cost[kb] + cost[ka] < top - eps
                        and used[b] - mem[kb] + mem[ka] <= cap
                        and used[a] - mem[ka] + mem[kb] <= cap):
                    return b, ka, kb
    return None


def multifit(
    costs: Sequence[float],
    num_ranks: int,
    *,
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
    iterations: int = 24,
) -> tuple[int, ...] | None:
    """MULTIFIT (Coffman, Garey & Johnson 1978): binary-search a capacity ``T`` and pack with
    first-fit decreasing (equal costs in input order) into ``num_ranks`` bins of capacity ``T``.

    Returns:
        Owner per matrix at the smallest feasible ``T`` found, or None when no packing was
        found (e.g. under a tight memory cap).
    """
    order = sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i))
    total = sum(float(c) for c in costs)
    lo = max(total / num_ranks, max(float(c) for c in costs))
    hi = max(2.0 * total / num_ranks, max(float(c) for c in costs)) * 1.0000001
    cap = float("inf") if memory_cap is None else float(memory_cap)
    best = None
    for _ in range(iterations):
        t = (lo + hi) / 2
        packed = _ffd(order, costs, memory, num_ranks, t, cap)
        if packed is None:
            lo = t
        else:
            best, hi = packed, t
    if best is None:
        best = _ffd(order, costs, memory, num_ranks, hi, cap)
    return best


def _ffd(order, costs, memory, num_ranks, capacity, mem_cap):
    load = [0.0] * num_ranks
    used = [0.0] * num_ranks
    owners = [0] * len(costs)
    for i in order:
        c = float(costs[i])
        m = 0.0 if memory is None else float(memory[i])
        for r in range(num_ranks):
            if load[r] + c <= capacity and used[r] + m <= mem_cap:
                load[r] += c
                used[r] += m
                owners[i] = r
                break
        else:
            return None
    return tuple(owners)
