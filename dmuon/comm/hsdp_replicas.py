"""HSDP across replicas: one collective per (mode, dtype, device), not one per matrix.

Under HSDP (mesh ``("replicate", "shard")``) every replica has the same owner plan, so the
owners at one shard position, one in each replica, own the same matrices in the same order.
After reduce-to-owner inside each replica, each owner holds its replica's gradient average of
every matrix it owns; the replicas then combine them (DESIGN.md, "Meshes"):

* ``"compute"`` matrices: an ``all_reduce`` over the replicate group; every replica's owner
  runs Newton-Schulz on the same sum.
* ``"broadcast"`` matrices: a ``reduce`` to replica 0's owner, which runs Newton-Schulz, and
  after the step a ``broadcast`` of its fp32 master back to the other replicas.

Each is one :class:`dmuon.comm.collectives.FlatBucket` per (mode, dtype, device) present (in
practice one of each per rank and step: averages and masters are fp32), over the same records
in the same order on every replica, as the plan gives them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dmuon.comm.collectives import FlatBucket, label
from dmuon.comm.grad_buckets import IssueOrder
from dmuon.comm.mesh_roles import MeshRoles
from dmuon.owners.dedicated import DedicatedParam


def batches_by_dtype(tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], list[torch.Tensor]]]:
    """``(indices, tensors)`` per (dtype, device) of ``tensors``, sorted by the dtype's and
    device's names (a rank-independent order); ``indices`` are input positions, ascending."""
    keyed: dict[tuple[str, str], list[int]] = {}
    for i, t in enumerate(tensors):
        keyed.setdefault((str(t.dtype), str(t.device)), []).append(i)
    return [(idx, [tensors[i] for i in idx]) for _, idx in sorted(keyed.items())]


def combine_replicas(pairs: list[tuple[DedicatedParam, torch.Tensor, float]], group: dist.ProcessGroup,
                     replicate_rank: int) -> list[tuple[DedicatedParam, torch.Tensor, float | None]]:
    """Sum the owners' gradient averages over the replicas: per (dtype, device), one
    ``all_reduce`` of the ``"compute"`` records, then one ``reduce`` to replica 0 of the
    ``"broadcast"`` ones, in a rank-independent order. A batch holding a routed expert carries
    each record's presence count as a flag, so every replica agrees whether any rank of any
    replica had a gradient.

    Args:
        pairs: ``(record, average, ranks)``: each owned record that had a gradient, its
            replica's fp32 average ``[rows, cols]`` and how many of the replica's ranks had a
            gradient, in bucket order (the same on every replica).
        group: the replicate process group (one rank per replica, same shard position).
        replicate_rank: this rank's index in ``group``.

    Returns:
        ``(record, sum over replicas, ranks)`` valid on this rank: "compute" records on every
        replica, "broadcast" ones on replica 0 only. Each sum is a view of its batch's buffer;
        ``ranks`` is the summed presence count (``None`` in a batch without routed experts).
    """
    batches = []
    with label("dmuon::combine_replicas"):
        for mode, op in (("compute", "all_reduce"), ("broadcast", "reduce")):
            chosen = [pair for pair in pairs if pair[0].replicate_mode == mode]
            for idx, tensors in batches_by_dtype([avg for _, avg, _ in chosen]):
                recs = [chosen[i][0] for i in idx]
                flags = [chosen[i][2] for i in idx] if any(r.optional for r in recs) else None
                batch = FlatBucket.of(tensors, flags)
                what = f"the replica {op} of {len(recs)} matrices ({[r.fqn for r in recs][:4]})"
                batches.append((mode, recs, batch, batch.issue(op, group, 0, what)))
    out = []
    for mode, recs, batch, pend in batches:
        pend.wait()
        if mode == "compute" or replicate_rank == 0:
            out.extend(zip(recs, batch.views(), batch.flag_values()))
    return out


def broadcast_masters(masters: Sequence[torch.Tensor], group: dist.ProcessGroup,
                      replicate_rank: int) -> None:
    """Copy replica 0's ``masters`` (the owned "broadcast" records' fp32 masters, the same list
    on every replica of ``group``; mutated on the others) to every replica: one ``broadcast``
    per (dtype, device)."""
    batches = []
    with label("dmuon::broadcast_replicas"):
        for _, tensors in batches_by_dtype(list(masters)):
            # the source sends its masters; receivers need only a buffer
            batch = FlatBucket.of(tensors, pack=replicate_rank == 0)
            what = f"the broadcast of {len(tensors)} masters from replica 0"
            batches.append((tensors, batch, batch.issue("broadcast", group, 0, what)))
        for tensors, batch, pend in batches:
            pend.wait()
            if replicate_rank != 0:
                torch._foreach_copy_(tensors, batch.views())


def reduce_to_owners(order: IssueOrder, roles: MeshRoles, reduce_mode: str, world_size: int,
                     replicate_rank: int) -> None:
    """End of backward: issue the buckets not yet out, in ``order``, and wait for each
    (:meth:`~dmuon.comm.grad_buckets.GradBucket.take`); owners add the average to
    ``master.grad``. A backward that put no gradient in any bucket (``no_sync``) issues nothing.

    Under HSDP (``roles.replicate_size > 1``) the owners then combine across replicas
    (:func:`combine_replicas`); the replica sum is divided by the replica count (by nothing
    where the bucket's FSDP2 module set a gradient divide factor: the shard-level reduce
    divided the sum by it). Records come back in issue order, the same on every rank.

    Args:
        order: the model's gradient buckets in their one issue order.
        roles: the mesh roles (shard group for the reduces, replicate group for the combine).
        reduce_mode: :data:`dmuon.comm.grad_buckets.REDUCE_MODES`.
        world_size: the divisor of the average (without a divide factor).
        replicate_rank: this rank's index in the replicate group.
    """
    if not any(bucket.active for bucket in order.buckets):
        return
    order.full(roles.shard, reduce_mode, final=True)
    replicas = roles.replicate_size
    pairs, factored = [], set()  # factored: records whose average is already sum / factor
    for bucket in order.buckets:
        if bucket.pending is None:
            continue
        for rec, avg, ranks in bucket.take(world_size):
            if bucket.divide_factor is not None:
                factored.add(rec)
            # every record of a reduced bucket, on every replica alike ("broadcast" masters go
            # out for all of them: one not stepped is the same on every replica)
            rec.had_grad = True
            if avg is not None and replicas > 1:  # avg: on the owner only
                pairs.append((rec, avg, ranks))
            elif avg is not None and ranks > 0:  # no rank had a gradient: Muon skips the matrix
                _accumulate(rec, avg)
    if replicas > 1:
        for rec, summed, ranks in combine_replicas(pairs, roles.replicate, replicate_rank):
            if not rec.optional or ranks > 0:
                _accumulate(rec, summed.div_(1 if rec in factored else replicas))


def _accumulate(rec: DedicatedParam, avg: torch.Tensor) -> None:
    master = rec.master
    master.grad = avg if master.grad is None else master.grad.add_(avg)
