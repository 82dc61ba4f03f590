"""Rank functions for tests/test_distconfig.py (run by the gloo pool, see tests/_pool.py).

Parameters are built per strategy with torch's own tools (fully_shard, distribute_tensor,
parallelize_module); references are the unsharded seeded tensors (sharded again by the same tools), and
single-process ``torch.optim.Muon`` + ``AdamW`` on the full tensors.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from dmuon.distconfig import (
    create_devicemesh_config,
    create_dtensor_config,
    create_processgroup_config,
)
from dmuon.comm.exchange import gather_to_owners, scatter_from_owners
from tests import models

EXACT = dict(ns_method="standard", ns_dtype=torch.float32, ns_coefficients="muon")
#: strategies whose parameters are an nn.Module's, parallelized by torch's tools
MODULE_STRATEGIES = ("fsdp", "hsdp", "hsdp_dp", "fsdp_tp", "fsdp_tp_dp")


def _net(init: Any = None) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 7), nn.Linear(7, 5), nn.Linear(5, 9))
    if init is not None:  # (weights, biases), full tensors
        with torch.no_grad():
            for m, w, b in zip(net, *init):
                m.weight.copy_(w)
                m.bias.copy_(b)
    return net


def initial_fulls(strategy: str) -> tuple[list, list]:
    """The full initial (matrices, vectors) of ``strategy`` (seeded, identical on every rank)."""
    if strategy in MODULE_STRATEGIES:
        net = _net()
        return [m.weight.detach().clone() for m in net], [m.bias.detach().clone() for m in net]
    g = torch.Generator().manual_seed(7)
    return ([torch.randn(7, 6, generator=g), torch.randn(5, 7, generator=g), torch.randn(9, 5, generator=g)],
            [torch.randn(5, generator=g)])


def build(strategy: str, world_size: int, init: Any = None) -> tuple[list, list, list, Any]:
    """``(matrices, vectors, full matrices, config)``; ``init``: full (matrices, vectors) to
    shard instead of the seeded ones (to shard a reference result the same way)."""
    init = initial_fulls(strategy) if init is None else init
    if strategy in MODULE_STRATEGIES:
        net = _net(init)
        if strategy == "fsdp":
            mesh = init_device_mesh("cpu", (world_size,))
            fully_shard(net, mesh=mesh)
            cfg = create_dtensor_config()
        elif strategy in ("hsdp", "hsdp_dp"):  # "dp" beside a shard dim: the replicate dim
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard"))
            fully_shard(net, mesh=mesh)
            cfg = create_devicemesh_config(mesh, ["replicate" if strategy == "hsdp" else "dp", "fsdp"])
        else:  # fsdp_tp_dp: the seed's test plan's names, ("dp", "tp")
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel(),
                                                 "2": ColwiseParallel()})
            fully_shard(net, mesh=mesh["dp"])
            cfg = create_devicemesh_config(mesh, ["fsdp" if strategy == "fsdp_tp" else "dp", "tp"])
        mats = [m.weight for m in net]
        vecs = [m.bias for m in net]
        # Reference: the unsharded weights (FSDP2's local shards are the truth; DTensor's
        # full_tensor() does not reassemble uneven _StridedShard as FSDP2 stores it).
        return mats, vecs, list(init[0]), cfg
    fulls, vecs = [t.clone() for t in init[0]], [t.clone() for t in init[1]]
    rank = dist.get_rank()
    if strategy in ("tp0", "tp1"):
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        dim = int(strategy[-1])
        mats = [nn.Parameter(distribute_tensor(f, mesh, [Shard(dim)])) for f in fulls]
        return mats, [nn.Parameter(v) for v in vecs], [None] * 3, create_devicemesh_config(mesh, ["tp"])
    if strategy in ("ddp", "ddp_dp"):  # ddp_dp: a lone "dp" mesh dim (deprecated: replicas)
        if strategy == "ddp":
            cfg = create_processgroup_config(dp_pg=dist.group.WORLD)
        else:
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
            cfg = create_devicemesh_config(mesh, ["dp"])
        return [nn.Parameter(f.clone()) for f in fulls], [nn.Parameter(v) for v in vecs], fulls, cfg
    if strategy == "plain_fsdp":  # dim-0 chunks over all ranks, uneven and empty included
        mats = [nn.Parameter(_chunk(f, 0, world_size, rank)) for f in fulls]
        return mats, [nn.Parameter(v) for v in vecs], fulls, create_processgroup_config(fsdp_pg=dist.group.WORLD)
    if strategy == "plain_fsdp_tp":  # TP on cols (rowwise), FSDP on rows of each TP shard
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_coordinate()
        mats = [nn.Parameter(_chunk(_chunk(f, 1, mesh.size(1), tp), 0, mesh.size(0), dp)) for f in fulls]
        cfg = create_processgroup_config(fsdp_pg=mesh.get_group(0), tp_pg=mesh.get_group(1), tp_shard_dim=1)
        return mats, [nn.Parameter(v) for v in vecs], fulls, cfg
    raise ValueError(strategy)


def _chunk(t: torch.Tensor, dim: int, n: int, i: int) -> torch.Tensor:
    parts = list(torch.chunk(t, n, dim=dim))
    if i < len(parts):
        return parts[i].clone()
    shape = list(t.shape)
    shape[dim] = 0
    return t.new_zeros(shape)


def _full(t: torch.Tensor, ref: Any) -> torch.Tensor:
    return t.full_tensor() if ref is None else ref


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def gather_redistribute(rank: int, world_size: int, strategy: str) -> dict:
    """Per-matrix gather_fn/redistribute_fn to every dst, then the round exchange dmuon.Muon uses
    with the helpers' functions (all matrices in one all_to_all each way)."""
    mats, _, refs, cfg = build(strategy, world_size)
    errors, nones = [], []
    full_refs = [_full(t.detach(), ref) for t, ref in zip(mats, refs)]  # collective: all ranks
    for t, full in zip(mats, full_refs):
        for dst in range(world_size):
            got = cfg.gather_fn(t.detach(), dst, cfg.state)
            if rank == dst:
                errors.append(float((got - full).abs().max()) if got is not None else float("inf"))
            else:
                nones.append(got is None)
            upd = full * 2 + 1 if rank == dst else None
            piece = cfg.redistribute_fn(upd, dst, cfg.state)
            expect = _local(t.detach() * 2 + 1)
            errors.append(float((piece - expect).abs().max()) if piece.numel() else 0.0)
            nones.append(tuple(piece.shape) == tuple(_local(t).shape))
    owners = cfg.assign_fn(mats, cfg.state)
    idx = list(range(len(mats)))
    layouts, group = cfg.state["layouts"], dict(group=cfg.state["group"], rank=rank, world_size=world_size)
    fulls = gather_to_owners([_local(t.detach()) for t in mats], layouts, [owners[i] for i in idx],
                             dtype=torch.float32, **group).wait()
    for i, full in enumerate(full_refs):
        if owners[i] == rank:
            errors.append(float((fulls[i] - full).abs().max()))
        else:
            nones.append(fulls[i] is None)
    ups = [(full - 3) if owners[i] == rank else None for i, full in enumerate(full_refs)]
    pieces = scatter_from_owners(ups, layouts, [owners[i] for i in idx], dtype=torch.float32,
                                 device=torch.device("cpu"), **group).wait()
    for t, piece in zip(mats, pieces):
        expect = _local(t.detach() - 3)
        errors.append(float((piece - expect).abs().max()) if expect.numel() else 0.0)
    placements = [str(getattr(t, "placements", "plain")) for t in mats]
    return dict(max_err=max(errors), all_ok=all(nones), placements=placements,
                owners=[owners[i] for i in idx])


