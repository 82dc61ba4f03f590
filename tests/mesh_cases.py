"""Rank functions for HSDP, TP and FSDP x TP (tests/test_meshes.py)."""

from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from dmuon.balance.cost import ReplicaCost
from tests import models
from tests.dist_cases import count_ns, full_params

# NS throughput (FLOP/s) at which replicate_mode="auto" (dmuon.balance.cost.ReplicaCost) splits
# the test model: the break-even ns_flops * REPLICA_BYTES_PER_S / (4 * rows * cols) is 0.06e12
# for head [1, 12], 1.06e12 for blocks.0.fc* [7, 12], 1.86e12 / 2.54e12 for blocks.1 / blocks.2;
# 1.5e12 sends blocks.1-2 to "broadcast" and keeps head and blocks.0 on "compute". With the
# shipped 400e12 every matrix of this tiny model picks "compute".
MIXED_NS_FLOPS_PER_S = 1.5e12


def mixed_auto_kwargs(enabled: bool = True) -> dict:
    """``dedicate_params`` keywords (when ``enabled``) under which ``replicate_mode="auto"``
    splits the test model's matrices over both HSDP modes (:data:`MIXED_NS_FLOPS_PER_S`): the
    plan-level cost model, instead of the shipped one."""
    return {"replica_cost": ReplicaCost(ns_flops_per_s=MIXED_NS_FLOPS_PER_S)} if enabled else {}


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
    dedicate_kwargs.setdefault("group_cost", 0.0)  # spread owners: multi-owner paths (NCCL's default)
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


def train(rank: int, world_size: int, *, layout: str, steps: int = 5, clip: float | None = None,
          replicate_mode: str = "auto", overlap: str = "off") -> dict:
    model, mesh, dp_names = build(layout, replicate_mode=replicate_mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = dmuon.Muon(model, lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
                         ns_dtype=torch.float32, ns_coefficients="muon", overlap=overlap)
    dp_index, dp_count = dp_coordinate(mesh, dp_names)
    state = model._dmuon_state
    ns = count_ns(opt)
    norms, ns_counts = [], []
    for step in range(steps):
        idx, y = models.local_batch(step, dp_index, dp_count)
        models.loss_fn(model, idx, y).backward()
        if clip is not None:
            norms.append(float(dmuon.clip_grad_norm_(model, clip)))
        before = ns["n"]
        opt.step()
        ns_counts.append(ns["n"] - before)
        opt.zero_grad()
    return dict(params=full_params(model, rank), dp_count=dp_count, norms=norms,
                ns_counts=ns_counts, replicate_rank=state.replicate_rank,
                warnings=[str(w.message) for w in caught if str(w.message).startswith("dmuon:")])


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
