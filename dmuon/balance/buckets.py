"""Owners for the DDP-style path (``replicas="keep"``, :mod:`dmuon.hooks.keep`): size-capped
buckets in backward order as DDP's reducer cuts them (Li et al., VLDB 2020), one owner each.

A bucket's owner pays its Newton-Schulz time and sends its bytes, so a matrix's load is
``ns / sum(ns) + nbytes / sum(nbytes)``. The buckets are the contiguous partition into at least
``world_size`` buckets minimizing the largest load (linear partition by bisection, Skiena, "The
Algorithm Design Manual", 8.5); they go to owners by LPT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dmuon.balance.assignment import greedy


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketAssignment:
    """Result of :func:`assign_buckets`.

    Attributes:
        bucket: bucket index per matrix, model order; bucket 0 is the end of the model.
        owner_of_bucket: owner rank per bucket.
        cap_bytes: the user's cap the buckets were cut with, bytes.
        loads: per-rank combined load (dimensionless, sums to 2).
        ns_share, bytes_share: per-rank shares of the NS cost and of the bytes (each sums to 1).
    """

    bucket: tuple[int, ...]
    owner_of_bucket: tuple[int, ...]
    cap_bytes: int
    loads: tuple[float, ...]
    ns_share: tuple[float, ...]
    bytes_share: tuple[float, ...]


def cut_buckets(nbytes: Sequence[int], cap_bytes: int) -> list[int]:
    """Bucket index per matrix (``nbytes``: gradient bytes, model order): walking backward, a
    bucket closes once it holds ``cap_bytes`` or more, as DDP's reducer does.

    Raises:
        ValueError: if ``cap_bytes <= 0``.
    """
    if cap_bytes <= 0:
        raise ValueError(f"dmuon: bucket cap must be > 0 bytes, got {cap_bytes}")
    bucket = [0] * len(nbytes)
    index, size = 0, 0
    for i in reversed(range(len(nbytes))):
        if size >= cap_bytes:
            index, size = index + 1, 0
        bucket[i] = index
        size += nbytes[i]
    return bucket


def partition_buckets(loads: Sequence[float], nbytes: Sequence[int], parts: int,
                      cap_bytes: int) -> list[int]:
    """Bucket index per matrix (model order; 0 is the end of the model): ``parts`` contiguous
    buckets (more if the cap forces them) minimizing the largest load.

    Walking backward, a bucket closes before a matrix that would lift its load over a
    threshold, or once it holds ``cap_bytes``; the smallest threshold needing at most ``parts``
    buckets is found by bisection. A shortfall is made up by splitting the heaviest bucket.
    ``loads`` (>= 0, any unit) and ``nbytes`` are per matrix, model order.
    """
    n = len(loads)

    def cut(threshold: float) -> list[int]:
        bucket, index, load, size = [0] * n, 0, 0.0, 0
        for i in reversed(range(n)):
            if size > 0 and (size >= cap_bytes or load + loads[i] > threshold):
                index, load, size = index + 1, 0.0, 0
            bucket[i] = index
            load += loads[i]
            size += nbytes[i]
        return bucket

    def count(bucket: list[int]) -> int:
        return (max(bucket) + 1) if bucket else 0

    low, high = max(loads, default=0.0), float(sum(loads))
    parts = max(parts, count(cut(high)))  # the cap alone may need more buckets
    for _ in range(100):  # bisection on the largest bucket load
        if high - low <= 1e-12 * max(high, 1.0):
            break
        mid = (low + high) / 2
        if count(cut(mid)) <= parts:
            high = mid
        else:
            low = mid
    bucket = cut(high)
    while count(bucket) < min(parts, n):  # split the heaviest bucket of 2+ matrices in two
        members: dict[int, list[int]] = {}
        for i, b in enumerate(bucket):
            members.setdefault(b, []).append(i)
        b = max((b for b, m in members.items() if len(m) > 1),
                key=lambda b: sum(loads[i] for i in members[b]))
        first = members[b][0]
        half, acc, split = sum(loads[i] for i in members[b]) / 2, 0.0, members[b][-1]
        for i in reversed(members[b][1:]):  # the later matrices stay in bucket b
            acc += loads[i]
            if acc >= half:
                split = i
                break
        bucket = [x + 1 if x > b or (x == b and i < split) else x for i, x in enumerate(bucket)]
        assert bucket[first] == b + 1
    return bucket


def assign_buckets(ns_costs: Sequence[float], nbytes: Sequence[int], world_size: int,
                   cap_bytes: int) -> BucketAssignment:
    """Cut the matrices into load-balanced buckets and give each the least loaded owner (LPT).

    Args:
        ns_costs, nbytes: NS cost (any unit) and gradient bytes per matrix, model order.
        world_size: ranks to spread owners over (>= 1).
        cap_bytes: the user's bucket cap in bytes.

    Raises:
        ValueError: on mismatched lengths, ``world_size < 1`` or ``cap_bytes <= 0``
            (:func:`cut_buckets`).
    """
    if len(ns_costs) != len(nbytes):
        raise ValueError(f"dmuon: {len(ns_costs)} costs for {len(nbytes)} matrices")
    if world_size < 1:
        raise ValueError(f"dmuon: world_size must be >= 1, got {world_size}")
    total_bytes = sum(nbytes)
    ns_total, bytes_total = float(sum(ns_costs)) or 1.0, float(total_bytes) or 1.0
    combined = [float(c) / ns_total + n / bytes_total for c, n in zip(ns_costs, nbytes)]
    by_cap = cut_buckets(nbytes, int(cap_bytes))  # DDP's rule alone: how many buckets the cap makes
    parts = max(world_size, (max(by_cap) + 1) if by_cap else 0)
    bucket = partition_buckets(combined, nbytes, parts, int(cap_bytes))
    n_buckets = (max(bucket) + 1) if bucket else 0
    ns_b, bytes_b, load_b = [0.0] * n_buckets, [0.0] * n_buckets, [0.0] * n_buckets
    for b, c, n, load in zip(bucket, ns_costs, nbytes, combined):
        ns_b[b] += float(c)
        bytes_b[b] += float(n)
        load_b[b] += load
    owner = greedy(load_b, world_size)
    ns_share, bytes_share, loads = [0.0] * world_size, [0.0] * world_size, [0.0] * world_size
    for b in range(n_buckets):
        ns_share[owner[b]] += ns_b[b] / ns_total
        bytes_share[owner[b]] += bytes_b[b] / bytes_total
        loads[owner[b]] += load_b[b]
    return BucketAssignment(bucket=tuple(bucket), owner_of_bucket=tuple(owner),
                            cap_bytes=int(cap_bytes), loads=tuple(loads),
                            ns_share=tuple(ns_share), bytes_share=tuple(bytes_share))
