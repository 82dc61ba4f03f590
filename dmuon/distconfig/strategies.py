"""The three config helpers and the functions they install.

All three read DTensor placements (``Shard``, ``_StridedShard``, ``Replicate``) from the tensors
themselves, so FSDP2, HSDP, TP and FSDP x TP parameters need nothing else. They differ only in
how *plain* tensors are understood:

* :func:`create_processgroup_config`: a plain tensor is sharded along ``tp_shard_dim`` over
  ``tp_pg`` (its TP shard), that shard along dim 0 over ``fsdp_pg`` (contiguous, uneven
  allowed, as FSDP shards), and replicated over every other rank (``dp_pg``, ``cp_pg``).
* :func:`create_devicemesh_config`: the same, with the groups taken from named mesh dims.
* :func:`create_dtensor_config`: plain tensors are replicas (DDP).

``ep_pg`` / ``pp_pg`` (and mesh dims named ``"ep"``/``"pp"``) mark *independent* dimensions:
ranks that differ there hold different parameters, so each combination of their coordinates
forms its own optimizer group (created here with ``new_subgroups_by_enumeration``, a
collective over all ranks).

The default ``assign_fn`` balances Newton-Schulz FLOPs (:func:`dmuon.kernels.ns_flops`) over
the ranks with :func:`dmuon.owners.plan.build_plan` (``method="greedy"``: LPT, deterministic, so
every rank computes the same owners without communicating).
"""

from __future__ import annotations

import collections
import inspect
import logging
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.distconfig.exchange import gather_to_owners, scatter_from_owners
from dmuon.distconfig.config import DistributedConfig
from dmuon.owners.slices import MatrixLayout, dtensor_layout, local_tensor

logger = logging.getLogger(__name__)

_SHARD_NAMES = ("fsdp", "shard", "dp_shard")
_REPLICATE_NAMES = ("dp", "ddp", "replicate", "dp_replicate", "cp")
_INDEPENDENT_NAMES = ("ep", "pp")


def _is_dtensor(t: Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "placements")


def _group_ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _independent_group(ep_pg: Any, pp_pg: Any) -> Any:
    """The group of ranks sharing this rank's ep and pp coordinates (collective, all ranks)."""
    key = tuple(dist.get_group_rank(pg, dist.get_rank()) if pg is not None else 0
                for pg in (ep_pg, pp_pg))
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, key)
    by_key: dict[tuple, list[int]] = {}
    for rank, k in enumerate(keys):
        by_key.setdefault(tuple(k), []).append(rank)
    if len(by_key) == 1:
        return None
    group, _ = dist.new_subgroups_by_enumeration(sorted(by_key.values()))
    return group


