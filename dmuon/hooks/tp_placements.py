"""Tensor-parallel slices of dedicated matrices: a DTensor keeps its TP placement (``Shard(0)``,
``Shard(1)`` or ``Replicate()``); every data-parallel placement is undone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TPSlice:
    """This rank's piece of a dedicated matrix.

    Attributes:
        local: the TP slice, detached, full over data-parallel dims: ``[rows / T, cols]`` for
            ``Shard(0)``, ``[rows, cols / T]`` for ``Shard(1)`` (torch.chunk sizes), else whole.
        shard_dim: 0 or 1 when split over TP ranks, else ``None``.
        tp_mesh: the 1-D mesh the module computes on (TP, or ``"ep"``); ``None`` without one.
        placement: the TP (or ``"ep"``) placement to rebuild the compute DTensor with.
    """

    local: torch.Tensor
    shard_dim: int | None
    tp_mesh: object | None
    placement: object | None


def local_slice(tensor: torch.Tensor, fqn: str, tp_name: str | None, ep_name: str | None = None) -> TPSlice:
    """Undo data-parallel sharding of ``tensor`` (a redistribute: collective) and return this
    rank's TP slice; with ``ep_name`` the ``"ep"`` placement is kept like a TP one (``local``:
    this rank's ``[E / ep, rows, cols]`` experts). ``ValueError`` for a ``Partial`` or a TP
    shard other than ``Shard(0)``/``Shard(1)``."""
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
