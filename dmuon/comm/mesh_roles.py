"""Mesh roles: which DeviceMesh dimension is data-parallel shard, replicate, or tensor-parallel.

Roles come from ``mesh_dim_names``: a dimension named ``"tp"`` is tensor parallel; of the
others, a single one is the data-parallel *shard* dimension (FSDP, or plain replicas), two are
``(replicate, shard)`` in that order (HSDP, as ``init_device_mesh(..., ("replicate", "shard"))``
builds them). A 1-D mesh without names is data-parallel. dmuon creates its own process groups
along each role so its broadcasts and reduces never interleave with FSDP2's collectives.

Expert parallelism (a dimension named ``"ep"``, as torchtitan names it): the mesh is the one
the experts live on, ``("ep",)`` or ``(expert shard, "ep")`` (torchtitan's ``("efsdp", "ep")``
or ``("dp_shard_mod_ep", "ep")``), optionally with HSDP's ``"replicate"`` in front: experts
``Shard(0)`` over ``"ep"``, FSDP2 over the other dim. Every rank of a replica is a
data-parallel rank for the dense matrices, so their owners are drawn from all of them
(``shard`` is the group over the replica, in its row-major order); an expert stack's owners are
drawn from the ranks of the replica that hold the same experts, those sharing this rank's
``"ep"`` coordinate (``expert``).

Pipeline parallelism (a dimension named ``"pp"``, as torchtitan names it): pp ranks are
*stages*, not replicas. ``dedicate_params(stage_module, mesh)`` takes the whole mesh
(``("pp", "dp")``, ``("pp", "replicate", "shard")``...) or the stage's sub-mesh (``mesh["dp"]``,
``mesh["replicate", "shard"]``, sliced from such a mesh); the ``"pp"`` dimension is dropped and
the roles are read from the rest, so every group, the plan and its digest check, and the step
check live within the stage's data-parallel ranks (:func:`stage_layout`). Every rank still
creates every stage's groups in the same order (``dist.new_group`` names a group by a counter that
must agree on its members), which needs no communication: the stages may call
``dedicate_params`` at different times, as long as each rank calls it equally often (once per
stage module it holds, as every pipelining schedule gives every rank the same number).

Every group dmuon creates inherits the user's collective timeout (:func:`inherited_timeout`):
``dist.new_group`` without ``timeout=`` would wait torch's default 30 minutes (gloo) whatever
``init_process_group(timeout=...)`` said, so a desynchronised rank would hang the job.
"""

from __future__ import annotations

import itertools
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
    """dmuon's groups for one rank.

    Attributes:
        shard: group over the DP shard dimension (owners live here: publish, reduce-to-owner).
        world: group over the whole mesh, or the stage's ranks under pipeline parallelism
            (plan agreement, gradient norm).
        replicate: group over the HSDP replicate dimension, or ``None``.
        tp: group over the tensor-parallel dimension, or ``None``.
        shard_dim, replicate_dim, tp_dim: the mesh dimensions of each role (``None`` if absent).
        tp_name: the mesh dimension name of the TP role.
        steps: group over the whole mesh (the stage's ranks) for the step-agreement check only
            (:mod:`dmuon.hooks.step_check`), so its all-reduce can never pair with another
            collective of a rank that is out of step.
        timeout: the collective timeout every dmuon group was created with (``None``: torch's
            default, when no group's timeout could be read).
        fake: the mesh runs on torch's fake process group (backend ``"fake"``,
            ``torch.testing._internal.distributed.fake_pg``): one process plays one rank, its
            collectives return at once with nothing received, so nothing that needs a live peer
            (the step check, a plan broadcast, a digest exchange) is created or issued.
        expert: expert parallelism only: the group of the ranks sharing this rank's ``"ep"``
            coordinate (they hold the same experts): an expert stack's owners, publication and
            reduce-to-owner live here. ``None`` without an ``"ep"`` dimension.
        ep_size: size of the ``"ep"`` dimension (1 without one).
        ep_name: the mesh dimension name of expert parallelism, or ``None``.
        pp_size: number of pipeline stages (the size of the ``"pp"`` dimension; 1 without one).
            Every other attribute is the stage's: ``world`` and ``steps`` span the stage's
            data-parallel ranks only.
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
    steps: dist.ProcessGroup | None = None
    timeout: timedelta | None = None
    fake: bool = False
    expert: dist.ProcessGroup | None = None
    ep_size: int = 1
    ep_name: str | None = None
    pp_size: int = 1

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


@dataclass(frozen=True)
class _MeshView:
    """The part of a ``DeviceMesh`` role assignment reads: its rank tensor and dimension names
    (one pipeline stage's, :func:`stage_layout`)."""

    mesh: torch.Tensor
    mesh_dim_names: tuple[str, ...] | None

    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)