def equivalence(rank: int, world_size: int, strategy: str, async_gpu_parallelism: bool = True,
                prefetch_count: int = 1, batched: bool = True, steps: int = 3) -> dict:
    """dmuon.Muon(params, distributed_config=...) on ``strategy`` vs torch.optim.Muon + AdamW on the full tensors."""
    mats, vecs, fulls, cfg = build(strategy, world_size)
    cfg = dataclasses.replace(cfg, async_gpu_parallelism=async_gpu_parallelism,
                              prefetch_count=prefetch_count)
    if not batched:  # functions of one's own (the helpers', wrapped): called per matrix
        gather, redistribute = cfg.gather_fn, cfg.redistribute_fn
        cfg = dataclasses.replace(cfg, gather_fn=lambda *a, **k: gather(*a, **k),
                                  redistribute_fn=lambda *a, **k: redistribute(*a, **k))
    init_mats, init_vecs = initial_fulls(strategy)
    ref_mats = [nn.Parameter(t.clone()) for t in init_mats]
    ref_vecs = [nn.Parameter(t.clone()) for t in init_vecs]
    opt = dmuon.Muon([{"params": mats}, {"params": vecs, "use_muon": False}], distributed_config=cfg,
                     lr=0.02, adamw_lr=0.01, weight_decay=0.1, **EXACT)
    muon = torch.optim.Muon(ref_mats, lr=0.02, weight_decay=0.1, ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW(ref_vecs, lr=0.01, weight_decay=0.1)
    with models.reference_ns(torch.float32):
        for step in range(steps):
            for p in mats + vecs + ref_mats + ref_vecs:  # elementwise: commutes with any sharding
                p.grad = torch.sin(3 * p.detach() + step)
            opt.step()
            muon.step()
            adamw.step()
    # The reference result, sharded by torch's own tools exactly as the run's parameters were.
    want_mats, want_vecs, _, _ = build(strategy, world_size, init=(
        [p.detach() for p in ref_mats], [p.detach() for p in ref_vecs]))
    diffs = [float((_local(t.detach()) - _local(w.detach())).abs().max()) if _local(t).numel() else 0.0
             for t, w in zip(mats + vecs, want_mats + want_vecs)]
    return dict(max_diff=max(diffs), rounds=len(opt.strategy.rounds))


def dp_warnings(rank: int, world_size: int) -> dict:
    """The DeprecationWarnings of building dmuon.Muon over each mesh naming that uses "dp"."""
    out = {}
    for strategy in ("fsdp_tp_dp", "hsdp_dp", "ddp_dp"):
        mats, _, _, cfg = build(strategy, world_size)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dmuon.Muon(mats, distributed_config=cfg, **EXACT)
        out[strategy] = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    return out


def fsdp_training(rank: int, world_size: int, steps: int = 3) -> dict:
    """tests.models.Net under fully_shard, real backward, create_dtensor_config; full params."""
    model = models.make_model()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    names = set(models.matrix_names(model))
    mats = [p for n, p in model.named_parameters() if n in names]
    rest = [p for n, p in model.named_parameters() if n not in names]
    opt = dmuon.Muon([{"params": mats}, {"params": rest, "use_muon": False}],
                         distributed_config=create_dtensor_config(), lr=0.02, adamw_lr=0.01,
                         weight_decay=0.1, **EXACT)
    for step in range(steps):
        idx, y = models.local_batch(step, rank, world_size)
        models.loss_fn(model, idx, y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().full_tensor().numpy() for n, p in model.named_parameters()}


def bad_assignment(rank: int, world_size: int, kind: str) -> str:
    """A custom assign_fn that misses an index or names a rank out of range: ValueError."""
    mats, vecs, _, cfg = build("ddp", world_size)
    assign = {"missing": lambda params, state: {0: 0, 1: 1},
              "out_of_range": lambda params, state: {0: 0, 1: world_size, 2: 0},
              "negative": lambda params, state: {0: -1, 1: 0, 2: 0}}[kind]
    bad = dataclasses.replace(cfg, assign_fn=assign)
    try:
        dmuon.Muon(mats, distributed_config=bad, **EXACT)
    except ValueError as err:
        return str(err)
    return "no error"


def shape_mismatch(rank: int, world_size: int, where: str) -> str:
    """gather_fn (or redistribute_fn) returning a wrong shape: RuntimeError naming it."""
    mats, _, _, cfg = build("ddp", world_size)
    if where == "gather":
        bad = dataclasses.replace(
            cfg, gather_fn=lambda t, dst_rank, state: t[:-1] if dist.get_rank() == dst_rank else None)
    else:
        bad = dataclasses.replace(cfg,
                                  gather_fn=lambda t, dst_rank, state: t if dist.get_rank() == dst_rank else None,
                                  redistribute_fn=lambda u, src_rank, state: u.T)
    opt = dmuon.Muon(mats, distributed_config=bad, **EXACT)
    return step_error(opt, mats)


def step_error(opt: torch.optim.Optimizer, mats: list[nn.Parameter]) -> str:
    """One ``opt.step()`` with every gradient ones: the ``RuntimeError`` message it raised,
    or ``"no error"``."""
    for p in mats:
        p.grad = torch.ones_like(p)
    try:
        opt.step()
    except RuntimeError as err:
        return str(err)
    return "no error"


def comm_failure(rank: int, world_size: int) -> dict:
    """Rank 1's gather_fn raises mid-step; the others must get the collective's error."""
    mats, _, _, cfg = build("plain_fsdp", world_size)
    helper = cfg.gather_fn

    def failing_gather(t, dst_rank, state):
        if dist.get_rank() == 1:
            raise ValueError("injected failure in gather_fn on rank 1")
        return helper(t, dst_rank, state)

    bad = dataclasses.replace(cfg, gather_fn=failing_gather, prefetch_count=0)
    opt = dmuon.Muon(mats, distributed_config=bad, **EXACT)
    for p in mats:
        p.grad = torch.ones_like(p)
    try:
        opt.step()
    except RuntimeError as err:  # gloo: peer closed the connection (DistBackendError)
        return dict(raised=type(err).__name__, message=str(err)[:300])
    return dict(raised=None, message="")


def _holder(mats: list, vecs: list) -> nn.Module:
    """A module whose parameters are ``mats`` and ``vecs`` (FQNs ``mats.i`` / ``vecs.i``)."""
    holder = nn.Module()
    holder.mats = nn.ParameterList(mats)
    holder.vecs = nn.ParameterList(vecs)
    return holder


def _train(opt: Any, params: list, steps: range) -> None:
    for step in steps:
        for p in params:  # elementwise in p: commutes with any sharding, depends on the state
            p.grad = torch.sin(3 * p.detach() + step)
        opt.step()
        opt.zero_grad()


def checkpoint_roundtrip(rank: int, world_size: int, strategy: str, path: str) -> dict:
    """Save dmuon.state_dict after 2 steps (group 0's lr changed as a scheduler would), load it
    with dmuon.load into a fresh model and optimizer built from other weights and the old lr,
    run 2 more steps; the local pieces must equal an uninterrupted 4-step run's."""
    mats, vecs, _, cfg = build(strategy, world_size)
    model = _holder(mats, vecs)
    opt = dmuon.Muon([{"params": mats}, {"params": vecs, "use_muon": False}], distributed_config=cfg,
                     lr=0.02, adamw_lr=0.01, weight_decay=0.1, **EXACT)
    _train(opt, mats + vecs, range(2))
    opt.param_groups[0]["lr"] = 0.013
    import torch.distributed.checkpoint as dcp

    try:
        sd = dmuon.state_dict(model, opt)
    except ValueError as err:
        return dict(error=str(err))
    dcp.save(sd, checkpoint_id=path)
    _train(opt, mats + vecs, range(2, 4))
    init_mats, init_vecs = initial_fulls(strategy)
    mats2, vecs2, _, cfg2 = build(strategy, world_size, init=([m + 1 for m in init_mats],
                                                                [v - 1 for v in init_vecs]))
    model2 = _holder(mats2, vecs2)
    opt2 = dmuon.Muon([{"params": mats2}, {"params": vecs2, "use_muon": False}], distributed_config=cfg2,
                      lr=0.02, adamw_lr=0.01, weight_decay=0.1, **EXACT)
    dmuon.load(model2, opt2, path)
    _train(opt2, mats2 + vecs2, range(2, 4))
    diffs = [float((_local(a.detach()) - _local(b.detach())).abs().max()) if _local(a).numel() else 0.0
             for a, b in zip(mats + vecs, mats2 + vecs2)]
    return dict(error=None, max_diff=max(diffs), lr=opt2.param_groups[0]["lr"])


def clip(rank: int, world_size: int, strategy: str, norm_types: list[float]) -> list[dict]:
    """dmuon.clip_grad_norm_(opt) on sharded gradients vs torch.nn.utils.clip_grad_norm_ on the
    full gradients (single process): the total norm and every rank's clipped piece, per norm."""
    init_mats, init_vecs = initial_fulls(strategy)
    g = torch.Generator().manual_seed(11)
    grad_mats = [10 * torch.randn(t.shape, generator=g) for t in init_mats]
    grad_vecs = [10 * torch.randn(t.shape, generator=g) for t in init_vecs]
    mats, vecs, _, cfg = build(strategy, world_size)
    shard_mats, shard_vecs, _, _ = build(strategy, world_size, init=(grad_mats, grad_vecs))
    opt = dmuon.Muon([{"params": mats}, {"params": vecs, "use_muon": False}], distributed_config=cfg, **EXACT)
    n = len(grad_mats)
    results = []
    for norm_type in norm_types:
        for p, s in zip(mats + vecs, shard_mats + shard_vecs):
            p.grad = s.detach().clone()
        total = dmuon.clip_grad_norm_(opt, max_norm=1.0, norm_type=norm_type)
        refs = [nn.Parameter(torch.zeros_like(t)) for t in grad_mats + grad_vecs]
        for r, t in zip(refs, grad_mats + grad_vecs):
            r.grad = t.clone()
        ref_total = torch.nn.utils.clip_grad_norm_(refs, max_norm=1.0, norm_type=norm_type)
        want_mats, want_vecs, _, _ = build(strategy, world_size, init=(
            [r.grad for r in refs[:n]], [r.grad for r in refs[n:]]))
        diffs = [float((_local(p.grad) - _local(w.detach())).abs().max()) if _local(p.grad).numel() else 0.0
                 for p, w in zip(mats + vecs, want_mats + want_vecs)]
        results.append(dict(norm_type=norm_type, total=float(total), ref_total=float(ref_total),
                            max_diff=max(diffs)))
    return results
