"""Pipeline parallelism and FSDP2's divide factor, run on every rank of the test pool.

Pipeline stages are cut torchtitan-style: each stage module is the test model with the other
stages' parts deleted, so its parameters keep the full model's names (``blocks.2.fc1.weight``),
each block and the stage root ``fully_shard``-ed over the stage's data-parallel mesh, and
``dedicate_params`` called once per stage module. The references are single-process
``torch.optim.Muon`` + ``AdamW`` on the global batch (:func:`tests.models.run_reference`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from tests import models

MICRO_BATCHES = 4
#: the reference's world size for a data-parallel size ``dp``: ``3 * REF_PER_DP * dp`` sequences,
#: ``3 * REF_PER_DP`` per data-parallel rank, ``MICRO_BATCHES`` micro-batches of 3
REF_PER_DP = MICRO_BATCHES
OPT = dict(lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32,
           ns_coefficients="muon")


class StageNet(nn.Module):
    """The part of :class:`tests.models.Net` one pipeline stage runs: the embedding on the first
    stage, the blocks ``layers`` (a ``ModuleDict`` keyed by block index, torchtitan's layout, so
    names match the full model), the head on the last."""

    def __init__(self, full: models.Net, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.emb = full.emb if first else None
        self.blocks = nn.ModuleDict({str(i): full.blocks[i] for i in layers})
        self.head = full.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(x).mean(dim=(1, 2))
        return x


#: blocks per stage: 2 stages (GPipe, 1F1B) or 4 (interleaved: 2 per pipeline rank)
CUTS = {2: [[0, 1], [2]], 4: [[0], [1], [2], []]}


def _stage_modules(n_stages: int, indices: list[int]) -> list[StageNet]:
    return [StageNet(models.make_model(), CUTS[n_stages][i], first=i == 0, last=i == n_stages - 1)
            for i in indices]


def _dp_mesh(mesh, hsdp: bool):
    return mesh["replicate", "shard"] if hsdp else mesh["dp"]


def _collect(stages: list[nn.Module], rank: int) -> dict[str, np.ndarray]:
    """Every parameter's full value on rank 0 (``{}`` elsewhere): owners' masters (replica 0)
    and FSDP2's full tensors (collective within each stage's data-parallel group)."""
    mine: dict[str, np.ndarray] = {}
    for stage in stages:
        state = stage._dmuon_state
        state.pending.wait_all()  # Muon(overlap=...): masters read directly, after their updates
        owned = {rec.fqn for rec in state.records}
        for rec in state.records:
            if rec.is_owner and state.replicate_rank == 0:
                mine[rec.fqn] = rec.master.detach().numpy().copy()
        for name, p in stage.named_parameters():
            if name not in owned:
                t = p.full_tensor() if hasattr(p, "full_tensor") else p
                mine[name] = t.detach().numpy().copy()
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out: dict[str, np.ndarray] = {}
    for part in parts:
        out.update(part)
    return out if rank == 0 else {}


def pipeline(rank: int, world_size: int, *, schedule: str, pp: int, whole_mesh: bool = False,
             hsdp: bool = False, steps: int = 3, overlap: str = "off") -> dict:
    """Train the cut model under ``torch.distributed.pipelining`` with dmuon inside each stage.

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (two stage modules per rank).
        pp: pipeline size; the rest of the ranks are each stage's data-parallel group
            (``("pp", "dp")``, or ``("pp", "replicate", "shard")`` with ``hsdp``).
        whole_mesh: give ``dedicate_params`` the whole mesh instead of the stage's sub-mesh.

    Returns:
        ``params`` (rank 0), ``losses`` (per step, last stage ranks), ``dp`` (data-parallel size).
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    dp = world_size // pp
    if hsdp:
        mesh = init_device_mesh("cpu", (pp, 2, dp // 2), mesh_dim_names=("pp", "replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    dp_mesh = _dp_mesh(mesh, hsdp)
    pp_rank = mesh["pp"].get_local_rank()
    if schedule == "interleaved":  # stage i on pipeline rank i % pp, two per rank
        n_stages = 2 * pp
        indices = [pp_rank + k * pp for k in range(2)]
        modules = _stage_modules(n_stages, indices)
    elif pp == 2:
        n_stages, indices = 2, [pp_rank]
        modules = _stage_modules(n_stages, indices)
    else:  # one stage: the whole model
        n_stages, indices = 1, [0]
        modules = [StageNet(models.make_model(), [0, 1, 2], first=True, last=True)]
    opts = []
    for module in modules:
        for block in module.blocks.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(module, mesh=dp_mesh)
        dmuon.dedicate_params(module, mesh if whole_mesh else dp_mesh, group_cost=0.0)
        opts.append(dmuon.Muon(module, **OPT, overlap=overlap))
    pp_group = mesh["pp"].get_group()
    stages = [PipelineStage(m, i, n_stages, torch.device("cpu"), group=pp_group) for m, i in zip(modules, indices)]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(stages[0], n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    dp_rank = dp_mesh._flatten().get_local_rank() if hsdp else dp_mesh.get_local_rank()
    per_rank = 3 * REF_PER_DP
    losses, clip_error = [], None
    for step in range(steps):
        idx, y = models.global_batch(step, REF_PER_DP * dp)
        idx, y = idx[dp_rank * per_rank: (dp_rank + 1) * per_rank], y[dp_rank * per_rank: (dp_rank + 1) * per_rank]
        micro: list[torch.Tensor] = []
        args = (idx,) if first else ()
        if last:
            sched.step(*args, target=y, losses=micro)
            losses.append(float(torch.stack(micro).mean()))
        else:
            sched.step(*args)
        if step == 0 and pp > 1:  # one stage's norm is not the model's: refused by name
            try:
                dmuon.clip_grad_norm_(modules[0], 1e9)
            except ValueError as err:
                clip_error = str(err)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return dict(params=_collect(modules, rank), losses=losses, dp=dp, clip_error=clip_error)


def divide_factor(rank: int, world_size: int, *, steps: int = 3, factor: float = 1.0,
                  hsdp: bool = False, clip: float = 0.05, late: bool = False) -> dict:
    """torchtitan's normalisation: every FSDP2 module's ``set_gradient_divide_factor(factor)``
    (torchtitan's ``disable_fsdp_gradient_division``: 1.0) and each rank's loss the *sum* of its
    squared errors times ``factor`` over the global number of samples, so the gradient FSDP2
    gives (the ranks' sum divided by ``factor``) is the global batch's mean gradient. Muon's
    update hardly sees a gradient's scale (Newton-Schulz normalizes it), so the gradient norm
    (``dmuon.clip_grad_norm_``, clipping at ``clip``) is what shows a wrong one.

    ``late``: each block's bias-free ``fc2`` is its own FSDP2 module, whose one parameter dmuon
    takes (FSDP2 loses its parameter group), and the factor is set after ``dmuon.Muon`` bound
    the model: the setter must still reach dmuon."""
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    model = models.make_model()
    for block in model.blocks:
        if late:
            fully_shard(block.fc2, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def set_factor() -> None:
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(factor)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM

    if not late:
        set_factor()
    dmuon.dedicate_params(model, mesh, group_cost=0.0)
    opt = dmuon.Muon(model, **OPT)
    if late:
        set_factor()
    n_global = models.LOCAL_BATCH * world_size
    losses, norms = [], []
    for step in range(steps):
        idx, y = models.local_batch(step, rank, world_size)
        loss = ((model(idx) - y) ** 2).sum() * factor / n_global
        loss.backward()
        losses.append(loss.item())
        norms.append(float(dmuon.clip_grad_norm_(model, clip)))
        opt.step()
        opt.zero_grad()
    from tests.dist_cases import full_params

    return dict(params=full_params(model, rank), losses=losses, norms=norms)


def unreduced_step(rank: int, world_size: int) -> str:
    """A backward with FSDP2's gradient sync off, then ``opt.step()`` at once: the step would
    skip every matrix (its owner never got the gradient); return the error it raises."""
    from tests.dist_cases import build

    model, _ = build(world_size, "fsdp")
    opt = dmuon.Muon(model, **OPT)
    idx, y = models.local_batch(0, rank, world_size)
    model.set_requires_gradient_sync(False)
    models.loss_fn(model, idx, y).backward()
    try:
        opt.step()
    except RuntimeError as err:
        return f"RuntimeError: {err}"
    return "no error"
