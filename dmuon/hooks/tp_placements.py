"""Tensor-parallel slices of dedicated matrices, read from DTensor placements at bind time.

A dedicated matrix that is a DTensor keeps its tensor-parallel placement (``Shard(0)`` for
``ColwiseParallel``, ``Shard(1)`` for ``RowwiseParallel``, or ``Replicate()``); every
data-parallel placement (FSDP2's ``Shard(0)``, ``_StridedShard`` under FSDP x TP, HSDP's
``Replicate``) is undone, leaving this rank's TP slice in full along the data-parallel axes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TPSlice:
    """This rank's piece of a dedicated matrix.

    Attributes:
        local: the TP slice, full over data-parallel dims: ``[rows / T, cols]`` for
            ``Shard(0)``, ``[rows, cols / T]`` for ``Shard(1)`` (torch.chunk sizes), the whole
            matrix otherwise. Detached; original dtype and device.
        shard_dim: 0 or 1 when the matrix is split over TP ranks, ``None`` when every TP rank
            holds it whole (or there is no TP).
        tp_mesh: the 1-D DeviceMesh the module computes on: the TP mesh, or under expert
            parallelism the ``"ep"`` mesh (``None`` for plain tensors and FSDP2-only DTensors).
        placement: the TP (or ``"ep"``) placement to rebuild the compute DTensor with.
    """

    local: torch.Tensor
    shard_dim: int | None
    tp_mesh: object | None
    placement: object | None


def local_slice(tensor: torch.Tensor, fqn: str, tp_name: str | None, ep_name: str | None = None) -> TPSlice:
    """Undo data-parallel sharding of ``tensor`` and return this rank's TP slice; collective
    over the DTensor's mesh when it has data-parallel shards (a redistribute).

    With ``ep_name`` (an expert stack ``Shard(0)`` over the mesh's expert-parallel dimension)
    the ``"ep"`` placement is kept like a TP one: ``local`` is this rank's experts
    ``[E / ep, rows, cols]``, whole, and ``shard_dim`` is ``None``.

    Raises:
        ValueError: for a placement dmuon cannot own (``Partial``, a strided shard on the TP
            dimension, a shard on a dimension other than 0/1), naming the parameter.
    """
    if not hasattr(tensor, "placements"):
        return TPSlice(tensor.detach(), None, None, None)
    from torch.distributed.tensor import Replicate, Shard

    mesh = tensor.device_mesh
    names = tuple(mesh.mesh_dim_names or ())
    target, shard_dim, tp_mesh, placement = [], None, None, None
    for i, p in enumerate(tensor.placements):
        name = names[i] if i < len(names) else None
        is_ep = ep_name is not None and name == ep_name  # the "ep" placement: checked at selection
        if p.is_partial() and not is_ep:
            raise ValueError(f"dmuon: parameter {fqn!r} has a Partial placement on mesh dim {i}; "
                             f"dmuon takes Shard(0)/Shard(1)/Replicate() tensor-parallel matrices")
        if is_ep or (tp_name is not None and name == tp_name):
            tp_mesh = mesh[name] if mesh.ndim > 1 else mesh
            placement = p
            if p.is_shard() and not is_ep:
                if type(p) is not Shard or p.dim not in (0, 1):
                    raise ValueError(
                        f"dmuon: parameter {fqn!r} has tensor-parallel placement {p!r}; dmuon "
                        f"supports Shard(0) (ColwiseParallel), Shard(1) (RowwiseParallel) and "
                        f"Replicate(). Pass predicate=... to leave it on AdamW."
                    )
                shard_dim = p.dim
            target.append(p)
        else:
            target.append(Replicate())
    if tuple(target) != tuple(tensor.placements):
        tensor = tensor.redistribute(mesh, target)
    return TPSlice(tensor.to_local().detach(), shard_dim, tp_mesh, placement)


def as_compute_param(local: torch.Tensor, sl: TPSlice, full_shape: tuple[int, ...]) -> torch.Tensor:
    """Wrap a local compute tensor as a DTensor on the TP (or ``"ep"``) mesh when the original
    was one; ``full_shape`` is the global (contiguous) shape. Differentiable (the gradient of
    the result reaches ``local`` as a plain tensor)."""
    if sl.tp_mesh is None:
        return local
    from torch.distributed.tensor import DTensor

    stride, step = [], 1
    for size in reversed(full_shape):
        stride.insert(0, step)
        step *= int(size)
    return DTensor.from_local(local, sl.tp_mesh, [sl.placement], run_check=False,
                              shape=torch.Size(full_shape), stride=tuple(stride))
