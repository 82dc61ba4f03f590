"""Reduce-to-owner in buckets: the gradients of one FSDP2 block's dedicated matrices travel together.

A :class:`GradBucket` holds the local gradients of one block's dedicated matrices (one dtype,
one device) in a :class:`dmuon.comm.collectives.FlatBucket`, one segment per owner. When the
block's last gradient is in, the bucket goes out, exact either way (a sum over the
data-parallel group, divided by its size on the owner): ``reduce_mode="reduce"`` (default)
reduces each segment to its owner (bandwidth-optimal; one NCCL group call);
``"all_reduce"`` all-reduces the whole bucket (twice the bytes, one collective).

On the DDP-style path (``replicas="keep"``) one bucket also carries the *shared* parameters,
the non-dedicated ones every rank steps with AdamW (:meth:`GradBucket.attach_shared`): at the
end of backward their accumulated ``.grad`` are packed in, the bucket becomes one
``all_reduce`` and each rank's ``.grad`` is overwritten with the average, as DDP's reducer does
(Li et al., "PyTorch Distributed", VLDB 2020); exact under accumulation.

A matrix without a gradient on a rank in this backward contributes zeros, as FSDP2 does with an
unused parameter. In a bucket holding a routed expert's matrix (``DedicatedParam.optional``)
every owner's segment ends with one presence flag per matrix, summed with the reduce, so the
owner knows whether any rank had a gradient: a matrix no rank used stays out of the owners'
gradients, as ``torch.optim.Muon`` skips a ``grad`` of ``None``. Other buckets keep their
sizes (gloo's summation order, hence a sum's last bit, depends on a buffer's size).

Such a bucket is complete at different times on different ranks, so buckets go out in one
rank-independent order (:class:`IssueOrder`: by their last matrix in model order, descending).
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
        index: record -> its position in ``records``.
        owners: the owner of each segment of ``buf``.
        buf: one segment per owner (then one for ``shared``); its buffer is dropped after
            :meth:`take` unless ``persistent`` (keep mode: a fresh multi-MB buffer per backward
            page-faults on every first touch).
        expected: the records that take a gradient (``compute.requires_grad``).
        active: the bucket holds gradients of this backward; ``ready``: whose.
        grads: this backward's local gradients by position (``None``: not in), kept, not
            copied, until :meth:`issue` packs them with one op.
        pending: this backward's collective, once issued.
        shared: the non-dedicated parameters carried in keep mode.
        my_owner: this rank's owner index if it owns a member.
        owner_avg: fp32 copy of this rank's segment, its views ``owner_views`` (:meth:`_average_mine`).
        group: the process group of the members' owners when not :class:`IssueOrder`'s (expert
            parallelism; the average still divides by the whole data-parallel size).
        block: the FSDP2 module whose unit the bucket reduces (``None`` without FSDP2).
        divide_factor: that module's ``set_gradient_divide_factor``; ``None``: the mean.
    """

    records: list[DedicatedParam]
    index: dict[DedicatedParam, int]
    owners: list[int]
    buf: FlatBucket
    expected: frozenset[DedicatedParam]
    persistent: bool = False
    active: bool = False
    ready: set[DedicatedParam] = field(default_factory=set)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    pending: Pending | None = None
    shared: list[torch.nn.Parameter] = field(default_factory=list)
    my_owner: int | None = None
    owner_avg: torch.Tensor | None = None
    owner_views: dict[DedicatedParam, torch.Tensor] | None = None
    group: dist.ProcessGroup | None = None
    block: object = None
    divide_factor: float | None = None

    def __post_init__(self) -> None:
        self.grads = [None] * len(self.records)
        self.my_owner = next((r.owner for r in self.records if r.is_owner), None)

    @property
    def dtype(self) -> torch.dtype:
        return self.buf.dtype

    @property
    def device(self) -> torch.device:
        return self.buf.device

    def attach_shared(self, params: list[torch.nn.Parameter]) -> None:
        """Carry ``params`` (non-dedicated, trainable, this bucket's dtype and device) in a last,
        flagged segment (a parameter unused everywhere keeps ``grad=None``)."""
        self.shared = list(params)
        self.buf = FlatBucket(self.buf.shapes + [p.shape for p in params], self.dtype, self.device,
                              self.buf.segments + [(len(params), True)])

    def full(self) -> bool:
        """Every matrix that takes a gradient has it, and no shared parameters ride along
        (their gradients are complete only at the end of backward)."""
        return len(self.ready) == len(self.expected) and not self.shared

    @property
    def issued(self) -> bool:
        return self.pending is not None

    def add(self, rec: DedicatedParam, grad: torch.Tensor) -> bool:
        """Keep ``rec``'s local gradient ``[rows, cols]`` (no op dispatched); True once all are in."""
        self.active = True
        self.grads[self.index[rec]] = grad
        self.ready.add(rec)
        return self.full()

    @property
    def takes_grads(self) -> bool:
        """Some member takes a gradient: the bucket is reduced in every synced backward."""
        return bool(self.expected)

    def issue(self, group: dist.ProcessGroup, mode: str) -> None:
        """Pack (zeros where a matrix has no gradient; the shared parameters' ``.grad``) and
        start the bucket's collective."""
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

    def my_segment(self) -> tuple[torch.Tensor, list[tuple[DedicatedParam, int, int]]]:
        """This rank's segment of the buffer and ``(record, offset in it, numel)`` of each member
        it owns."""
        seg_start, seg_numel = self.buf.spans[self.owners.index(self.my_owner)]
        owned = [(rec, start - seg_start, numel)
                 for rec, (start, numel) in zip(self.records, self.buf.slots) if rec.is_owner]
        return self.buf.flat[seg_start: seg_start + seg_numel], owned

    def _average_mine(self, divisor: float) -> dict[DedicatedParam, torch.Tensor]:
        """This rank's segment averaged in fp32 by two ops, and a ``[rows, cols]`` view of it per
        owned matrix. The fp32 segment and its views are kept from one backward to the next and
        become the masters' ``.grad``; a master whose ``.grad`` is still set gets a fresh tensor
        (:func:`owned_averages`)."""
        seg, owned = self.my_segment()
        if any(rec.master.grad is not None for rec, _, _ in owned):
            return owned_averages(self, divisor)
        if self.owner_views is None:
            self.owner_avg = torch.empty(seg.numel(), dtype=torch.float32, device=self.device)
            self.owner_views = {rec: self.owner_avg[at: at + n].view(rec.shape) for rec, at, n in owned}
        self.owner_avg.copy_(seg)
        self.owner_avg.div_(divisor)
        return self.owner_views

    def take(self, world_size: int) -> Iterator[tuple[DedicatedParam, torch.Tensor | None, float]]:
        """Wait, then yield ``(record, average, ranks)`` for every record of the bucket.

        ``average`` is a fp32 tensor of the record's shape on the owner (the sum over the group
        divided by ``world_size``, or by ``divide_factor`` when set) and ``None`` elsewhere;
        ``ranks`` is, on the owner, how many ranks had a gradient (the summed presence flag;
        0: no rank used the matrix) and, elsewhere, whether this rank had one. Without presence
        flags only the records with a gradient here are yielded, with 1.0. The bucket is empty
        afterwards.
        """
        self.pending.wait()
        counts = self.buf.flag_values()  # one host copy, only where the bucket has flags
        if self.shared:
            _average_shared(self, world_size, counts[len(self.records):])
        divisor = world_size if self.divide_factor is None else self.divide_factor
        views = self._average_mine(divisor) if self.my_owner is not None else {}
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


