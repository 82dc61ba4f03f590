"""Mesh roles: which DeviceMesh dimension is data-parallel shard, replicate, or tensor-parallel.

Roles come from ``mesh_dim_names``: a dimension named ``"tp"`` is tensor parallel; of the
others, a single one is the data-parallel *shard* dimension (FSDP, or plain replicas), two are
``(replicate, shard)`` in that order (HSDP, as ``init_device_mesh(..., ("replicate", "shard"))``
builds them). A 1-D mesh without names is data-parallel. dmuon creates its own process groups
along each role so its broadcasts and reduces never interleave with FSDP2's collectives.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch.distributed as dist

TP_NAMES = ("tp", "tensor", "model")


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshRoles:
    """dmuon's groups for one rank.

    Attributes:
        shard: group over the DP shard dimension (owners live here: publish, reduce-to-owner).
        world: group over the whole mesh (plan agreement, global gradient norm).
        replicate: group over the HSDP replicate dimension, or ``None``.
        tp: group over the tensor-parallel dimension, or ``None``.
        shard_dim, replicate_dim, tp_dim: the mesh dimensions of each role (``None`` if absent).
        tp_name: the mesh dimension name of the TP role.
    """

    shard: dist.ProcessGroup
    world: dist.ProcessGroup
    replicate: dist.ProcessGroup | None
    tp: dist.ProcessGroup | None
    shard_dim: int
    replicate_dim: int | None
    tp_dim: int | None
    tp_name: str | None
    shape: tuple[int, ...]

    @property
    def shard_size(self) -> int:
        return self.shape[self.shard_dim]

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_dim is None else self.shape[self.tp_dim]

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_dim is None else self.shape[self.replicate_dim]


def _describe(mesh) -> str:
    return f"shape {tuple(mesh.shape)} with dims {getattr(mesh, 'mesh_dim_names', None)}"


def assign_roles(mesh) -> tuple[int, int | None, int | None, str | None]:
    """``(shard_dim, replicate_dim, tp_dim, tp_name)`` of a mesh, from its dimension names.

    Raises:
        ValueError: a mesh of more than 3 dimensions, or one whose roles cannot be told apart
            (a 2-D or 3-D mesh without names, two TP dimensions...).
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    ndim = mesh.ndim
    if ndim == 1:
        if names and names[0] in TP_NAMES:  # TP only: a DP "group" of one rank per TP rank
            return -1, None, 0, names[0]
        return 0, None, None, None
    if len(names) != ndim:
        raise ValueError(
            f"dmuon: a {ndim}-D mesh needs mesh_dim_names to tell data and tensor parallelism "
            f"apart; got {_describe(mesh)}. Build it with init_device_mesh(..., "
            f"mesh_dim_names=('replicate', 'shard') / ('dp', 'tp') / ('replicate', 'shard', 'tp'))."
        )
    tp_dims = [i for i, n in enumerate(names) if n in TP_NAMES]
    if len(tp_dims) > 1 or ndim > 3:
        raise ValueError(f"dmuon: unsupported mesh {_describe(mesh)}: at most (replicate, shard, tp)")
    tp_dim = tp_dims[0] if tp_dims else None
    data_dims = [i for i in range(ndim) if i != tp_dim]
    if len(data_dims) == 1:
        return data_dims[0], None, tp_dim, names[tp_dim] if tp_dim is not None else None
    if len(data_dims) == 2:
        return data_dims[1], data_dims[0], tp_dim, names[tp_dim] if tp_dim is not None else None
    raise ValueError(f"dmuon: unsupported mesh {_describe(mesh)}")


def _groups_along(mesh_ranks, dim: int | None, backend: str) -> dist.ProcessGroup | None:
    """dmuon's own group along ``dim`` containing this rank (collective over the world)."""
    if dim is None:
        return None
    shape = mesh_ranks.shape
    other = [range(s) for i, s in enumerate(shape) if i != dim]
    rank_lists = []
    for idx in itertools.product(*other):
        full = list(idx)
        full.insert(dim, slice(None))
        rank_lists.append([int(r) for r in mesh_ranks[tuple(full)].tolist()])
    me = dist.get_rank()
    mine = None
    for ranks in rank_lists:  # every rank creates every group, in the same order
        group = dist.new_group(ranks=ranks, backend=backend)
        if me in ranks:
            mine = group
    return mine


def build_roles(mesh) -> MeshRoles:
    """Create dmuon's groups for ``mesh`` (collective: every rank of the world calls it)."""
    shard_dim, replicate_dim, tp_dim, tp_name = assign_roles(mesh)
    ranks = mesh.mesh
    backend = dist.get_backend(mesh.get_group(0))
    if shard_dim == -1:  # TP only: the shard "dimension" is a size-1 axis in front
        ranks = ranks.unsqueeze(0)
        shard_dim, tp_dim = 0, 1
    world = dist.new_group(ranks=[int(r) for r in ranks.flatten().tolist()], backend=backend)
    return MeshRoles(
        shard=_groups_along(ranks, shard_dim, backend), world=world,
        replicate=_groups_along(ranks, replicate_dim, backend),
        tp=_groups_along(ranks, tp_dim, backend),
        shard_dim=shard_dim, replicate_dim=replicate_dim, tp_dim=tp_dim, tp_name=tp_name,
        shape=tuple(ranks.shape),
    )
