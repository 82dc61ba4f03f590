"""Rank functions: the ``distributed_config`` path under ``torch.distributed.pipelining``
(run by the gloo pool, see tests/_pool.py; the test is in tests/test_distconfig.py).

``tests.models.Net`` cut in two stages torchtitan-style (full-model FQNs, the other stage's
parts left out: stage 0 holds the embedding and blocks 0-1, stage 1 block 2 and the head), each
stage's blocks and root ``fully_shard``-ed over ``mesh["dp"]`` of a ("pp", "dp") mesh, driven by
a pipelining schedule; each stage's ``dmuon.Muon`` has explicit param groups and
``create_devicemesh_config(mesh, ["pp", "fsdp"])`` (the stage's dp ranks are its group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from tests import models

EXACT = dict(ns_method="standard", ns_dtype=torch.float32, ns_coefficients="muon")
#: the reference's world size for models.global_batch: 3 * 8 = 24 sequences a step, 12 per dp
#: rank, 4 micro-batches of 3
GLOBAL = 8
STAGE_BLOCKS = ((0, 1), (2,))


class Stage(nn.Module):
    """One pipeline stage of ``Net`` with the full model's FQNs (``blocks`` a ``ModuleDict``
    keyed by the block's index, as torchtitan keeps ``layers``)."""

    def __init__(self, net: models.Net, stage: int) -> None:
        super().__init__()
        self.first, self.last = stage == 0, stage == len(STAGE_BLOCKS) - 1
        if self.first:
            self.emb = net.emb
        self.blocks = nn.ModuleDict({str(i): net.blocks[i] for i in STAGE_BLOCKS[stage]})
        if self.last:
            self.head = net.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.emb(x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x).mean(dim=(1, 2)) if self.last else x


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def pipeline_training(rank: int, world_size: int, schedule: str = "gpipe", steps: int = 3,
                      microbatches: int = 4) -> dict:
    """``steps`` steps of a 2-stage pipeline over ("pp", "dp") = (2, world/2).

    Returns:
        ``{"stage": s, "params": {fqn: full numpy array}}`` (the stage's parameters, gathered
        over its dp ranks).
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    pp, dp_rank = mesh.get_coordinate()
    dp = mesh.size(1)
    stage_module = Stage(models.make_model(), pp)
    for block in stage_module.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage_module, mesh=mesh["dp"])
    matrices = set(models.matrix_names(stage_module))
    named = list(stage_module.named_parameters())
    opt = dmuon.Muon([{"params": [p for n, p in named if n in matrices]},
                      {"params": [p for n, p in named if n not in matrices], "use_muon": False}],
                     distributed_config=dmuon.create_devicemesh_config(mesh, ["pp", "fsdp"]),
                     lr=0.02, adamw_lr=0.01, weight_decay=0.1, **EXACT)
    stage = PipelineStage(stage_module, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = kind(stage, n_microbatches=microbatches, loss_fn=_mse)
    for step in range(steps):
        idx, y = _local(step, dp_rank, dp)
        if pp == 0:
            sched.step(idx)
        else:
            sched.step(target=y)
        opt.step()
        opt.zero_grad()
    # Full parameters from the dp ranks' Shard(0) pieces, gathered with the group object:
    # full_tensor() resolves the group by name, and a second call in the same pool gets the
    # first call's cached (destroyed) sub-mesh group from DeviceMesh's slicing cache.
    pieces: list = [None] * dp
    dist.all_gather_object(pieces, {n: p.detach().to_local() for n, p in named}, group=mesh.get_group("dp"))
    return {"stage": pp, "params": {n: torch.cat([piece[n] for piece in pieces]).numpy() for n, _ in named}}


def _local(step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's contiguous share of ``models.global_batch(step, GLOBAL)``."""
    idx, y = models.global_batch(step, GLOBAL)
    n = idx.shape[0] // dp
    return idx[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]