def owned_averages(bucket: GradBucket, divisor: float) -> dict[DedicatedParam, torch.Tensor]:
    """Once :func:`reduced`, before :meth:`GradBucket.take`: this rank's owned matrices'
    averages as ``take`` computes them (the segment cast to fp32, then divided: the same two
    element-wise ops, so the same bits), in new tensors; the bucket is untouched. For
    ``Muon(overlap="backward")``'s start during backward."""
    seg, owned = bucket.my_segment()
    fresh = seg.to(torch.float32, copy=True).div_(divisor)
    return {rec: fresh[at: at + numel].view(rec.shape) for rec, at, numel in owned}


@torch.no_grad()
def _average_shared(bucket: GradBucket, world_size: int, counts: list[float]) -> None:
    """Keep mode, after the all-reduce: each shared parameter's ``.grad`` becomes the average
    (one ``_foreach_copy_``); one no rank had a gradient for keeps ``grad=None``."""
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
    """The one order every rank issues its gradient buckets in, within a backward.

    Attributes:
        buckets: every bucket, by its last matrix in model order, descending (backward order
            for modules run in registration order).
        next: position of the first bucket not yet issued in this backward.
    """

    buckets: list[GradBucket]
    next: int = 0

    def __post_init__(self) -> None:
        self.buckets = sorted(self.buckets, key=lambda b: -max(rec.order for rec in b.records))

    def full(self, group: dist.ProcessGroup, mode: str) -> None:
        """A bucket is full: issue every bucket from ``next`` on that is full, in order."""
        while self.next < len(self.buckets):
            bucket = self.buckets[self.next]
            if bucket.takes_grads and not (bucket.active and bucket.full()):
                return
            if bucket.takes_grads and not bucket.issued:
                bucket.issue(bucket.group or group, mode)
            self.next += 1

    def finish(self, group: dist.ProcessGroup, mode: str) -> None:
        """End of a synced backward: issue the rest, in order (a bucket none of whose members
        took a gradient on this rank still goes out: other ranks may have them)."""
        for bucket in self.buckets[self.next:]:
            if bucket.takes_grads and not bucket.issued:
                bucket.issue(bucket.group or group, mode)
        self.next = 0


def finish_buckets(order: IssueOrder, group: dist.ProcessGroup, mode: str,
                   world_size: int
                   ) -> Iterator[tuple[DedicatedParam, torch.Tensor | None, float, float | None]]:
    """End of backward: issue the buckets not yet out, in ``order``, wait for each and yield
    :meth:`GradBucket.take`'s ``(record, average, ranks)`` with the bucket's ``divide_factor``.
    A backward that put no gradient in any bucket (``no_sync``) issues nothing."""
    if not any(bucket.active for bucket in order.buckets):
        return
    order.finish(group, mode)
    for bucket in order.buckets:
        if bucket.issued:
            factor = bucket.divide_factor
            for rec, avg, ranks in bucket.take(world_size):
                yield rec, avg, ranks, factor


def make_buckets(records: list[DedicatedParam], blocks: list[int],
                 persistent: bool = False) -> list[GradBucket]:
    """One :class:`GradBucket` per (block, reduce dtype, device, owners' process group), in
    first-member order.

    Args:
        records: every dedicated matrix of the model, in model order.
        blocks: for each record, a key of its unit (its index) or, in keep mode, its bucket.
        persistent: keep each bucket's buffer between backwards (keep mode).
    """
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
        buckets.append(GradBucket(members, {r: i for i, r in enumerate(members)}, owners, buf,
                                  frozenset(r for r in members if r.compute.requires_grad),
                                  persistent=persistent, group=pg))
    logger.debug("dmuon: %d gradient buckets for %d matrices", len(buckets), len(records))
    return buckets