def _plain_layouts(tensors: Sequence[Tensor], state: dict) -> list[MatrixLayout]:
    """Layouts of plain (non-DTensor) local tensors under the state's fsdp/tp groups.

    Collective over the optimizer group: every rank shares its local shapes and its fsdp/tp
    group memberships (one ``all_gather_object``).

    Raises:
        RuntimeError: ranks disagree on the number of tensors, or the pieces do not add up to
            one full shape.
    """
    group, ranks = state["group"], state["group_ranks"]
    fsdp_pg, tp_pg, tp_dim = state.get("fsdp_pg"), state.get("tp_pg"), state.get("tp_shard_dim", 0)
    me = (
        [tuple(t.shape) for t in tensors],
        _group_ranks(fsdp_pg) if fsdp_pg is not None else [dist.get_rank()],
        _group_ranks(tp_pg) if tp_pg is not None else [dist.get_rank()],
    )
    info: list[Any] = [None] * len(ranks)
    dist.all_gather_object(info, me, group=group)
    by_global = dict(zip(ranks, info))
    counts = {len(x[0]) for x in info}
    if len(counts) != 1:
        raise RuntimeError(f"dmuon: ranks hold different numbers of plain matrices: {counts}")
    layouts = []
    for i in range(len(tensors)):
        def rows(g: int) -> int:
            return by_global[g][0][i][0]

        def cols(g: int) -> int:
            return by_global[g][0][i][1]

        def block_rows(g: int) -> int:  # rows of g's TP shard, summed over its fsdp group
            return sum(rows(s) for s in by_global[g][1])

        slices, fulls = [], set()
        for g in ranks:
            fsdp_group, tp_group = by_global[g][1], by_global[g][2]
            r0 = sum(rows(s) for s in fsdp_group[:fsdp_group.index(g)])
            before = tp_group[:tp_group.index(g)]
            if tp_dim == 0:
                r0 += sum(block_rows(t) for t in before)
                full = (sum(block_rows(t) for t in tp_group), cols(g))
                c0 = 0
            else:
                c0 = sum(cols(t) for t in before)
                full = (block_rows(g), sum(cols(t) for t in tp_group))
            fulls.add(full)
            r_runs = ((r0, r0 + rows(g)),) if rows(g) else ()
            c_runs = ((c0, c0 + cols(g)),) if cols(g) else ()
            slices.append((r_runs, c_runs))
        if len(fulls) != 1:
            raise RuntimeError(
                f"dmuon: plain matrix {i}: the ranks' local shapes "
                f"{[by_global[g][0][i] for g in ranks]} imply different full shapes {sorted(fulls)} "
                f"under fsdp_pg/tp_pg (tp_shard_dim={tp_dim}); check the groups and tp_shard_dim")
        layouts.append(MatrixLayout.build(fulls.pop(), slices))
    return layouts


def compute_layouts(params: Sequence[Tensor], state: dict) -> list[MatrixLayout]:
    """Every matrix's :class:`MatrixLayout` (collective when some are plain tensors)."""
    layouts: list[Optional[MatrixLayout]] = [None] * len(params)
    plain = []
    for i, p in enumerate(params):
        if _is_dtensor(p):
            layouts[i] = dtensor_layout(p, state["group_ranks"])
        else:
            plain.append(i)
    for i, layout in zip(plain, _plain_layouts([params[i] for i in plain], state)):
        layouts[i] = layout
    return layouts  # type: ignore[return-value]


def balanced_assign_fn(params: list[Tensor], state: dict) -> dict[int, int]:
    """Default ``assign_fn``: owners that balance Newton-Schulz FLOPs over the group's ranks.

    Stores ``state["layouts"]`` and ``state["full_shapes"]`` for the other functions. Cost of a
    ``[rows, cols]`` matrix: :func:`dmuon.kernels.ns_flops` with ``state["ns_method"]``
    (default ``"gram"``) and 5 steps; owners from the one plan author,
    :func:`dmuon.owners.plan.build_plan` (``method="greedy"``: deterministic, identical on every
    rank without communicating). Matrices are named by their index in ``params``.
    """
    from dmuon.kernels import ns_flops
    from dmuon.owners.plan import build_plan

    layouts = compute_layouts(params, state)
    state["layouts"] = layouts
    state["full_shapes"] = [layout.full_shape for layout in layouts]
    if not params:
        return {}
    method = state.get("ns_method", "gram")
    costs = [ns_flops(*layout.full_shape, steps=5, method=method) for layout in layouts]
    plan = build_plan([(f"params.{i}", layout.full_shape) for i, layout in enumerate(layouts)],
                      state["world_size"], costs=costs, method="greedy")
    return {i: m.owner for i, m in enumerate(plan.matrices)}


def _layout_of(t: Tensor, state: dict) -> MatrixLayout:
    if _is_dtensor(t):
        key = (tuple(t.shape), tuple(t.placements), id(t.device_mesh))
        cache = state.setdefault("layout_cache", {})
        if key not in cache:
            cache[key] = dtensor_layout(t, state["group_ranks"])
        return cache[key]
    return _plain_layouts([t], state)[0]  # collective: plain shards carry no global shape


