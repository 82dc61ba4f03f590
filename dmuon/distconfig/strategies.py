"""The three config helpers and the functions they install. DTensors are read from their
placements; plain tensors as sharded along ``tp_shard_dim`` over ``tp_pg``, then along dim 0
over ``fsdp_pg``, and replicated elsewhere. :func:`gather_fn` / :func:`redistribute_fn` are the
owner exchange (:mod:`dmuon.comm.exchange`) for one matrix.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import torch.distributed as dist
from torch import Tensor

from dmuon.comm.collectives import all_gather_object
from dmuon.comm.mesh_roles import EP_NAMES, PP_NAMES, TP_NAMES
from dmuon.distconfig.config import DistributedConfig
from dmuon.comm.exchange import gather_to_owners, scatter_from_owners
from dmuon.owners.slices import MatrixLayout, dtensor_layout, local_tensor

#: create_devicemesh_config's names of the dim-0 shard and replica roles ("dp": see there)
SHARD_NAMES = ("fsdp", "shard", "dp_shard")
REPLICATE_NAMES = ("replicate", "dp_replicate", "ddp", "cp")


def _group_ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _independent_group(ep_pg: Any, pp_pg: Any) -> Any:
    """The group of ranks sharing this rank's ep and pp coordinates (collective, all ranks)."""
    key = tuple(dist.get_group_rank(pg, dist.get_rank()) if pg is not None else 0
                for pg in (ep_pg, pp_pg))
    keys = all_gather_object(key, None, "the exchange of the ranks' ep/pp coordinates")
    by_key: dict[tuple, list[int]] = {}
    for rank, k in enumerate(keys):
        by_key.setdefault(tuple(k), []).append(rank)
    if len(by_key) == 1:
        return None
    group, _ = dist.new_subgroups_by_enumeration(sorted(by_key.values()))
    return group


def _plain_layouts(tensors: Sequence[Tensor], state: dict) -> list[MatrixLayout]:
    """Layouts of plain local tensors under the state's fsdp/tp groups (one all-gather of
    shapes and group memberships). RuntimeError if ranks hold different numbers of tensors or
    the pieces do not add up to one full shape."""
    if tensors and state.get("dp_replicas"):
        warnings.warn(
            "dmuon: create_devicemesh_config read the mesh dim 'dp' as replicas of plain "
            "tensors, but dmuon.dedicate_params reads a lone 'dp' as the data-parallel shard "
            "dimension. Name it 'replicate' (replicas) or 'fsdp' (dim-0 shards); the next "
            "release reads a lone 'dp' as 'fsdp'. DTensors are read from their placements.",
            DeprecationWarning, stacklevel=3)
    group, ranks = state["group"], state["group_ranks"]
    fsdp_pg, tp_pg, tp_dim = state.get("fsdp_pg"), state.get("tp_pg"), state.get("tp_shard_dim", 0)
    me = ([tuple(t.shape) for t in tensors],
          _group_ranks(fsdp_pg) if fsdp_pg is not None else [dist.get_rank()],
          _group_ranks(tp_pg) if tp_pg is not None else [dist.get_rank()])
    info = all_gather_object(me, group, "the exchange of plain matrices' local shapes")
    by_global = dict(zip(ranks, info))
    counts = {len(x[0]) for x in info}
    if len(counts) != 1:
        raise RuntimeError(f"dmuon: ranks hold different numbers of plain matrices: {counts}")
    layouts = []
    for i in range(len(tensors)):
        shape = {g: by_global[g][0][i] for g in ranks}  # (rows, cols) of g's local piece
        # rows of g's TP shard: its piece's rows summed over its fsdp group
        block_rows = {g: sum(shape[s][0] for s in by_global[g][1]) for g in ranks}
        slices, fulls = [], set()
        for g in ranks:
            fsdp_group, tp_group = by_global[g][1], by_global[g][2]
            rows, cols = shape[g]
            r0 = sum(shape[s][0] for s in fsdp_group[:fsdp_group.index(g)])
            before = tp_group[:tp_group.index(g)]
            if tp_dim == 0:
                r0 += sum(block_rows[t] for t in before)
                c0, full = 0, (sum(block_rows[t] for t in tp_group), cols)
            else:
                c0 = sum(shape[t][1] for t in before)
                full = (block_rows[g], sum(shape[t][1] for t in tp_group))
            fulls.add(full)
            slices.append((((r0, r0 + rows),) if rows else (), ((c0, c0 + cols),) if cols else ()))
        if len(fulls) != 1:
            raise RuntimeError(
                f"dmuon: plain matrix {i}: the ranks' local shapes {list(shape.values())} imply "
                f"different full shapes {sorted(fulls)} under fsdp_pg/tp_pg (tp_shard_dim="
                f"{tp_dim}); check the groups and tp_shard_dim")
        layouts.append(MatrixLayout.build(fulls.pop(), slices))
    return layouts


