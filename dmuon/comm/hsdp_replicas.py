"""Reduce-to-owner at the end of backward, and under HSDP the combine across replicas.

Every replica has the same owner plan, so after reduce-to-owner inside each replica the owners
at one shard position hold their replicas' averages of the same matrices. ``"compute"``
matrices are all-reduced over the replicate group (every replica runs Newton-Schulz);
``"broadcast"`` ones are reduced to replica 0, whose fp32 masters are broadcast back after the
step. Each is one :class:`~dmuon.comm.collectives.FlatBucket` per (mode, dtype, device).
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
    """``(indices, tensors)`` per (dtype, device) of ``tensors``, in a rank-independent order
    (by name); ``indices`` are input positions, ascending."""
    keyed: dict[tuple[str, str], list[int]] = {}
    for i, t in enumerate(tensors):
        keyed.setdefault((str(t.dtype), str(t.device)), []).append(i)
    return [(idx, [tensors[i] for i in idx]) for _, idx in sorted(keyed.items())]


def combine_replicas(pairs: list[tuple[DedicatedParam, torch.Tensor, float]], group: dist.ProcessGroup,
                     replicate_rank: int) -> list[tuple[DedicatedParam, torch.Tensor, float | None]]:
    """Sum the owners' gradient averages over the replicas: per (dtype, device), one
    ``all_reduce`` of the ``"compute"`` records, then one ``reduce`` to replica 0 of the
    ``"broadcast"`` ones. A batch holding a routed expert sums presence counts as flags.

    ``pairs``: ``(record, average, ranks)`` per owned record with a gradient (its replica's
    fp32 ``[rows, cols]`` average and presence count), in bucket order. Returns ``(record, sum,
    ranks)`` valid here ("broadcast" ones on replica 0 only), each sum a view of its batch's
    buffer, ``ranks`` ``None`` in a batch without flags.
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
    """Copy replica 0's ``masters`` (the owned "broadcast" records' fp32 masters) into the other
    replicas': one ``broadcast`` per (dtype, device)."""
    batches = []
    with label("dmuon::broadcast_replicas"):
        for _, tensors in batches_by_dtype(list(masters)):
            batch = FlatBucket.of(tensors, pack=replicate_rank == 0)
            what = f"the broadcast of {len(tensors)} masters from replica 0"
            batches.append((tensors, batch, batch.issue("broadcast", group, 0, what)))
        for tensors, batch, pend in batches:
            pend.wait()
            if replicate_rank != 0:
                torch._foreach_copy_(tensors, batch.views())


def reduce_to_owners(order: IssueOrder, roles: MeshRoles, reduce_mode: str, world_size: int,
                     replicate_rank: int) -> None:
    """End of backward: issue the buckets not yet out, in ``order``, wait for each, and add
    the owners' averages (divided by ``world_size``) to ``master.grad``; nothing if no bucket
    holds a gradient. Under HSDP the owners then combine across replicas
    (:func:`combine_replicas`) and divide by the replica count (not where the bucket's FSDP2
    module set a gradient divide factor: the shard-level reduce divided by it).
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
            rec.had_grad = True  # every record of a reduced bucket, on every replica alike
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
