"""HSDP across replicas: one collective per (mode, dtype, device), not one per matrix.

Under HSDP (mesh ``("replicate", "shard")``) every replica has the same owner plan, so the
owners at one shard position, one in each replica, own the same matrices in the same order.
After reduce-to-owner inside each replica, each owner holds its replica's gradient average of
every matrix it owns; the replicas then combine them (DESIGN.md, "Meshes"):

* ``"compute"`` matrices: an ``all_reduce`` over the replicate group; every replica's owner
  runs Newton-Schulz on the same sum.
* ``"broadcast"`` matrices: a ``reduce`` to replica 0's owner, which runs Newton-Schulz, and
  after the step a ``broadcast`` of its fp32 master back to the other replicas.

Issuing these per matrix costs one collective per owned matrix (~25 per rank per step for a
model with ~25 matrices per owner; ~1 ms of CPU each on gloo, a kernel launch each on NCCL). :class:`FlatBatch`
concatenates the tensors of one collective into one flat buffer instead, as
:mod:`dmuon.comm.grad_buckets` does for reduce-to-owner, so each rank issues at most one
collective per (mode, dtype, device) present: in practice one ``all_reduce``, one ``reduce``
and one ``broadcast`` per step, since averages and masters are all fp32.

Every replica must pass the same records in the same order, or the collectives do not match
(a size or count mismatch makes the collective fail or hang, as per-matrix code would). The runtime guarantees this as
long as the same matrices take a gradient on every rank, the condition reduce-to-owner already
has (a model running the same graph everywhere): the owned records and their order come from
the plan, identical on every replica, and "which records had a gradient" from that graph.

Extra memory: one flat copy of the tensors of a batch while it is in flight (the gradient
averages' copies become the owners' ``master.grad``, so they cost nothing after the wait; a
broadcast's flat buffer is freed after it is copied back into the masters).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dmuon.balance.cost import REPLICATE_MODES
from dmuon.comm.grad_buckets import IssueOrder, finish_buckets
from dmuon.comm.mesh_roles import MeshRoles
from dmuon.owners.dedicated import DedicatedParam

logger = logging.getLogger(__name__)

_OPS = ("all_reduce", "reduce", "broadcast")


@dataclass(eq=False)
class FlatBatch:
    """Tensors of one dtype and device that cross the replicate group as one flat collective.

    Attributes:
        tensors: the batch's tensors, any shapes, one dtype and device; not mutated by
            :meth:`issue` (the collective runs on ``flat``).
        flat: ``[sum of numels]`` in the tensors' dtype: their concatenation (or, with
            ``fill=False``, uninitialized: a receive buffer).
        work: the in-flight collective's handle; ``flat`` must stay alive until it is waited
            (the batch holds it).
    """

    tensors: list[torch.Tensor]
    flat: torch.Tensor
    work: Any = None
    op: str = ""

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], *, fill: bool = True) -> FlatBatch:
        """Concatenate ``tensors`` (``fill=True``) or allocate a receive buffer for them.

        Raises:
            ValueError: ``tensors`` is empty, or mixes dtypes or devices (say which).
        """
        tensors = list(tensors)
        if not tensors:
            raise ValueError("dmuon: FlatBatch needs at least one tensor; skip empty batches")
        dtypes = {t.dtype for t in tensors}
        devices = {t.device for t in tensors}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                f"dmuon: FlatBatch takes one dtype and one device, got dtypes {sorted(map(str, dtypes))} "
                f"and devices {sorted(map(str, devices))}; group the tensors with batches_by_dtype")
        if fill:
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        else:
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype,
                               device=tensors[0].device)
        return cls(tensors=tensors, flat=flat)

    def issue(self, op: str, group: dist.ProcessGroup, root: int = 0) -> None:
        """Start ``op`` on ``flat`` over ``group``, asynchronously.

        Args:
            op: ``"all_reduce"`` (sum everywhere), ``"reduce"`` (sum to ``root``) or
                ``"broadcast"`` (``root``'s ``flat`` to every rank).
            group: the replicate process group.
            root: the *global* rank of the reduce destination / broadcast source.

        Raises:
            ValueError: an unknown ``op``.
            RuntimeError: the batch is already in flight.
        """
        if op not in _OPS:
            raise ValueError(f"dmuon: FlatBatch op must be one of {_OPS}, got {op!r}")
        if self.work is not None:
            raise RuntimeError(f"dmuon: FlatBatch {self.op!r} of {len(self.tensors)} tensors is "
                               "still in flight; wait() before issuing again")
        self.op = op
        if op == "all_reduce":
            self.work = dist.all_reduce(self.flat, group=group, async_op=True)
        elif op == "reduce":
            self.work = dist.reduce(self.flat, dst=root, group=group, async_op=True)
        else:
            self.work = dist.broadcast(self.flat, src=root, group=group, async_op=True)

    def wait(self) -> list[torch.Tensor]:
        """Wait for the collective; return views of ``flat`` shaped like ``tensors``, in order."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        pieces = torch.split(self.flat, [t.numel() for t in self.tensors])
        return [piece.view(t.shape) for piece, t in zip(pieces, self.tensors)]

    def copy_back(self) -> None:
        """Wait, then copy each view of ``flat`` into its tensor (mutates ``tensors``)."""
        for tensor, piece in zip(self.tensors, self.wait()):
            tensor.detach().copy_(piece)


def batches_by_dtype(tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Group ``tensors`` by (dtype, device), in a rank-independent order.

    Returns:
        ``(indices, tensors)`` per (dtype, device) present, sorted by the dtype's and device's
        names (not by first appearance, so the order does not depend on which dtype comes
        first); ``indices`` are positions in the input, ascending.
    """
    keyed: dict[tuple[str, str], list[int]] = {}
    for i, t in enumerate(tensors):
        keyed.setdefault((str(t.dtype), str(t.device)), []).append(i)
    return [(idx, [tensors[i] for i in idx]) for _, idx in sorted(keyed.items())]


@dataclass(eq=False)
class ReplicaCombine:
    """One step's cross-replica combination of the owners' gradient averages.

    Build it from the ``(record, average)`` pairs this rank owns, :meth:`issue` (one
    ``all_reduce`` per dtype for ``"compute"`` records, one ``reduce`` to replica 0 per dtype
    for ``"broadcast"`` records), then :meth:`wait` for the sums.

    Attributes:
        group: the replicate process group (one rank per replica, same shard position).
        replicate_rank: this rank's index in ``group`` (replica index).
        pairs: ``(record, average)``: each owned record that had a gradient this backward and
            its replica's average, ``[rows, cols]`` (the record's local shape), fp32 from
            :meth:`dmuon.comm.grad_buckets.GradBucket.take`, in bucket order (the same on
            every replica).
    """

    group: dist.ProcessGroup
    replicate_rank: int
    pairs: list[tuple[DedicatedParam, torch.Tensor]] = field(default_factory=list)
    _batches: list[tuple[list[DedicatedParam], FlatBatch]] = field(default_factory=list)

    def add(self, rec: DedicatedParam, avg: torch.Tensor) -> None:
        """Queue an owned record's replica average (not copied until :meth:`issue`).

        Raises:
            ValueError: ``rec`` has a ``replicate_mode`` other than "compute"/"broadcast".
        """
        if rec.replicate_mode not in REPLICATE_MODES:
            raise ValueError(f"dmuon: matrix {rec.fqn!r} has replicate_mode {rec.replicate_mode!r}; "
                             f"expected one of {REPLICATE_MODES} "
                             "(OwnerPlan.with_replicate_modes resolves 'auto' into MatrixSpec.replicate_mode)")
        self.pairs.append((rec, avg))

    def issue(self) -> None:
        """Flatten the queued averages and start one collective per (mode, dtype, device).

        "compute" batches go first, then "broadcast" batches; the order is rank-independent.
        The queued averages may be dropped by the caller afterwards (the batches hold copies).
        """
        with torch.profiler.record_function("dmuon::combine_replicas"):
            root = dist.get_global_rank(self.group, 0)
            for mode in REPLICATE_MODES:
                chosen = [(rec, avg) for rec, avg in self.pairs if rec.replicate_mode == mode]
                for idx, tensors in batches_by_dtype([avg for _, avg in chosen]):
                    batch = FlatBatch.of(tensors)
                    batch.issue("all_reduce" if mode == "compute" else "reduce", self.group, root)
                    self._batches.append(([chosen[i][0] for i in idx], batch))
        self.pairs = []

    def wait(self) -> list[tuple[DedicatedParam, torch.Tensor]]:
        """Wait for every batch; return ``(record, sum over replicas)`` valid on this rank.

        Returns:
            For "compute" records, on every replica; for "broadcast" records, on replica 0
            only (elsewhere the reduce leaves the buffer undefined and they are left out).
            Each sum is a ``[rows, cols]`` fp32 view of its batch's flat buffer, the sum (not
            the average) over the replicas, in issue order.
        """
        out = []
        for records, batch in self._batches:
            valid = batch.op == "all_reduce" or self.replicate_rank == 0
            views = batch.wait()
            if valid:
                out.extend(zip(records, views))
        self._batches = []
        return out


def broadcast_masters(masters: Sequence[torch.Tensor], group: dist.ProcessGroup, replicate_rank: int) -> int:
    """Copy replica 0's masters to every replica: one ``broadcast`` per (dtype, device).

    Args:
        masters: the owned "broadcast" records' fp32 masters, ``[rows, cols]`` each, full on
            this owner; the same list (shapes, order) on every replica of ``group``. Mutated on
            replicas other than 0.
        group: the replicate process group.
        replicate_rank: this rank's index in ``group``; 0 is the source.

    Returns:
        The number of collectives issued (0 when ``masters`` is empty).
    """
    if not masters:
        return 0
    src = dist.get_global_rank(group, 0)
    batches = []
    with torch.profiler.record_function("dmuon::broadcast_replicas"):
        for _, tensors in batches_by_dtype(list(masters)):
            # The source sends its masters; receivers need only a buffer (no copy in).
            batch = FlatBatch.of(tensors, fill=replicate_rank == 0)
            batch.issue("broadcast", group, src)
            batches.append(batch)
        for batch in batches:
            if replicate_rank == 0:
                batch.wait()
            else:
                batch.copy_back()
    return len(batches)


def reduce_to_owners(order: IssueOrder, roles: MeshRoles, reduce_mode: str, world_size: int,
                     replicate_rank: int) -> None:
    """End of backward: wait for every bucket's reduce; owners add the average to ``master.grad``.

    Under HSDP (``roles.replicate_size > 1``) the owners then combine across
    replicas: one all-reduce of all "compute" averages (each replica's owner runs Newton-Schulz)
    and one reduce to replica 0 of all "broadcast" averages (it runs NS and broadcasts), per dtype;
    the replica sum is divided by the replica count (by nothing where the record's FSDP2 module
    set a gradient divide factor: the shard-level reduce divided the sum by it). Records come back in issue order, the same
    on every rank, so the combine's flat batches line up.

    Args:
        order: the model's gradient buckets (issued or not) in their one issue order, made at
            binding (:class:`dmuon.comm.grad_buckets.IssueOrder`).
        roles: the mesh roles (shard group for the reduces, replicate group for the combine).
        reduce_mode, world_size: :func:`finish_buckets`' arguments.
        replicate_rank: this rank's index in the replicate group.
    """
    replicas = roles.replicate_size
    combine = ReplicaCombine(group=roles.replicate, replicate_rank=replicate_rank) if replicas > 1 else None
    factored: set[DedicatedParam] = set()  # records whose average is already sum / factor
    for rec, avg, ranks, factor in finish_buckets(order, roles.shard, reduce_mode, world_size):
        if factor is not None and combine is not None:
            factored.add(rec)
        # every record of a reduced bucket, on every replica alike ("broadcast" masters go out
        # for all of them: one not stepped is the same on every replica)
        rec.had_grad = True
        if avg is not None and combine is not None:  # avg: on the owner only
            # a routed expert's presence count rides along, so every replica agrees whether any
            # rank of any replica had a gradient (an expert with no tokens in one replica only)
            combine.add(rec, torch.cat([avg.reshape(-1), avg.new_tensor([ranks])]) if rec.optional else avg)
        elif avg is not None and ranks > 0:  # no rank had a gradient: Muon skips the matrix
            _accumulate(rec, avg)
    if combine is not None:
        combine.issue()
        for rec, summed in combine.wait():
            divisor = 1 if rec in factored else replicas
            if not rec.optional:
                _accumulate(rec, summed.div_(divisor))
            elif summed[-1] > 0:
                _accumulate(rec, summed[:-1].view(rec.shape).div_(divisor))


def _accumulate(rec: DedicatedParam, avg: torch.Tensor) -> None:
    master = rec.master
    master.grad = avg if master.grad is None else master.grad.add_(avg)