def _root_mesh(mesh):
    """The mesh ``mesh`` was sliced from (itself if not a slice); torch 2.11+ ``_get_root_mesh``,
    older ``_mesh_resources.get_root_mesh``."""
    getter = getattr(mesh, "_get_root_mesh", None)
    if getter is not None:
        return getter()
    try:  # pragma: no cover - older torch
        from torch.distributed.device_mesh import _mesh_resources

        return _mesh_resources.get_root_mesh(mesh)
    except (ImportError, AttributeError):  # pragma: no cover
        return mesh


def stage_layout(mesh) -> tuple[torch.Tensor, tuple[str, ...] | None, int]:
    """Every pipeline stage's data-parallel ranks, for the whole mesh or a stage's sub-mesh.

    Args:
        mesh: the ``DeviceMesh`` given to ``dedicate_params``: a mesh with a ``"pp"`` dimension
            (``("pp", "dp")``...), a sub-mesh sliced from one (``mesh["dp"]``, which holds only
            its own stage's ranks), or any mesh without pipeline parallelism.

    Returns:
        ``(stages, names, index)``: ``stages`` ``[n_stages, *stage shape]`` int64, the global
        ranks of every stage in stage order (``n_stages`` is 1 without ``"pp"``); ``names``
        the stage's dimension names (the mesh's without ``"pp"``; ``None`` for an unnamed
        mesh); ``index`` this rank's stage.

    Raises:
        ValueError: a sub-mesh whose parent mesh has dimensions other than ``"pp"`` that the
            sub-mesh drops (``mesh["shard"]`` of an HSDP mesh would lose the replicas: pass
            the whole ``("replicate", "shard")`` mesh), or a mesh whose stages cannot be told
            apart (a 0-D mesh).
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    root = _root_mesh(mesh)
    source, source_names = mesh.mesh, names
    # A mesh holding all of its root's ranks drops nothing (torchtitan unflattens one 1-D
    # "world" mesh into its ("fsdp",)... meshes): no stage to find, take it as it is.
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


def assign_roles(mesh) -> tuple[int, int | None, int | None, str | None]:
    """``(shard_dim, replicate_dim, tp_dim, tp_name)`` of a mesh, from its dimension names.

    Raises:
        ValueError: a mesh of more than 3 dimensions, or one whose roles cannot be told apart
            (a 2-D or 3-D mesh without names, two TP dimensions...).
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    ndim = mesh.ndim
    if any(n in EP_NAMES for n in names):  # expert parallelism: see expert_parallel_dims
        raise ValueError(f"dmuon: mesh {_describe(mesh)} has an expert-parallel dimension; "
                         f"its roles come from expert_parallel_dims")
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


