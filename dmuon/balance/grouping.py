"""Publish-group-aware placement: trade Newton-Schulz balance against collective count.

dmuon publishes and reduces one flat buffer per *(group, owner)* pair (a group is an FSDP2
block), so the objective is

    minimize    makespan + group_cost * pairs,      pairs = |{(g, owner(i)) : i in g}|

with ``group_cost`` one pair's step time (:func:`dmuon.balance.cost.default_group_cost`).
"""

from __future__ import annotations

import logging
import time
from typing import Hashable, Mapping, Sequence

from dmuon.balance.assignment import evaluate, greedy

logger = logging.getLogger(__name__)


def publish_pairs(owners: Sequence[int], groups: Sequence[int]) -> int:
    """Number of distinct ``(group, owner)`` pairs: one publication (and reduce) each."""
    return len({(g, r) for g, r in zip(groups, owners)})


def objective(
    owners: Sequence[int],
    costs: Sequence[float],
    num_ranks: int,
    *,
    groups: Sequence[int],
    group_cost: float,
    classes: Sequence[Hashable] | None = None,
    batch_overhead: Mapping[Hashable, float] | None = None,
) -> float:
    """``makespan + group_cost * pairs`` of a plan (batching model of :func:`evaluate`)."""
    loads = evaluate(owners, costs, num_ranks, classes=classes, batch_overhead=batch_overhead)
    return max(loads) + float(group_cost) * publish_pairs(owners, groups)


def group_lpt(
    costs: Sequence[float],
    num_ranks: int,
    *,
    groups: Sequence[int],
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
) -> tuple[int, ...] | None:
    """LPT over whole groups: owner per matrix, or None when a group fits no rank under the cap."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    idx = list(members.values())  # groups in first-appearance order: LPT's tie-break
    size = None if memory is None else [sum(float(memory[i]) for i in m) for m in idx]
    placed = greedy([sum(float(costs[i]) for i in m) for m in idx], num_ranks, memory=size,
                    memory_cap=memory_cap)
    if placed is None:
        return None
    owners = [0] * len(costs)
    for m, r in zip(idx, placed):
        for i in m:
            owners[i] = r
    return tuple(owners)


def merge_groups(
    owners: Sequence[int],
    costs: Sequence[float],
    num_ranks: int,
    *,
    groups: Sequence[int],
    group_cost: float,
    classes: Sequence[Hashable] | None = None,
    batch_overhead: Mapping[Hashable, float] | None = None,
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
    time_limit_s: float = 5.0,
) -> tuple[int, ...]:
    """Owners whose :func:`objective` is at most that of ``owners``: each pass moves the part
    (a group's matrices on one rank) to another owner of its group that lowers the objective
    most (ties: first in ascending group, part, target), until none helps or time is up.
    """
    owners = list(owners)
    cap = float("inf") if memory_cap is None else float(memory_cap)
    deadline = time.perf_counter() + time_limit_s
    cls = list(classes) if classes is not None else list(range(len(owners)))
    overhead = {s: float((batch_overhead or {}).get(s, 0.0)) for s in set(cls)}
    held: dict[tuple[int, Hashable], int] = {}  # (rank, class) -> matrices of it
    for i, r in enumerate(owners):
        held[r, cls[i]] = held.get((r, cls[i]), 0) + 1
    loads = evaluate(owners, costs, num_ranks, classes=cls, batch_overhead=overhead)
    used = [0.0] * num_ranks
    if memory is not None:
        for i, r in enumerate(owners):
            used[r] += float(memory[i])
    pairs = publish_pairs(owners, groups)
    best = max(loads) + group_cost * pairs

    def moved_loads(idx: list[int], src: int, dst: int) -> list[float]:
        new = list(loads)
        count: dict[Hashable, int] = {}
        for i in idx:
            new[src] -= float(costs[i])
            new[dst] += float(costs[i])
            count[cls[i]] = count.get(cls[i], 0) + 1
        for s, k in count.items():
            if held[src, s] == k:  # the last of this class leaves src: its batch goes too
                new[src] -= overhead[s]
            if held.get((dst, s), 0) == 0:
                new[dst] += overhead[s]
        return new

    moves = 0
    while time.perf_counter() < deadline:
        parts: dict[tuple[int, int], list[int]] = {}
        for i, (g, r) in enumerate(zip(groups, owners)):
            parts.setdefault((g, r), []).append(i)
        owners_of: dict[int, list[int]] = {}
        for g, r in sorted(parts):
            owners_of.setdefault(g, []).append(r)
        chosen = None
        for g, ranks in owners_of.items():
            for src in ranks if len(ranks) > 1 else ():
                idx = parts[g, src]
                need = sum(float(memory[i]) for i in idx) if memory is not None else 0.0
                for dst in ranks:
                    if dst == src or used[dst] + need > cap:
                        continue
                    new = moved_loads(idx, src, dst)
                    value = max(new) + group_cost * (pairs - 1)
                    if value < best - 1e-12 * abs(best) and (chosen is None or value < chosen[0]):
                        chosen = (value, new, idx, src, dst, need)
        if chosen is None:
            break
        best, loads, idx, src, dst, need = chosen
        for i in idx:
            owners[i] = dst
            held[src, cls[i]] -= 1
            held[dst, cls[i]] = held.get((dst, cls[i]), 0) + 1
        used[src] -= need
        used[dst] += need
        pairs -= 1
        moves += 1
    logger.debug("dmuon: merge_groups made %d moves, objective %.4g", moves, best)
    return tuple(owners)
