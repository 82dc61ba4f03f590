"""Reduce-to-owner in buckets: one FSDP2 block's dedicated gradients travel together.

A :class:`GradBucket` packs one block's local gradients (one dtype and device) in a
:class:`~dmuon.comm.collectives.FlatBucket`, one segment per owner, and goes out once the
block's last gradient is in: ``reduce_mode="reduce"`` reduces each segment to its owner,
``"all_reduce"`` all-reduces the whole bucket (twice the bytes); the owner divides the sum by
the data-parallel size. A missing gradient contributes zeros, as in FSDP2. A bucket holding a
routed expert (``DedicatedParam.optional``) flags each matrix's presence, so a matrix no rank
used stays out, as ``torch.optim.Muon`` skips ``grad=None``; other buckets carry no flags (a
gloo sum's last bit depends on the buffer's size). In keep mode one bucket also carries the
shared parameters (:meth:`GradBucket.attach_shared`). Buckets go out in one rank-independent
order (:class:`IssueOrder`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dmuon.comm.collectives import FlatBucket, Pending, is_complete, label
from dmuon.owners.dedicated import DedicatedParam

logger = logging.getLogger(__name__)

REDUCE_MODES = ("reduce", "all_reduce")


@dataclass(eq=False)
class GradBucket:
    """Local gradients of one block's dedicated matrices, reduced to their owners together.

    Attributes:
        records: the block's matrices, owner-major (stable within an owner).
        owners: the owner of each segment of ``buf``.
        buf: one segment per owner (then one for ``shared``); its buffer is dropped after
            :meth:`take` unless ``persistent`` (keep mode: saves page faults).
        group: the owners' process group when not :class:`IssueOrder`'s (expert parallelism).
        expected: the records that take a gradient (``compute.requires_grad``).
        active: the bucket holds gradients of this backward; ``ready``: whose.
        grads: this backward's local gradients by position, kept until :meth:`issue` packs them.
        shared: the non-dedicated parameters carried in keep mode.
        my_owner: this rank's owner index if it owns a member; ``owned``: ``(record, offset,
            numel)`` of its matrices in its ``segment`` of ``buf`` (``(start, numel)``).
        owner_avg: fp32 copy of this rank's segment, its views ``owner_views`` (:func:`owned_averages`).
        block: the FSDP2 module whose unit the bucket reduces (``None`` without FSDP2).
        divide_factor: that module's ``set_gradient_divide_factor``; ``None``: the mean.
    """

    records: list[DedicatedParam]
    owners: list[int]
    buf: FlatBucket
    persistent: bool = False
    group: dist.ProcessGroup | None = None
    index: dict[DedicatedParam, int] = field(init=False)
    expected: frozenset[DedicatedParam] = field(init=False)
    active: bool = False
    ready: set[DedicatedParam] = field(default_factory=set)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    pending: Pending | None = None
    shared: list[torch.nn.Parameter] = field(default_factory=list)
    my_owner: int | None = None
    owned: list[tuple[DedicatedParam, int, int]] = field(default_factory=list, init=False)
    segment: tuple[int, int] = field(default=(0, 0), init=False)
    owner_avg: torch.Tensor | None = None
    owner_views: dict[DedicatedParam, torch.Tensor] | None = None
    block: object = None
    divide_factor: float | None = None

    def __post_init__(self) -> None:
        self.index = {rec: i for i, rec in enumerate(self.records)}
        self.expected = frozenset(rec for rec in self.records if rec.compute.requires_grad)
        self.grads = [None] * len(self.records)
        self.my_owner = next((r.owner for r in self.records if r.is_owner), None)
        if self.my_owner is not None:
            self.segment = self.buf.spans[self.owners.index(self.my_owner)]
            self.owned = [(rec, start - self.segment[0], numel)
                          for rec, (start, numel) in zip(self.records, self.buf.slots) if rec.is_owner]

    @property
    def dtype(self) -> torch.dtype:
        return self.buf.dtype

    @property
    def device(self) -> torch.device:
        return self.buf.device

    def attach_shared(self, params: list[torch.nn.Parameter]) -> None:
        """Carry ``params`` (non-dedicated, this bucket's dtype and device) in a last, flagged
        segment; after the all-reduce each ``.grad`` becomes the average, as in DDP."""
        self.shared = list(params)
        self.buf = FlatBucket(self.buf.shapes + [p.shape for p in params], self.dtype, self.device,
                              self.buf.segments + [(len(params), True)])

    def full(self) -> bool:
        """Every matrix that takes a gradient has it, and no shared parameters ride along."""
        return len(self.ready) == len(self.expected) and not self.shared

    def add(self, rec: DedicatedParam, grad: torch.Tensor) -> bool:
        """Keep ``rec``'s local gradient ``[rows, cols]`` (no op dispatched); True once all are in."""
        self.active = True
        self.grads[self.index[rec]] = grad
        self.ready.add(rec)
        return self.full()

    def issue(self, group: dist.ProcessGroup, mode: str) -> None:
        """Pack the gradients (and the shared parameters' ``.grad``) and start the collective."""
        self.active = True
        for rec in (self.records if len(self.ready) < len(self.records) else ()):
            held = rec.compute.grad
            if rec not in self.ready and held is not None:
                # no gradient in this backward, but some from no_sync micro-batches: that local
                # sum is this rank's contribution
                rec.compute.grad = None
                self.add(rec, held.to_local() if hasattr(held, "to_local") else held)
        with label("dmuon::reduce_bucket"):
            self.buf.pack(self.grads + [p.grad for p in self.shared])
            self.grads = [None] * len(self.records)  # the packed copy is the one that travels
            op = "all_reduce" if self.shared or mode == "all_reduce" else "reduce"
            self.pending = self.buf.issue(op, group, self.owners, lambda: self.describe(group, op))

    def describe(self, group: dist.ProcessGroup, op: str) -> str:
        """What this bucket's collective carries, for a timeout's message."""
        owners = ", ".join(str(dist.get_global_rank(group, owner)) for owner in self.owners)
        shared = f" and {len(self.shared)} other parameter(s)" if self.shared else ""
        kind = "gradient all-reduce" if op == "all_reduce" else "reduce-to-owner"
        return f"the {kind} of {[r.fqn for r in self.records][:4]}{shared} to owner rank {owners}"

    def take(self, world_size: int) -> Iterator[tuple[DedicatedParam, torch.Tensor | None, float]]:
        """Wait, then yield ``(record, average, ranks)`` per record and empty the bucket.

        ``average``: on the owner the fp32 ``[rows, cols]`` sum divided by ``world_size`` (or
        ``divide_factor``), ``None`` elsewhere. ``ranks``: on the owner the summed presence
        flag, elsewhere whether this rank had a gradient. Without flags only the records with a
        gradient here are yielded, with 1.0.
        """
        self.pending.wait()
        counts = self.buf.flag_values()  # one host copy, only where the bucket has flags
        if self.shared:
            _average_shared(self, world_size, counts[len(self.records):])
        divisor = world_size if self.divide_factor is None else self.divide_factor
        views = owned_averages(self, divisor, reuse=True) if self.my_owner is not None else {}
        for rec, count in zip(self.records, counts):
            if count is None:
                if rec in self.ready:
                    yield rec, views.get(rec), 1.0
            else:
                yield rec, views.get(rec), count if rec.is_owner else float(rec in self.ready)
        if not self.persistent:
            self.buf.flat = None
        self.active = False
        self.ready.clear()
        self.grads = [None] * len(self.records)
        self.pending = None


def reduced(bucket: GradBucket) -> bool:
    """Whether ``bucket``'s collective of this backward is out and complete (non-blocking)."""
    return bucket.pending is not None and is_complete(bucket.pending.work)


def owned_averages(bucket: GradBucket, divisor: float,
                   reuse: bool = False) -> dict[DedicatedParam, torch.Tensor]:
    """Once :func:`reduced`: this rank's segment cast to fp32 and divided by ``divisor``, as a
    ``[rows, cols]`` view per owned matrix. Without ``reuse`` in new tensors; with it in the
    bucket's fp32 buffer kept between backwards (unless a master's ``.grad`` is still set).
    """
    owned, (seg_start, seg_numel) = bucket.owned, bucket.segment
    seg = bucket.buf.flat[seg_start: seg_start + seg_numel]
    if not reuse or any(rec.master.grad is not None for rec, _, _ in owned):
        fresh = seg.to(torch.float32, copy=True).div_(divisor)
        return {rec: fresh[at: at + numel].view(rec.shape) for rec, at, numel in owned}
    if bucket.owner_views is None:
        bucket.owner_avg = torch.empty(seg_numel, dtype=torch.float32, device=bucket.device)
        bucket.owner_views = {rec: bucket.owner_avg[at: at + n].view(rec.shape) for rec, at, n in owned}
    bucket.owner_avg.copy_(seg)
    bucket.owner_avg.div_(divisor)
    return bucket.owner_views


@torch.no_grad()
def _average_shared(bucket: GradBucket, world_size: int, counts: list[float]) -> None:
    """Keep mode, after the all-reduce: each shared ``.grad`` becomes the average (``None``
    stays where no rank had one)."""
    first = len(bucket.records)
    start = bucket.buf.slots[first][0]
    bucket.buf.flat[start: bucket.buf.flag_at[first]].div_(world_size)
    into, avgs = [], []
    for i, (p, count) in enumerate(zip(bucket.shared, counts)):
        if count <= 0:
            continue
        avg = bucket.buf.view(first + i)
        if p.grad is None:
            p.grad = avg.to(p.dtype, copy=True)
        else:
            into.append(p.grad)
            avgs.append(avg)
    if into:
        torch._foreach_copy_(into, avgs)


@dataclass(eq=False)
class IssueOrder:
    """The one order every rank issues its gradient buckets in: by last matrix in model order,
    descending (backward order); ``next`` is the first not yet issued in this backward."""

    buckets: list[GradBucket]
    next: int = 0

    def __post_init__(self) -> None:
        self.buckets = sorted(self.buckets, key=lambda b: -max(rec.order for rec in b.records))

    def full(self, group: dist.ProcessGroup, mode: str, final: bool = False) -> None:
        """Issue the full buckets from ``next`` on, in order; with ``final`` all the rest (other
        ranks may hold gradients of an empty one), then start over."""
        while self.next < len(self.buckets):
            bucket = self.buckets[self.next]
            if not final and bucket.expected and not (bucket.active and bucket.full()):
                return
            if bucket.expected and bucket.pending is None:
                bucket.issue(bucket.group or group, mode)
            self.next += 1
        if final:
            self.next = 0


def make_buckets(records: list[DedicatedParam], blocks: list[int],
                 persistent: bool = False) -> list[GradBucket]:
    """One :class:`GradBucket` per (``blocks`` key, reduce dtype, device, owners' group) of
    ``records`` (model order), in first-member order; ``persistent`` in keep mode."""
    keyed: dict[tuple, list[DedicatedParam]] = {}
    for rec, block in zip(records, blocks):
        keyed.setdefault((block, rec.reduce_dtype, rec.buffer.device, rec.group), []).append(rec)
    buckets = []
    for (_, dtype, device, pg), members in keyed.items():
        members = sorted(members, key=lambda r: r.owner)  # stable: model order within an owner
        owners = list(dict.fromkeys(rec.owner for rec in members))
        flagged = any(rec.optional for rec in members)  # a routed expert: presence flags
        segments = [(sum(rec.owner == owner for rec in members), flagged) for owner in owners]
        buf = FlatBucket([torch.Size(rec.shape) for rec in members], dtype, device, segments)
        buckets.append(GradBucket(members, owners, buf, persistent, pg))
    logger.debug("dmuon: %d gradient buckets for %d matrices", len(buckets), len(records))
    return buckets
