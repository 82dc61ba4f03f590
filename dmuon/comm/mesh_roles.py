"""Mesh roles: which DeviceMesh dimension is data-parallel shard, replicate, or tensor-parallel.

From ``mesh_dim_names``: ``"tp"`` is tensor parallel; of the others one is the data-parallel
shard dimension, two are ``(replicate, shard)`` (HSDP); a 1-D unnamed mesh is data-parallel.
``"ep"`` is expert parallelism (:func:`expert_parallel_dims`); ``"pp"`` holds pipeline stages,
and every group lives within one (:func:`stage_layout`). dmuon creates its own groups with the
user's timeout (:func:`inherited_timeout`), on every rank in the same order, so every rank must
call ``dedicate_params`` equally often.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TP_NAMES = ("tp", "tensor", "model")
#: mesh dimension names of expert parallelism (torchtitan's ``"ep"``)
EP_NAMES = ("ep",)
#: mesh dimension names of pipeline parallelism (torchtitan's ``"pp"``): stages, not replicas
PP_NAMES = ("pp",)


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshRoles:
    """dmuon's groups for one rank (``None`` / size 1 where the role is absent).

    Attributes:
        shard: group over the DP shard dimension (owners live here: publish, reduce-to-owner).
        world: group over the whole mesh, or the stage's ranks (plan agreement, gradient norm).
        replicate, tp: groups over the HSDP replicate and the tensor-parallel dimension.
        shard_size, replicate_size, tp_size: each role's number of ranks.
        replicate_dim: the (stage's) mesh dimension of the replicate role.
        tp_name: the mesh dimension name of the TP role.
        steps: gloo group over ``world``'s ranks for :mod:`dmuon.hooks.step_check`.
        fake: the mesh runs on torch's fake process group (nothing needing a live peer is issued).
        expert: expert parallelism only: the ranks sharing this rank's ``"ep"`` coordinate.
        ep_size, ep_name: size and name of the ``"ep"`` dimension.
        pp_size: number of pipeline stages.
    """

    shard: dist.ProcessGroup
    world: dist.ProcessGroup
    replicate: dist.ProcessGroup | None
    tp: dist.ProcessGroup | None
    shard_size: int
    replicate_size: int
    tp_size: int
    replicate_dim: int | None
    tp_name: str | None
    steps: dist.ProcessGroup | None = None
    fake: bool = False
    expert: dist.ProcessGroup | None = None
    ep_size: int = 1
    ep_name: str | None = None
    pp_size: int = 1


def _describe(mesh) -> str:
    return f"shape {tuple(mesh.shape)} with dims {getattr(mesh, 'mesh_dim_names', None)}"


def _root_mesh(mesh):
    """The mesh ``mesh`` was sliced from (itself if not a slice)."""
    getter = getattr(mesh, "_get_root_mesh", None)
    return mesh if getter is None else getter()


def stage_layout(mesh) -> tuple[torch.Tensor, tuple[str, ...] | None, int]:
    """Every pipeline stage's data-parallel ranks, from a mesh (with or without ``"pp"``) or
    a stage's sub-mesh sliced from one.

    Returns:
        ``(stages, names, index)``: ``[n_stages, *stage shape]`` int64 global ranks (one stage
        without ``"pp"``), the stage's dimension names (``None``: unnamed), this rank's stage.

    Raises:
        ValueError: a sub-mesh that drops a parent dimension other than ``"pp"``, or more than
            one ``"pp"`` dimension.
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    root = _root_mesh(mesh)
    source, source_names = mesh.mesh, names
    # a mesh holding all of its root's ranks (torchtitan's unflattened ones) drops nothing
    if root is not mesh and root is not None and mesh.mesh.numel() != root.mesh.numel():
        root_names = tuple(getattr(root, "mesh_dim_names", None) or ())
        dropped = [n for n in root_names if n not in names]
        if any(n not in PP_NAMES for n in dropped):
            raise ValueError(
                f"dmuon: the mesh ({_describe(mesh)}) is a slice of ({_describe(root)}) that drops "
                f"the dimensions {dropped}; dmuon takes a sub-mesh only of a pipeline stage (dropping "
                f"'pp'). Pass the mesh with every data-parallel dimension, e.g. "
                f"mesh[{tuple(n for n in root_names if n not in PP_NAMES)!r}] or the whole mesh.")
        if dropped and not all(n in root_names for n in names):
            raise ValueError(f"dmuon: cannot place the sub-mesh ({_describe(mesh)}) in its parent "
                             f"({_describe(root)}); pass the whole mesh")
        source, source_names = root.mesh, root_names
    pp = [i for i, n in enumerate(source_names) if n in PP_NAMES]
    if len(pp) > 1:
        raise ValueError(f"dmuon: the mesh ({_describe(mesh)}) has {len(pp)} pipeline dimensions; "
                         f"give it one named 'pp'")
    keep = [source_names.index(n) for n in names if n not in PP_NAMES] if source_names else list(
        range(source.ndim))
    stages = source.permute(*pp, *keep).reshape(-1, *(source.shape[i] for i in keep))
    if stages.ndim == 1:  # ("pp",) alone: one rank per stage, a data-parallel group of one
        stages = stages.unsqueeze(1)
    me = dist.get_rank()
    where = (stages == me).nonzero()
    index = int(where[0, 0]) if len(where) else 0
    stage_names = tuple(source_names[i] for i in keep) if source_names and keep else None
    return stages, stage_names, index


def assign_roles(shape: tuple[int, ...], names: tuple[str, ...] | None
                 ) -> tuple[int, int | None, int | None, str | None]:
    """``(shard_dim, replicate_dim, tp_dim, tp_name)`` of a (stage's) mesh from its dimension
    ``names`` (``None``: unnamed). Raises ValueError for a mesh of over 3 dimensions or one
    whose roles cannot be told apart (no names, two TP dimensions...)."""
    described, ndim = f"shape {shape} with dims {names}", len(shape)
    names = names or ()
    if ndim == 1:
        if names and names[0] in TP_NAMES:  # TP only: a DP "group" of one rank per TP rank
            return -1, None, 0, names[0]
        return 0, None, None, None
    if len(names) != ndim:
        raise ValueError(
            f"dmuon: a {ndim}-D mesh needs mesh_dim_names to tell data and tensor parallelism "
            f"apart; got {described}. Build it with init_device_mesh(..., "
            f"mesh_dim_names=('replicate', 'shard') / ('dp', 'tp') / ('replicate', 'shard', 'tp'))."
        )
    tp_dims = [i for i, n in enumerate(names) if n in TP_NAMES]
    if len(tp_dims) > 1 or ndim > 3:
        raise ValueError(f"dmuon: unsupported mesh {described}: at most (replicate, shard, tp)")
    tp_dim = tp_dims[0] if tp_dims else None
    tp_name = names[tp_dim] if tp_dim is not None else None
    data_dims = [i for i in range(ndim) if i != tp_dim]
    if len(data_dims) == 1:
        return data_dims[0], None, tp_dim, tp_name
    if len(data_dims) == 2:
        return data_dims[1], data_dims[0], tp_dim, tp_name
    raise ValueError(f"dmuon: unsupported mesh {described}")


def expert_parallel_dims(mesh) -> tuple[int, int | None, int | None] | None:
    """``(ep_dim, expert_shard_dim, replicate_dim)`` of an ``("ep",)``, ``(shard, "ep")`` or
    ``("replicate", shard, "ep")`` mesh, ``None`` without ``"ep"``; ValueError for any other
    mesh with ``"ep"``."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    ep = [i for i, n in enumerate(names) if n in EP_NAMES]
    if not ep:
        return None
    replicate = ("replicate", "dp_replicate")
    others = [n for n in names if n not in EP_NAMES]
    last = len(ep) == 1 and ep[0] == mesh.ndim - 1
    if last and mesh.ndim == 1:
        return 0, None, None
    if last and mesh.ndim == 2 and others[0] not in TP_NAMES + replicate:
        return 1, 0, None
    if last and mesh.ndim == 3 and others[0] in replicate and others[1] not in TP_NAMES + replicate:
        return 2, 1, 0
    raise ValueError(
        f"dmuon: mesh {_describe(mesh)} combines expert parallelism with dimensions dmuon does not "
        f"take (or does not put 'ep' last); dmuon supports ('ep',), (expert shard, 'ep') and "
        f"('replicate', expert shard, 'ep'), e.g. torchtitan's init_device_mesh(..., (efsdp, ep), "
        f"mesh_dim_names=('efsdp', 'ep')), with the experts Shard(0) over 'ep' and fully_shard on "
        f"'efsdp'. TP together with expert parallelism is not supported yet.")


def _groups_of(rank_lists: list[list[int]], backend: str,
               timeout: timedelta | None) -> dist.ProcessGroup | None:
    """Create one group per rank list, in order; return the one holding this rank."""
    me, mine = dist.get_rank(), None
    for ranks in rank_lists:
        group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
        if me in ranks:
            mine = group
    return mine


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The shortest timeout of ``group``'s backends (default: WORLD), read from the private
    ``options._timeout`` (no public getter), or ``None`` where unreadable."""
    if group is None:
        group = dist.group.WORLD
    found = []
    for device in getattr(group, "_device_types", ()) or ():
        try:
            options = group._get_backend(torch.device(device)).options
        except (AttributeError, RuntimeError, TypeError):
            continue
        timeout = getattr(options, "_timeout", None)
        if isinstance(timeout, timedelta):
            found.append(timeout)
    return min(found) if found else None


def inherited_timeout(mesh) -> timedelta | None:
    """The shortest of the default group's and ``mesh``'s groups' timeouts (``None``: none
    readable, torch's default)."""
    groups = [dist.group.WORLD] + [mesh.get_group(d) for d in range(mesh.ndim)]
    found = [t for t in (group_timeout(g) for g in groups) if t is not None]
    if not found:
        logger.warning("dmuon: cannot read the process groups' timeout in torch %s; dmuon's groups "
                       "use torch's default", torch.__version__)
        return None
    return min(found)


def check_mesh(mesh) -> None:
    """Refuse, without a collective, what is not a ``DeviceMesh`` (TypeError) over (a sub-mesh
    of one over) every rank of the job (ValueError)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, dist.ProcessGroup):
        raise TypeError(
            "dmuon: dedicate_params takes a DeviceMesh as mesh, got a ProcessGroup; wrap it with "
            "DeviceMesh.from_group(group, device_type) or build one with "
            "init_device_mesh(device_type, (world_size,))"
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"dmuon: dedicate_params takes a DeviceMesh as mesh, got "
                        f"{type(mesh).__name__}; build one with init_device_mesh(device_type, (world_size,))")
    ranks = sorted(int(r) for r in _root_mesh(mesh).mesh.flatten().tolist())
    world = dist.get_world_size()
    if ranks != list(range(world)):
        outside = sorted(set(range(world)) - set(ranks))
        raise ValueError(
            f"dmuon: the mesh ({_describe(mesh)}) holds ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''} "
            f"but the job has {world} ranks (ranks {outside[:8]} are outside it; this is rank "
            f"{dist.get_rank()}); dedicate_params needs a mesh over every rank, e.g. "
            f"init_device_mesh(device_type, ({world},))"
        )


def _groups_along(ranks: torch.Tensor, dim: int, backend: str,
                  timeout: timedelta | None) -> dist.ProcessGroup | None:
    """dmuon's own group along ``dim`` of the rank tensor ``ranks`` holding this rank."""
    return _groups_of(ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist(), backend, timeout)


def is_fake_backend(backend: str) -> bool:
    """Whether ``backend`` (``dist.get_backend(group)``) is torch's fake process group."""
    return "fake" in str(backend)


def build_roles(mesh, *, step_check: bool = True) -> MeshRoles:
    """Create dmuon's groups for ``mesh`` with :func:`inherited_timeout` (collective), and the
    step check's gloo group if ``step_check`` (never on the fake backend). An expert-parallel
    mesh is read as ``[replicas, expert shard, ep]``. Raises as :func:`check_mesh`,
    :func:`assign_roles` and :func:`expert_parallel_dims`."""
    check_mesh(mesh)
    backend = dist.get_backend(mesh.get_group(0))
    fake = is_fake_backend(backend)
    timeout = None if fake else inherited_timeout(mesh)  # a fake group waits for nothing
    experts = None
    if expert_parallel_dims(mesh) is not None:
        experts = mesh.mesh.reshape((1,) * (3 - mesh.ndim) + tuple(mesh.mesh.shape))
        replicas, ep = experts.shape[0], experts.shape[2]
        stages = experts.reshape(1, replicas, -1) if replicas > 1 else experts.reshape(1, -1)
        shard_dim, replicate_dim = (1, 0) if replicas > 1 else (0, None)
        tp_dim = tp_name = None
    else:
        stages, names, stage = stage_layout(mesh)
        shard_dim, replicate_dim, tp_dim, tp_name = assign_roles(tuple(stages[stage].shape), names)
        if shard_dim == -1:  # TP only: the shard "dimension" is a size-1 axis in front
            stages = stages.unsqueeze(1)
            shard_dim, tp_dim = 0, 1
    # every rank creates every stage's groups, in stage order
    every = stages.flatten(1).tolist()
    world = _groups_of(every, backend, timeout)
    # gloo even in NCCL jobs: the step check's CPU tensors never synchronize a GPU stream.
    steps = (_groups_of(every, "gloo", timeout)
             if step_check and not fake and dist.is_gloo_available() else None)
    shard = _groups_along(stages, shard_dim + 1, backend, timeout)
    expert = None if experts is None else _groups_along(experts, 1, backend, timeout)
    replicate = None if replicate_dim is None else _groups_along(stages, replicate_dim + 1, backend, timeout)
    tp = None if tp_dim is None else _groups_along(stages, tp_dim + 1, backend, timeout)
    sizes = stages.shape[1:]
    return MeshRoles(
        shard=shard, world=world, replicate=replicate, tp=tp, expert=expert, shard_size=sizes[shard_dim],
        replicate_size=1 if replicate_dim is None else sizes[replicate_dim],
        tp_size=1 if tp_dim is None else sizes[tp_dim], replicate_dim=replicate_dim, tp_name=tp_name,
        steps=steps, fake=fake, pp_size=int(stages.shape[0]), ep_size=1 if experts is None else ep,
        ep_name=None if experts is None else mesh.mesh_dim_names[-1])
