"""Reduce-to-owner in buckets: the gradients of one FSDP2 block's dedicated matrices travel together.

Reducing every matrix on its own costs one collective per matrix, where FSDP2 spends one
reduce-scatter per block. A :class:`GradBucket` holds the local gradients of one block's
dedicated matrices (one dtype, one device) in a flat buffer laid out *owner-major*, so each
owner's matrices form one contiguous segment. When the last gradient of the block is in, the
bucket is reduced with one of two collective patterns, both exact (a sum over the
data-parallel group, divided by its size on the owner):

* ``"reduce"`` (default): one ``reduce`` per owner segment, to that owner. Each rank sends only
  what the owners need (bandwidth-optimal); on NCCL the segments go out as one group call
  (:func:`dmuon.comm.collectives.issued_together`).
* ``"all_reduce"``: one ``all_reduce`` of the whole bucket; each owner keeps its segment. Twice
  the bytes of ``"reduce"`` for a single collective, for backends where a collective's fixed
  cost dominates. On gloo with 4 ranks on 2 CPU cores the two modes' whole steps differ by less
  than the run-to-run noise (382 against 372 ms in ``bench/results/history/step_cpu_4r_buckets.json``;
  the other way round, by 4-10 ms, in two runs not kept), so the default moves fewer bytes.

On the DDP-style path (``replicas="keep"``) one bucket also carries the *shared* parameters,
the non-dedicated ones every rank steps with AdamW (:meth:`GradBucket.attach_shared`): at the
end of backward (it is the bucket of the model's first matrix, the last one in backward anyway)
their accumulated ``.grad`` are copied in with one ``cat``, the bucket becomes one
``all_reduce`` (every rank needs their average) and each rank's ``.grad`` is overwritten with
the average, as DDP's reducer does (Li et al., "PyTorch Distributed", VLDB 2020): exact under
accumulation, since the ``.grad`` a rank starts a backward with is the same average on every
rank. So the step issues no collective of its own for them.

Matrices that did not take a gradient on a rank in this backward (an expert of a
``ModuleList`` MoE that got no tokens there) contribute zeros, as FSDP2 does with an unused
parameter: their slots are zeroed. In a bucket holding a routed expert's matrix
(``DedicatedParam.optional``, :func:`dmuon.owners.stacks.expert_module_names`) one *presence
flag* per matrix, at the end of its owner's segment, travels with the reduce (1 where the rank
had a gradient, summed over the ranks); other buckets keep their sizes, since gloo's summation
order, hence the last bit of a sum, depends on a buffer's size (their matrices take part in
backward on every rank or on none, and the owner's own gradient says which). The owner then knows whether any rank had one: a matrix no rank used stays out of the
owners' gradients, exactly as ``torch.optim.Muon`` skips a parameter whose ``grad`` is
``None`` (under HSDP the flag is summed across replicas too: :mod:`dmuon.comm.hsdp_replicas`).

Since a bucket holding such a matrix is complete at different times on different ranks, buckets
go out in one rank-independent order (:class:`IssueOrder`: by their last matrix in model order,
descending, which is backward order for a model that runs its modules in registration order):
a full bucket waits for the buckets before it, and the end of backward issues whatever is
left, in that order, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dmuon.comm.collectives import Pending, all_reduce_sum, is_complete, issued_together, label, reduce_to_owner
from dmuon.owners.dedicated import DedicatedParam

logger = logging.getLogger(__name__)

REDUCE_MODES = ("reduce", "all_reduce")


@dataclass(eq=False)
class GradBucket:
    """Local gradients of one block's dedicated matrices, reduced to their owners together.

    Attributes:
        records: the block's matrices, owner-major (stable within an owner).
        slots: ``(start, numel)`` of each record in ``flat``, in ``records`` order.
        index: record -> its position in ``records``.
        segments: ``(owner, start, numel)``, one per owner that owns a matrix of the block.
        dtype: the reduce dtype of every member.
        device: the device of every member.
        expected: the records that take a gradient (``compute.requires_grad``).
        flat: ``[sum of numels]`` in ``dtype``; allocated at the first gradient of a backward,
            dropped after :meth:`take` unless ``persistent``.
        persistent: keep ``flat`` from one backward to the next (``replicas="keep"``: every
            rank holds full gradients anyway, as DDP keeps its buckets; a fresh multi-MB buffer
            per backward page-faults on every first touch, ~1.7 ms a step on the default policy).
        active: the bucket holds gradients of this backward.
        ready: the records whose gradient is in this backward.
        grads: this backward's local gradients by position in ``records`` (``None``: not yet
            in); they are kept, not copied one by one, until :meth:`issue` packs them into
            ``flat`` with one ``torch._chunk_cat`` (as FSDP2 packs a group's reduce-scatter
            input), so the hooks dispatch O(1) ops per bucket whatever its number of matrices.
            Memory: a block's gradients and ``flat`` coexist for that one op (FSDP2's peak too).
        pending: this backward's collectives, once issued.
        group: the process group the members' owners are ranks of and the reduce runs on,
            when not the one :class:`IssueOrder` is given (expert parallelism: the ranks holding
            the same experts; the average still divides by the whole data-parallel size, since
            each member's local gradient already sums its ``"ep"`` peers' tokens).
        block: the FSDP2 module whose unit the bucket reduces (``None`` without FSDP2).
        divide_factor: that module's ``set_gradient_divide_factor`` (read at each reduce),
            ``None`` when unset: the owner's gradient is the sum over every data-parallel rank
            (shards and HSDP replicas) divided by it, as FSDP2 divides its own; ``None``: the
            mean (divided by their number, DDP's and FSDP2's default).
    """

    records: list[DedicatedParam]
    slots: list[tuple[int, int]]
    index: dict[DedicatedParam, int]
    segments: list[tuple[int, int, int]]
    dtype: torch.dtype
    device: torch.device
    expected: frozenset[DedicatedParam]
    flat: torch.Tensor | None = None
    persistent: bool = False
    active: bool = False
    ready: set[DedicatedParam] = field(default_factory=set)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)
    shared: list[torch.nn.Parameter] = field(default_factory=list)
    shared_slots: dict[torch.nn.Parameter, tuple[int, int]] = field(default_factory=dict)
    flags: list[int] = field(default_factory=list)  # per record: its presence flag's position
    numel: int = 0  # of flat
    matrix_numel: int = 0  # of the matrices' part of flat (the shared parameters follow)
    my_owner: int | None = None
    owner_avg: torch.Tensor | None = None  # fp32 [numel of this rank's segment], see _average_mine
    owner_views: dict[DedicatedParam, torch.Tensor] | None = None
    _owned: list[tuple[DedicatedParam, int, int]] | None = None
    group: dist.ProcessGroup | None = None
    block: object = None
    divide_factor: float | None = None

    def __post_init__(self) -> None:
        # the matrices' part holds each owner's presence flags too, where the bucket has them
        self.numel = self.matrix_numel = sum(n for _, n in self.slots) + len(self.flags)
        self.grads = [None] * len(self.records)
        # this rank's owner index if it owns a member (its segment is averaged at take)
        self.my_owner = next((r.owner for r in self.records if r.is_owner), None)

    def attach_shared(self, params: list[torch.nn.Parameter]) -> None:
        """Carry ``params`` (non-dedicated, trainable, this bucket's dtype and device) in this
        bucket: their slots follow the matrices', then one flag per parameter counts the ranks
        that produced its gradient (a parameter unused everywhere keeps ``grad=None``, as in
        single-process training)."""
        start = self.numel
        for p in params:
            self.shared.append(p)
            self.shared_slots[p] = (start, p.numel())
            start += p.numel()
        self.numel = start + len(params)

    def _alloc(self) -> None:
        if self.flat is None:
            self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.active = True

    def full(self) -> bool:
        """Every matrix that takes a gradient has it, and no shared parameters ride along
        (their gradients are complete only at the end of backward, where
        :meth:`dmuon.hooks.backward.ReduceToOwners.finish_backward` issues the bucket). ``ready``
        only holds members of ``expected``."""
        return len(self.ready) == len(self.expected) and not self.shared

    @property
    def issued(self) -> bool:
        """Whether this backward's collectives are out (a bucket has at least one segment)."""
        return bool(self.pending)

    def add(self, rec: DedicatedParam, grad: torch.Tensor) -> bool:
        """Keep ``rec``'s local gradient ``[rows, cols]`` (no op dispatched: it is packed at
        :meth:`issue`); True once all are in."""
        self.active = True
        self.grads[self.index[rec]] = grad
        self.ready.add(rec)
        return self.full()

    @property
    def takes_grads(self) -> bool:
        """Some member takes a gradient: the bucket is reduced in every synced backward."""
        return bool(self.expected)

    def issue(self, group: dist.ProcessGroup, mode: str) -> None:
        """Start the bucket's collective(s); slots without a gradient are zeroed first, and the
        shared parameters' ``.grad`` (the sum over this backward and any ``no_sync`` ones) are
        copied in."""
        self._alloc()
        for rec in (self.records if len(self.ready) < len(self.records) else ()):
            held = rec.compute.grad
            if rec not in self.ready and held is not None:
                # no gradient in this backward, but some from no_sync micro-batches (an expert
                # that got tokens only there): that local sum is this rank's contribution
                rec.compute.grad = None
                self.add(rec, held.to_local() if hasattr(held, "to_local") else held)
        present = [rec in self.ready for rec in self.records]
        if len(self.ready) < len(self.records):  # a slot without gradient this backward: zeros
            self.grads = [g if g is not None else torch.zeros(n, dtype=self.dtype, device=self.device)
                          for g, (_, n) in zip(self.grads, self.slots)]
        parts: list[torch.Tensor] = self.grads
        if self.flags:  # routed experts: each owner's segment ends with its matrices' flags
            parts, i = [], 0
            for owner, _, _ in self.segments:
                j = i
                while j < len(self.records) and self.records[j].owner == owner:
                    j += 1
                parts += self.grads[i:j]
                parts.append(torch.tensor([float(x) for x in present[i:j]], dtype=self.dtype,
                                          device=self.device))
                i = j
        if len({g.dtype for g in parts}) > 1:  # _chunk_cat takes one input dtype: a mix of
            # compute-dtype gradients (bf16 under mixed precision) with zeros or presence flags
            # made in the reduce dtype
            parts = [g.to(self.dtype) for g in parts]
        matrices = self.matrix_numel
        # one op packs the whole bucket, casting to the reduce dtype (FSDP2's _chunk_cat)
        torch._chunk_cat(parts, dim=0, num_chunks=1, out=self.flat[:matrices].view(1, matrices))
        self.grads = [None] * len(self.records)  # the packed copy is the one that travels
        if self.shared:
            grads = [p.grad for p in self.shared]
            first = self.shared_slots[self.shared[0]][0]
            flags_at = self.numel - len(self.shared)
            torch.cat([g.detach().reshape(-1) if g is not None else self.flat.new_zeros(p.numel())
                       for p, g in zip(self.shared, grads)], out=self.flat[first:flags_at])
            # the flags are written by fills, not copied from a host list: a pageable
            # host-to-device copy would synchronize the host with the GPU stream
            self.flat[flags_at:].fill_(1)
            for i, g in enumerate(grads):
                if g is None:  # rare: a parameter unused in this backward
                    self.flat[flags_at + i].fill_(0)
            mode = "all_reduce"  # every rank needs the shared parameters' average
        with label("dmuon::reduce_bucket"):
            if mode == "all_reduce":
                self.pending.append(all_reduce_sum(self.flat, group, lambda: self.describe(group)))
            else:
                with issued_together(group, self.device, self.pending):
                    for owner, start, numel in self.segments:
                        self.pending.append(reduce_to_owner(
                            self.flat[start: start + numel], owner, group,
                            lambda owner=owner: [r.fqn for r in self.records if r.owner == owner]))

    def _my_segment(self) -> tuple[int, torch.Tensor]:
        (seg_start, seg_numel), = [(start, numel) for owner, start, numel in self.segments
                                  if owner == self.my_owner]
        return seg_start, self.flat[seg_start: seg_start + seg_numel]

    def _owned_slots(self, seg_start: int) -> list[tuple[DedicatedParam, int, int]]:
        """(record, offset in this rank's segment, numel) of every member it owns, fixed at bind."""
        if self._owned is None:
            self._owned = [(rec, start - seg_start, numel)
                           for rec, (start, numel) in zip(self.records, self.slots) if rec.is_owner]
        return self._owned

    def _average_mine(self, world_size: float) -> dict[DedicatedParam, torch.Tensor]:
        """This rank's segment (its matrices are contiguous: owner-major) averaged in fp32 by two
        ops whatever its number of matrices, and a ``[rows, cols]`` view of it per matrix.

        The fp32 segment and its views are kept from one backward to the next (made at the
        first), so no op per matrix is dispatched: the views become the masters' ``.grad``
        (the owner's matrices' fp32 gradient, which the owner holds from backward to
        ``zero_grad`` anyway; between ``zero_grad`` and the next backward the buffer stays,
        ``4 * numel`` bytes of the owned matrices). A master whose ``.grad`` is still set (no
        ``zero_grad(set_to_none=True)`` since the last backward: it may be that very view) gets
        a fresh tensor instead, as before.
        """
        seg_start, seg = self._my_segment()
        owned = self._owned_slots(seg_start)
        seg_numel = seg.numel()
        if any(rec.master.grad is not None for rec, _, _ in owned):
            return owned_averages(self, world_size)
        if self.owner_views is None:
            self.owner_avg = torch.empty(seg_numel, dtype=torch.float32, device=self.device)
            self.owner_views = {rec: self.owner_avg[at: at + numel].view(rec.shape) for rec, at, numel in owned}
        self.owner_avg.copy_(seg)
        self.owner_avg.div_(world_size)
        return self.owner_views

    def describe(self, group: dist.ProcessGroup) -> str:
        """What this bucket's all-reduce carries, for a timeout's message."""
        owners = sorted({dist.get_global_rank(group, owner) for owner, _, _ in self.segments})
        shared = f" and {len(self.shared)} other parameter(s)" if self.shared else ""
        return (f"the gradient all-reduce of {[r.fqn for r in self.records][:4]}{shared} "
                f"(matrices of owner rank {', '.join(map(str, owners))})")

    def take(self, world_size: int) -> Iterator[tuple[DedicatedParam, torch.Tensor | None, float]]:
        """Wait, then yield ``(record, average, ranks)`` for every record of the bucket.

        ``average`` is a new fp32 tensor of the record's shape on the owner (the sum over the
        group divided by ``world_size``, or by ``divide_factor`` when set; zeros where no rank
        had a gradient) and ``None``
        elsewhere; ``ranks`` is, on the owner, how many ranks had a gradient (the summed
        presence flag; 0: no rank used the matrix) and, elsewhere, whether this rank had one.
        The bucket is empty afterwards.
        """
        for pend in self.pending:
            pend.wait()
        if self.shared:
            _average_shared(self, world_size)
        divisor = world_size if self.divide_factor is None else self.divide_factor
        views = self._average_mine(divisor) if self.my_owner is not None else {}
        # routed experts: the owner reads how many ranks had each gradient (0: none, skip it)
        flags = self.flat[self.flags].tolist() if self.flags else None
        for i, rec in enumerate(self.records):
            if flags is None:  # no routed expert here: a record is present where it is ready
                if rec in self.ready:
                    yield rec, views.get(rec), 1.0
            else:
                yield rec, views.get(rec), flags[i] if rec.is_owner else float(rec in self.ready)
        if not self.persistent:
            self.flat = None
        self.active = False
        self.ready.clear()
        self.grads = [None] * len(self.records)
        self.pending.clear()


def reduced(bucket: GradBucket) -> bool:
    """Whether ``bucket``'s collectives of this backward are out and complete, by non-blocking
    queries (:func:`dmuon.comm.collectives.is_complete`: a coalesced NCCL group call through
    its works)."""
    return bool(bucket.pending) and all(is_complete(pend.work) for pend in bucket.pending)


def owned_averages(bucket: GradBucket, divisor: float) -> dict[DedicatedParam, torch.Tensor]:
    """Once :func:`reduced`, before :meth:`GradBucket.take`: this rank's owned matrices'
    averages as ``take`` will compute them (the segment cast to fp32, then divided by
    ``divisor``: the same two element-wise ops, so the same bits), in new tensors; the bucket
    is untouched. For ``Muon(overlap="backward")``'s start during backward."""
    seg_start, seg = bucket._my_segment()
    fresh = seg.to(torch.float32, copy=True).div_(divisor)
    return {rec: fresh[at: at + numel].view(rec.shape) for rec, at, numel in bucket._owned_slots(seg_start)}


@torch.no_grad()
def _average_shared(bucket: GradBucket, world_size: int) -> None:
    """Keep mode, after the bucket's all-reduce: divide the shared parameters' sums by
    ``world_size`` and write each average into its parameter's ``.grad`` (one
    ``_foreach_copy_``); a parameter no rank produced a gradient for keeps ``grad=None``."""
    first = bucket.shared_slots[bucket.shared[0]][0]
    bucket.flat[first: bucket.numel - len(bucket.shared)].div_(world_size)
    # Host sync on CUDA, on the replicated path's keep mode only, once per backward:
    # which .grad stay None must be known on the host (DDP's find_unused_parameters
    # reads its bitmap the same way). The FSDP2 path never gets here (no shared).
    flags = bucket.flat[bucket.numel - len(bucket.shared):].tolist()
    into, avgs = [], []
    for p, flag in zip(bucket.shared, flags):
        if flag <= 0:  # no rank produced this gradient: it stays None
            continue
        start, numel = bucket.shared_slots[p]
        avg = bucket.flat[start: start + numel].view_as(p)
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
        buckets: every bucket; kept in issue order: by the bucket's last matrix in model order,
            descending (backward order for modules run in registration order).
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
                   world_size: int) -> Iterator[tuple[DedicatedParam, torch.Tensor | None, float, float | None]]:
    """End of backward: issue the buckets not yet out (in ``order``, the one made at binding:
    it is not sorted again per backward), wait for every bucket, and yield
    :meth:`GradBucket.take`'s ``(record, average, ranks)`` in that order, with the bucket's
    ``divide_factor``.

    A backward that put no gradient in any bucket (``no_sync``, or nothing dedicated took
    part) issues nothing; otherwise every bucket whose members take gradients goes out on
    every rank, so ranks whose experts got no tokens still join the reduce."""
    if not any(bucket.active for bucket in order.buckets):
        return
    order.finish(group, mode)
    for bucket in order.buckets:
        if bucket.issued:
            factor = bucket.divide_factor
            for rec, avg, ranks in bucket.take(world_size):
                yield rec, avg, ranks, factor


def make_buckets(records: list[DedicatedParam], blocks: list[int], persistent: bool = False) -> list[GradBucket]:
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
        slots, flags, segments, start = [], [], [], 0
        owners = list(dict.fromkeys(rec.owner for rec in members))
        flagged = any(rec.optional for rec in members)  # a routed expert: presence flags
        for owner in owners:  # each owner's segment: its matrices, then their presence flags
            mine = [rec for rec in members if rec.owner == owner]
            seg_start = start
            for rec in mine:
                numel = math.prod(rec.shape)
                slots.append((start, numel))
                start += numel
            if flagged:
                flags += list(range(start, start + len(mine)))
                start += len(mine)
            segments.append((owner, seg_start, start - seg_start))
        expected = frozenset(r for r in members if r.compute.requires_grad)
        index = {r: i for i, r in enumerate(members)}  # records hash by identity (eq=False)
        buckets.append(GradBucket(members, slots, index, segments, dtype, device, expected,
                                  persistent=persistent, flags=flags, group=pg))

    logger.debug("dmuon: %d gradient buckets for %d matrices", len(buckets), len(records))
    return buckets