def gather_fn(momentum_buffer: Tensor, dst_rank: int, state: dict, async_op: bool = False) -> Any:
    """Full ``[rows, cols]`` matrix on ``dst_rank``, ``None`` elsewhere (one all-to-all).

    Args:
        momentum_buffer: this rank's shard or replica (DTensor or plain local tensor); not
            mutated. Plain tensors cost one extra ``all_gather_object`` of shapes per call
            (the optimizer's batched path does not).
        dst_rank: owner, a rank of ``state["group"]``.
        state: the config's state.
        async_op: return a handle whose ``wait()`` gives the result.

    Remembers the matrix's layout so that the next :func:`redistribute_fn` call (on every rank,
    in the same order as the gathers) knows the pieces.
    """
    layout = _layout_of(momentum_buffer, state)
    local = local_tensor(momentum_buffer)
    state.setdefault("inflight", collections.deque()).append((layout, local.dtype, local.device))
    pending = gather_to_owners([local], [layout], [dst_rank], group=state["group"],
                               rank=state["rank"], world_size=state["world_size"],
                               dtype=local.dtype, async_op=async_op)
    return _first(pending) if async_op else pending.wait()[0]


def redistribute_fn(update: Optional[Tensor], src_rank: int, state: dict, async_op: bool = False) -> Any:
    """This rank's piece of the full ``update`` held by ``src_rank`` (``None`` elsewhere).

    Serves matrices in the order :func:`gather_fn` saw them.

    Raises:
        RuntimeError: no gather preceded this call, or ``update`` has the wrong shape.
    """
    inflight = state.get("inflight")
    if not inflight:
        raise RuntimeError("dmuon: redistribute_fn called without a preceding gather_fn; the "
                           "helper configs pair each redistribute with the oldest gather")
    layout, dtype, device = inflight.popleft()
    pending = scatter_from_owners([update], [layout], [src_rank], group=state["group"],
                                  rank=state["rank"], world_size=state["world_size"],
                                  dtype=dtype, device=device, async_op=async_op)
    return _first(pending) if async_op else pending.wait()[0]


class _first:
    """Handle over a one-matrix :class:`~dmuon.comm.collectives.Pending`: ``wait()`` -> item 0."""

    __slots__ = ("pending",)

    def __init__(self, pending: Any) -> None:
        self.pending = pending

    def wait(self) -> Any:
        return self.pending.wait()[0]


def batch_gather_fn(tensors: list[Tensor], indices: list[int], dst_ranks: list[int], state: dict,
                    dtype: torch.dtype, async_op: bool = True) -> Any:
    """One all-to-all for a round: local pieces of matrices ``indices`` to their owners."""
    layouts = [state["layouts"][i] for i in indices]
    return gather_to_owners(tensors, layouts, dst_ranks, group=state["group"], rank=state["rank"],
                            world_size=state["world_size"], dtype=dtype, async_op=async_op)


def batch_redistribute_fn(updates: list[Optional[Tensor]], indices: list[int], src_ranks: list[int],
                          state: dict, dtype: torch.dtype, device: torch.device,
                          async_op: bool = True) -> Any:
    """One all-to-all for a round: each owner's full updates back to every rank's piece."""
    layouts = [state["layouts"][i] for i in indices]
    return scatter_from_owners(updates, layouts, src_ranks, group=state["group"], rank=state["rank"],
                               world_size=state["world_size"], dtype=dtype, device=device,
                               async_op=async_op)