def balanced_assign_fn(params: list[Tensor], state: dict) -> dict[int, int]:
    """Default ``assign_fn``: owners balancing Newton-Schulz FLOPs (:func:`dmuon.kernels.ns_flops`,
    ``state["ns_method"]``, 5 steps) greedily; stores ``state["layouts"]`` and ``"full_shapes"``."""
    from dmuon.kernels import ns_flops
    from dmuon.owners.plan import build_plan

    plain = [i for i, p in enumerate(params) if not hasattr(p, "placements")]
    by_index = {i: dtensor_layout(p, state["group_ranks"])
                for i, p in enumerate(params) if hasattr(p, "placements")}
    by_index.update(zip(plain, _plain_layouts([params[i] for i in plain], state)))  # collective
    layouts = [by_index[i] for i in range(len(params))]
    state["layouts"] = layouts
    state["full_shapes"] = [layout.full_shape for layout in layouts]
    if not params:
        return {}
    method = state.get("ns_method", "gram")
    costs = [ns_flops(*layout.full_shape, steps=5, method=method) for layout in layouts]
    plan = build_plan([(f"params.{i}", layout.full_shape) for i, layout in enumerate(layouts)],
                      state["world_size"], costs=costs, method="greedy")
    return {i: m.owner for i, m in enumerate(plan.matrices)}


def gather_fn(momentum_buffer: Tensor, dst_rank: int, state: dict) -> Optional[Tensor]:
    """Full ``[rows, cols]`` matrix on ``dst_rank``, ``None`` elsewhere (one all-to-all), from
    this rank's piece ``momentum_buffer``; remembered for :func:`redistribute_fn`."""
    if hasattr(momentum_buffer, "placements"):
        layout = dtensor_layout(momentum_buffer, state["group_ranks"])
    else:
        layout = _plain_layouts([momentum_buffer], state)[0]
    local = local_tensor(momentum_buffer)
    state.setdefault("gathered", {})[dst_rank] = (layout, local.dtype, local.device)
    return gather_to_owners([local], [layout], [dst_rank], group=state["group"],
                            rank=state["rank"], world_size=state["world_size"],
                            dtype=local.dtype).wait()[0]


def redistribute_fn(update: Optional[Tensor], src_rank: int, state: dict) -> Tensor:
    """This rank's piece of the full ``update`` on ``src_rank``, the matrix :func:`gather_fn`
    last gathered there. RuntimeError without that gather or for a wrong shape."""
    gathered = state.get("gathered", {})
    if src_rank not in gathered:
        raise RuntimeError(f"dmuon: redistribute_fn from rank {src_rank} without a preceding "
                           f"gather_fn to it; the helpers' pair sends back the matrix gathered last")
    layout, dtype, device = gathered.pop(src_rank)
    return scatter_from_owners([update], [layout], [src_rank], group=state["group"],
                               rank=state["rank"], world_size=state["world_size"],
                               dtype=dtype, device=device).wait()[0]


