"""Rank functions for HSDP, TP and FSDP x TP (tests/test_meshes.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from tests import models

LAYOUTS = {
    # name: (mesh shape, mesh dim names)
    "hsdp": ((2, 2), ("replicate", "shard")),
    "fsdp-tp": ((2, 2), ("dp", "tp")),
    "tp": ((2,), ("tp",)),
    "hsdp-tp": ((2, 2, 2), ("replicate", "shard", "tp")),
}


def build(layout: str, **dedicate_kwargs):
    shape, names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = models.make_model()
    if "tp" in names:
        # fc1 column-parallel, fc2 row-parallel; head stays whole. fc1's output stays a DTensor:
        # with uneven hidden sizes (7, 13) DTensor.from_local would infer a wrong global shape.
        plan = {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
    dp_names = tuple(n for n in names if n != "tp")
    if dp_names:
        dp_mesh = mesh[dp_names] if len(dp_names) > 1 or len(names) > 1 else mesh
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    dmuon.dedicate_params(model, mesh, **dedicate_kwargs)
    return model, mesh, dp_names


def dp_coordinate(mesh, dp_names) -> tuple[int, int]:
    """(index of this rank's data-parallel replica, number of them)."""
    if not dp_names:
        return 0, 1
    coord = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    index, count = 0, 1
    for name in dp_names:
        index = index * sizes[name] + coord[name]
        count *= sizes[name]
    return index, count


def full_params(model) -> dict[str, np.ndarray]:
    """Every parameter's full value on rank 0, assembled from owners' TP slices (collective)."""
    state = model._dmuon_state
    mine = {}
    for rec in state.records:
        if rec.is_owner and state.replicate_rank == 0:
            mine[rec.fqn] = (state.tp_rank, rec.tp_shard_dim, rec.master.detach().numpy().copy())
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out: dict[str, np.ndarray] = {}
    pieces: dict[str, list] = {}
    for part in parts:
        for fqn, (tp_rank, dim, arr) in part.items():
            pieces.setdefault(fqn, []).append((tp_rank, dim, arr))
    for fqn, ps in pieces.items():
        ps.sort(key=lambda p: p[0])
        dim = ps[0][1]
        out[fqn] = ps[0][2] if dim is None else np.concatenate([p[2] for p in ps], axis=dim)
    for name, p in model.named_parameters():
        if name not in out:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = t.detach().numpy().copy()
    return out


def train(rank: int, world_size: int, *, layout: str, steps: int = 5, clip: float | None = None,
          replicate_mode: str = "auto") -> dict:
    model, mesh, dp_names = build(layout, replicate_mode=replicate_mode)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
                     ns_dtype=torch.float32, ns_coefficients="muon")
    dp_index, dp_count = dp_coordinate(mesh, dp_names)
    state = model._dmuon_state
    norms, ns_counts = [], []
    for step in range(steps):
        idx, y = models.local_batch(step, dp_index, dp_count)
        models.loss_fn(model, idx, y).backward()
        if clip is not None:
            norms.append(float(dmuon.clip_grad_norm_(model, clip)))
        before = state.ns_matrices
        opt.step()
        ns_counts.append(state.ns_matrices - before)
        opt.zero_grad()
    params = full_params(model)
    return dict(params=params if rank == 0 else {}, dp_count=dp_count, norms=norms,
                ns_counts=ns_counts, replicate_rank=state.replicate_rank)


def unsupported_placement(rank: int, world_size: int) -> str:
    """A matrix with a Partial placement on the TP mesh must be refused, naming it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = models.make_model()
    local = model.head.weight.detach() / world_size
    model.head.weight = torch.nn.Parameter(DTensor.from_local(local, mesh, [Partial()], run_check=False))
    try:
        dmuon.dedicate_params(model, mesh)
        dmuon.Muon(model)
    except ValueError as e:
        return str(e)
    return "no error"