def supports_async(fn: Any) -> bool:
    """Whether ``fn`` takes an ``async_op`` keyword (then it returns a handle with ``wait()``)."""
    try:
        return "async_op" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _make_config(group: Any, *, fsdp_pg: Any = None, tp_pg: Any = None, tp_shard_dim: int = 0,
                 async_gpu_parallelism: bool, prefetch_count: int) -> DistributedConfig:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("dmuon: the config helpers need torch.distributed initialized "
                           "(init_process_group) first")
    if tp_shard_dim not in (0, 1):
        raise ValueError(f"dmuon: tp_shard_dim must be 0 (colwise) or 1 (rowwise); got {tp_shard_dim!r}")
    state = dict(group=group, group_ranks=_group_ranks(group), rank=dist.get_rank(group),
                 world_size=dist.get_world_size(group), fsdp_pg=fsdp_pg, tp_pg=tp_pg,
                 tp_shard_dim=tp_shard_dim)
    return DistributedConfig(
        assign_fn=balanced_assign_fn, gather_fn=gather_fn, redistribute_fn=redistribute_fn,
        state=state, async_gpu_parallelism=async_gpu_parallelism, prefetch_count=prefetch_count,
        batch_gather_fn=batch_gather_fn, batch_redistribute_fn=batch_redistribute_fn)


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

    DTensors are always read from their placements. Raises ``RuntimeError`` before
    ``init_process_group`` and ``ValueError`` on a bad ``tp_shard_dim``.
    """
    del dp_pg, cp_pg  # replicas need no gathering: the owner's own copy is used
    group = _independent_group(ep_pg, pp_pg) if (ep_pg is not None or pp_pg is not None) else None
    return _make_config(group, fsdp_pg=fsdp_pg, tp_pg=tp_pg, tp_shard_dim=tp_shard_dim,
                        async_gpu_parallelism=async_gpu_parallelism, prefetch_count=prefetch_count)


def create_devicemesh_config(
    device_mesh: Any, mesh_dim_names: Sequence[str], async_gpu_parallelism: bool = True,
    prefetch_count: int = 1, *, tp_shard_dim: int = 0,
) -> DistributedConfig:
    """``DistributedConfig`` from a DeviceMesh whose dims are named by role.

    Args:
        device_mesh: the DeviceMesh the model was parallelized over.
        mesh_dim_names: one role per mesh dim: ``"fsdp"``/``"shard"``/``"dp_shard"`` (dim-0
            sharding), ``"tp"``, ``"dp"``/``"ddp"``/``"replicate"``/``"dp_replicate"``/``"cp"``
            (replicas), ``"ep"``/``"pp"`` (independent).
        async_gpu_parallelism, prefetch_count, tp_shard_dim: as
            :func:`create_processgroup_config`.

    Raises:
        ValueError: a wrong number of names or an unknown role (lists the known ones).
    """
    names = list(mesh_dim_names)
    if len(names) != device_mesh.ndim:
        raise ValueError(f"dmuon: mesh_dim_names has {len(names)} names for a {device_mesh.ndim}-D "
                         f"mesh; give one per mesh dim")
    groups = dict(fsdp_pg=None, tp_pg=None, ep_pg=None, pp_pg=None)
    for dim, name in enumerate(names):
        pg = device_mesh.get_group(dim)
        if name in _SHARD_NAMES:
            groups["fsdp_pg"] = pg
        elif name == "tp":
            groups["tp_pg"] = pg
        elif name in _INDEPENDENT_NAMES:
            groups[f"{name}_pg"] = pg
        elif name not in _REPLICATE_NAMES:
            raise ValueError(f"dmuon: unknown mesh dim role {name!r}; known: "
                             f"{_SHARD_NAMES + ('tp',) + _REPLICATE_NAMES + _INDEPENDENT_NAMES}")
    return create_processgroup_config(**groups, async_gpu_parallelism=async_gpu_parallelism,
                                      prefetch_count=prefetch_count, tp_shard_dim=tp_shard_dim)


def create_dtensor_config(async_gpu_parallelism: bool = True, prefetch_count: int = 1) -> DistributedConfig:
    """``DistributedConfig`` for DTensor parameters: strategy read from each placement.

    ``Shard`` (FSDP2, TP), ``_StridedShard`` (FSDP x TP) and ``Replicate`` (HSDP's replicate dim)
    are supported; plain tensors are treated as replicas. Every DTensor's mesh must span the
    default group.
    """
    return _make_config(None, async_gpu_parallelism=async_gpu_parallelism,
                        prefetch_count=prefetch_count)