def expert_parallel_dims(mesh) -> tuple[int, int | None, int | None] | None:
    """``(ep_dim, expert_shard_dim, replicate_dim)`` of a mesh with an expert-parallel
    dimension (``None`` without one): ``("ep",)`` (no expert shard dim: every rank holds its
    own experts alone), ``(shard, "ep")`` with any non-TP, non-replicate name for the shard dim
    (torchtitan's ``("efsdp", "ep")`` / ``("dp_shard_mod_ep", "ep")``), or HSDP in front,
    ``("replicate", shard, "ep")`` (torchtitan's ``("dp_replicate", "efsdp", "ep")``).

    Raises:
        ValueError: any other mesh with an ``"ep"`` dimension (TP with expert parallelism, or
            ``"ep"`` not last), naming the mesh and what is supported.
    """
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


def _groups_of(rank_lists: list[list[int]], backend: str, timeout: timedelta | None) -> dist.ProcessGroup | None:
    """Create one group per rank list (every rank creates every group, in the same order:
    collective) and return the one holding this rank."""
    me, mine = dist.get_rank(), None
    for ranks in rank_lists:
        group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
        if me in ranks:
            mine = group
    return mine


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The collective timeout a process group was created with, or ``None`` if unreadable.

    torch has no public getter; torch 2.13 keeps it in each backend's options
    (``ProcessGroupGloo.options._timeout``, ``ProcessGroupNCCL.options._timeout``), which is
    what this reads (tested on 2.13 only; on a torch without them it returns ``None`` and dmuon
    falls back to torch's default timeout, with a warning).

    Args:
        group: a process group; ``None``: the default group.

    Returns:
        The shortest timeout of the group's backends (seconds resolution as given by the user).
    """
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
    """The timeout dmuon's groups for ``mesh`` get: the shortest of the default group's and the
    mesh's own groups' timeouts (a 2-D ``init_device_mesh`` creates its sub-groups with torch's
    default timeout, so the default group's carries the user's ``init_process_group`` setting).

    Returns:
        That timeout, or ``None`` (torch's default) when no group's timeout can be read.
    """
    groups = [dist.group.WORLD] + [mesh.get_group(d) for d in range(mesh.ndim)]
    found = [t for t in (group_timeout(g) for g in groups) if t is not None]
    if not found:
        logger.warning("dmuon: cannot read the process groups' timeout in torch %s; dmuon's groups "
                       "use torch's default", torch.__version__)
        return None
    return min(found)


def check_mesh(mesh) -> None:
    """Refuse what is not a ``DeviceMesh`` over every rank of the job (a pipeline stage's
    sub-mesh: its parent mesh), on every rank.

    Local and identical on every rank (no collective), so no rank is left waiting.

    Raises:
        TypeError: ``mesh`` is a ``ProcessGroup`` or anything else that is not a ``DeviceMesh``.
        ValueError: the mesh does not hold every rank of the default group (a rank outside it
            would otherwise fail alone, the others waiting in dmuon's group creation).
    """
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


def _groups_along(mesh_ranks, dim: int | None, backend: str,
                  timeout: timedelta | None = None) -> dist.ProcessGroup | None:
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
    return _groups_of(rank_lists, backend, timeout)


def is_fake_backend(backend: str) -> bool:
    """Whether ``backend`` (``dist.get_backend(group)``) is torch's fake process group, whose
    collectives return at once without any peer (one process playing one rank of a large job)."""
    return "fake" in str(backend)


def build_roles(mesh, *, step_check: bool = True) -> MeshRoles:
    """Create dmuon's groups for ``mesh`` (collective: every rank of the world calls it).

    Every group gets :func:`inherited_timeout`, so every dmuon collective fails within the
    user's timeout instead of torch's 30-minute default.

    Args:
        mesh: the ``DeviceMesh``.
        step_check: create the step check's gloo group (:mod:`dmuon.hooks.step_check`). It is
            not created without the check, nor on the fake backend (a gloo group cannot be made
            over a fake store, and a check against peers that do not exist cannot agree).

    Raises:
        TypeError, ValueError: see :func:`check_mesh` and :func:`assign_roles`.
    """
    check_mesh(mesh)
    backend = dist.get_backend(mesh.get_group(0))
    fake = is_fake_backend(backend)
    timeout = None if fake else inherited_timeout(mesh)  # a fake group waits for nothing
    ep_dims = expert_parallel_dims(mesh)
    if ep_dims is not None:
        return _expert_parallel_roles(mesh, ep_dims, backend, timeout, fake, step_check)
    stages, names, stage = stage_layout(mesh)
    shard_dim, replicate_dim, tp_dim, tp_name = assign_roles(_MeshView(stages[stage], names))
    if shard_dim == -1:  # TP only: the shard "dimension" is a size-1 axis in front
        stages = stages.unsqueeze(1)
        shard_dim, tp_dim = 0, 1
    # every rank creates every stage's groups, in stage order (one stage without "pp": the
    # groups and their order are those of a mesh without pipeline parallelism)
    every = [[int(r) for r in ranks.flatten().tolist()] for ranks in stages]
    world = _groups_of(every, backend, timeout)
    # gloo even in NCCL jobs: the step check's CPU tensors never synchronize a GPU stream.
    steps = (_groups_of(every, "gloo", timeout)
             if step_check and not fake and dist.is_gloo_available() else None)
    return MeshRoles(
        shard=_groups_along(stages, shard_dim + 1, backend, timeout), world=world,
        replicate=_groups_along(stages, None if replicate_dim is None else replicate_dim + 1, backend, timeout),
        tp=_groups_along(stages, None if tp_dim is None else tp_dim + 1, backend, timeout),
        shard_dim=shard_dim, replicate_dim=replicate_dim, tp_dim=tp_dim, tp_name=tp_name,
        shape=tuple(stages.shape[1:]), steps=steps, timeout=timeout, fake=fake, pp_size=int(stages.shape[0]),
    )


def _expert_parallel_roles(mesh, ep_dims: tuple[int, int | None, int | None], backend: str,
                           timeout: timedelta | None, fake: bool, step_check: bool) -> MeshRoles:
    """:func:`build_roles` on an expert-parallel mesh (collective). Seen as ``[replicas, expert
    shard, ep]``: the dense matrices' shard group is a replica's ranks (row-major over expert
    shard x ep), the experts' group a replica's ranks of one ep coordinate, the replicate group
    (HSDP) the ranks of one (expert shard, ep) position."""
    ep_dim, expert_dim, replicate_dim = ep_dims
    ranks = mesh.mesh
    if expert_dim is None:
        ranks = ranks.unsqueeze(0)
    if replicate_dim is None:
        ranks = ranks.unsqueeze(0)
    replicas, experts, ep = (int(n) for n in ranks.shape)
    every = [int(r) for r in ranks.flatten().tolist()]
    world = dist.new_group(ranks=every, backend=backend, timeout=timeout)
    steps = (dist.new_group(ranks=every, backend="gloo", timeout=timeout)
             if step_check and not fake and dist.is_gloo_available() else None)
    shard = _groups_of([[int(x) for x in ranks[r].flatten().tolist()] for r in range(replicas)], backend, timeout)
    expert = _groups_of([[int(x) for x in ranks[r, :, c].tolist()] for r in range(replicas) for c in range(ep)],
                        backend, timeout)
    replicate = (_groups_of([[int(x) for x in ranks[:, e, c].tolist()] for e in range(experts) for c in range(ep)],
                            backend, timeout) if replicas > 1 else None)
    names = tuple(mesh.mesh_dim_names)
    return MeshRoles(shard=shard, world=world, replicate=replicate, tp=None,
                     shard_dim=1 if replicate is not None else 0,
                     replicate_dim=0 if replicate is not None else None, tp_dim=None, tp_name=None,
                     shape=(replicas, experts * ep) if replicate is not None else (experts * ep,),
                     steps=steps, timeout=timeout, fake=fake, expert=expert, ep_size=ep,
                     ep_name=names[ep_dim])
