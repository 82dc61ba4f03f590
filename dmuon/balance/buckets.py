"""Owners for the DDP-style path: size-capped buckets in backward order, one owner per bucket.

With ``replicas="keep"`` (:mod:`dmuon.runtime.keep`) every rank holds the full matrices; a step
moves each gradient to its owner (``reduce``) and each updated matrix back (``broadcast``).
Cutting the matrices into buckets the way DDP's reducer does (Li et al., "PyTorch
Distributed", VLDB 2020: reverse registration order, a size cap, launched as each fills) and
giving each bucket *one* owner makes both phases one collective per bucket.

The owner of a bucket pays its Newton-Schulz time and sends its bytes in the broadcast, so
buckets are assigned by longest-processing-time first (Graham 1969) on the sum of the two,
each normalized by its total over the model: ``ns / sum(ns) + nbytes / sum(nbytes)``.

The cap is ``min(cap_bytes, ceil(total_bytes / world_size))`` so there are at least about
``world_size`` buckets and every rank can own one: with a single 25 MB bucket a small model
would have one rank run all of Newton-Schulz.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketAssignment:
    """Result of :func:`assign_buckets`.

    Attributes:
        bucket: bucket index of every matrix, in input (model) order; bucket 0 holds the
            matrices whose gradients are ready first (the end of the model).
        owner_of_bucket: owner rank of every bucket.
        cap_bytes: the effective cap the buckets were cut with (bytes).
        loads: per-rank combined load (dimensionless, sums to 2 over the ranks).
        ns_share: per-rank share of the Newton-Schulz cost (sums to 1).
        bytes_share: per-rank share of the broadcast bytes (sums to 1).
    """

    bucket: tuple[int, ...]
    owner_of_bucket: tuple[int, ...]
    cap_bytes: int
    loads: tuple[float, ...]
    ns_share: tuple[float, ...]
    bytes_share: tuple[float, ...]


def cut_buckets(nbytes: Sequence[int], cap_bytes: int) -> list[int]:
    """Bucket index per matrix: walk the matrices in reverse (backward) order and close a
    bucket once it holds ``cap_bytes`` or more, as DDP's reducer does.

    Args:
        nbytes: size of each matrix's gradient in bytes, in model (forward) order.
        cap_bytes: bucket size cap in bytes (> 0).

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


def assign_buckets(ns_costs: Sequence[float], nbytes: Sequence[int], world_size: int,
                   cap_bytes: int) -> BucketAssignment:
    """Cut the matrices into buckets and give each bucket the least loaded owner (LPT).

    Args:
        ns_costs: Newton-Schulz cost of each matrix (any unit), model order.
        nbytes: gradient/broadcast bytes of each matrix, model order.
        world_size: ranks to spread owners over (>= 1).
        cap_bytes: the user's bucket cap in bytes (``bucket_cap_mb * 2**20``).

    Raises:
        ValueError: on mismatched lengths, ``world_size < 1`` or ``cap_bytes <= 0``.
    """
    if len(ns_costs) != len(nbytes):
        raise ValueError(f"dmuon: {len(ns_costs)} costs for {len(nbytes)} matrices")
    if world_size < 1:
        raise ValueError(f"dmuon: world_size must be >= 1, got {world_size}")
    if cap_bytes <= 0:
        raise ValueError(f"dmuon: bucket cap must be > 0 bytes, got {cap_bytes}")
    total_bytes = sum(nbytes)
    cap = max(1, min(int(cap_bytes), math.ceil(total_bytes / world_size))) if total_bytes else int(cap_bytes)
    bucket = cut_buckets(nbytes, cap)
    n_buckets = (max(bucket) + 1) if bucket else 0
    ns_b, bytes_b = [0.0] * n_buckets, [0.0] * n_buckets
    for b, c, n in zip(bucket, ns_costs, nbytes):
        ns_b[b] += float(c)
        bytes_b[b] += float(n)
    ns_total, bytes_total = sum(ns_b) or 1.0, sum(bytes_b) or 1.0
    combined = [ns_b[b] / ns_total + bytes_b[b] / bytes_total for b in range(n_buckets)]
    heap = [(0.0, r) for r in range(world_size)]  # (load, rank): ties go to the lowest rank
    owner = [0] * n_buckets
    for b in sorted(range(n_buckets), key=lambda b: (-combined[b], b)):
        load, r = heapq.heappop(heap)
        owner[b] = r
        heapq.heappush(heap, (load + combined[b], r))
    ns_share, bytes_share, loads = [0.0] * world_size, [0.0] * world_size, [0.0] * world_size
    for b in range(n_buckets):
        ns_share[owner[b]] += ns_b[b] / ns_total
        bytes_share[owner[b]] += bytes_b[b] / bytes_total
        loads[owner[b]] += combined[b]
    return BucketAssignment(bucket=tuple(bucket), owner_of_bucket=tuple(owner), cap_bytes=cap,
                            loads=tuple(loads), ns_share=tuple(ns_share), bytes_share=tuple(bytes_share))