def create_processgroup_config(
    fsdp_pg: Any = None, tp_pg: Any = None, dp_pg: Any = None, ep_pg: Any = None,
    cp_pg: Any = None, pp_pg: Any = None, async_gpu_parallelism: bool = True,
    prefetch_count: int = 1, *, tp_shard_dim: int = 0,
) -> DistributedConfig:
    """``DistributedConfig`` from process groups (collective when ``ep_pg``/``pp_pg`` are given).

    Args:
        fsdp_pg: ranks sharding a plain tensor (or its TP shard) along dim 0.
        tp_pg: ranks sharding a plain tensor along ``tp_shard_dim``.
        dp_pg, cp_pg: replicating ranks (plain tensors are replicas there; nothing to do).
        ep_pg, pp_pg: independent dims: each combination of their coordinates is its own
            optimizer group.
        async_gpu_parallelism, prefetch_count: see :class:`DistributedConfig`.
        tp_shard_dim: 0 (colwise, ``Shard(0)``) or 1 (rowwise, ``Shard(1)``) for plain tensors.

    Raises:
        RuntimeError: before ``init_process_group``.
        ValueError: a bad ``tp_shard_dim``.
    """
    del dp_pg, cp_pg  # replicas need no gathering: the owner's own copy is used
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("dmuon: the config helpers need torch.distributed initialized "
                           "(init_process_group) first")
    if tp_shard_dim not in (0, 1):
        raise ValueError(f"dmuon: tp_shard_dim must be 0 (colwise) or 1 (rowwise); got "
                         f"{tp_shard_dim!r}")
    group = _independent_group(ep_pg, pp_pg) if (ep_pg is not None or pp_pg is not None) else None
    state = dict(group=group, group_ranks=_group_ranks(group), rank=dist.get_rank(group),
                 world_size=dist.get_world_size(group), fsdp_pg=fsdp_pg, tp_pg=tp_pg,
                 tp_shard_dim=tp_shard_dim)
    return DistributedConfig(balanced_assign_fn, gather_fn, redistribute_fn, state,
                             async_gpu_parallelism=async_gpu_parallelism,
                             prefetch_count=prefetch_count)


def create_devicemesh_config(
    device_mesh: Any, mesh_dim_names: Sequence[str], async_gpu_parallelism: bool = True,
    prefetch_count: int = 1, *, tp_shard_dim: int = 0,
) -> DistributedConfig:
    """``DistributedConfig`` from a DeviceMesh whose dims are named by role.

    Args:
        device_mesh: the DeviceMesh the model was parallelized over.
        mesh_dim_names: one role per mesh dim: :data:`SHARD_NAMES` (dim-0 sharding), ``"tp"``,
            :data:`REPLICATE_NAMES` (replicas), ``"ep"`` / ``"pp"`` (independent). ``"dp"``
            beside a shard dim is the replicate dim; a lone ``"dp"`` is still read as replicas
            of plain tensors, with a ``DeprecationWarning``, for one release.
        async_gpu_parallelism, prefetch_count, tp_shard_dim: as
            :func:`create_processgroup_config`.

    Raises:
        ValueError: a wrong number of names or an unknown role (lists the known ones).
    """
    names = list(mesh_dim_names)
    if len(names) != device_mesh.ndim:
        raise ValueError(f"dmuon: mesh_dim_names has {len(names)} names for a "
                         f"{device_mesh.ndim}-D mesh; give one per mesh dim")
    known = SHARD_NAMES + TP_NAMES + REPLICATE_NAMES + ("dp",) + EP_NAMES + PP_NAMES
    groups = dict(fsdp_pg=None, tp_pg=None, ep_pg=None, pp_pg=None)
    for dim, name in enumerate(names):
        if name not in known:
            raise ValueError(f"dmuon: unknown mesh dim role {name!r}; known: {known}")
        role = ("fsdp" if name in SHARD_NAMES else "tp" if name in TP_NAMES else
                "ep" if name in EP_NAMES else "pp" if name in PP_NAMES else None)
        if role is not None:
            groups[f"{role}_pg"] = device_mesh.get_group(dim)
    config = create_processgroup_config(**groups, async_gpu_parallelism=async_gpu_parallelism,
                                        prefetch_count=prefetch_count, tp_shard_dim=tp_shard_dim)
    if "dp" in names and groups["fsdp_pg"] is None:
        config.state["dp_replicas"] = True  # deprecated reading of a lone "dp" (_plain_layouts)
    return config


def create_dtensor_config(async_gpu_parallelism: bool = True,
                          prefetch_count: int = 1) -> DistributedConfig:
    """``DistributedConfig`` for DTensor parameters (``Shard``, ``_StridedShard``, ``Replicate``
    placements over meshes spanning the default group); plain tensors are replicas."""
    return create_processgroup_config(async_gpu_parallelism=async_gpu_parallelism,
                                      prefetch_count=prefetch_count)
