"""Rank functions for per-head Muon and QK-clip (tests/test_blocks.py, issue 40)."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from tests import attention_models as am
from tests.dist_cases import full_params
from tests.mesh_cases import dp_coordinate
from tests.overlap_cases import counted_jobs

LAYOUTS = {
    "fsdp": (None, None),
    "replicated": (None, None),
    "hsdp": ((2, 2), ("replicate", "shard")),
    "fsdp-tp": ((2, 2), ("dp", "tp")),
}
KWARGS = dict(lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
              ns_dtype=torch.float32, ns_coefficients="muon")


def build(layout: str, world_size: int, gain: float):
    shape, names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape or (world_size,), mesh_dim_names=names)
    model = am.make_model(gain=gain)
    names = names or ("dp",)
    if "tp" in names:
        for block in model.blocks:
            plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
                    "o_proj": RowwiseParallel(), "wqkv": ColwiseParallel(), "wo": RowwiseParallel()}
            parallelize_module(block.attn, mesh["tp"], {k: v for k, v in plan.items() if hasattr(block.attn, k)})
    dp_names = tuple(n for n in names if n != "tp")
    if layout != "replicated":
        dp_mesh = mesh[dp_names] if "tp" in names else mesh  # a slice of all names is cached by torch
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    dmuon.dedicate_params(model, mesh, group_cost=0.0)
    coord = dp_coordinate(mesh, dp_names) if shape else (mesh.get_local_rank(), world_size)
    return model, coord


def train(rank: int, world_size: int, *, layout: str = "fsdp", steps: int = 3, per_head: bool = True,
          tau: float | None = None, micro_batches: int = 1, gain: float = 1.0,
          resume_at: int | None = None, dcp_path: str | None = None, overlap: str = "off") -> dict:
    """Train the attention model with dmuon; ``resume_at``: save the model and optimizer state
    dicts after that many steps and go on in a fresh model and optimizer that load them (built
    with another QK-clip threshold: the loaded param group must bring ``tau`` back); with
    ``dcp_path``, through ``dmuon.state_dict`` + ``dcp.save`` / ``dcp.load`` + ``dmuon.load_state_dict``."""
    model, (index, count) = build(layout, world_size, gain)
    opt = dmuon.Muon(model, per_head=per_head, qk_clip_threshold=tau, overlap=overlap, **KWARGS)
    clipped = []
    counts: dict = {}
    with counted_jobs(counts):
        for step in range(steps):
            if resume_at is not None and step == resume_at:
                if dcp_path is not None:
                    dcp.save(dmuon.state_dict(model, opt), checkpoint_id=dcp_path)
                else:
                    saved_model = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                   for k, v in model.state_dict().items()}
                    saved_opt = copy.deepcopy(opt.state_dict())
                model, _ = build(layout, world_size, gain)
                opt = dmuon.Muon(model, per_head=per_head, qk_clip_threshold=None if tau is None else 1e9,
                                 **KWARGS)
                if dcp_path is not None:
                    sd = dmuon.state_dict(model, opt)
                    dcp.load(sd, checkpoint_id=dcp_path)
                    dmuon.load_state_dict(model, opt, sd)
                else:
                    model.load_state_dict(saved_model)
                    opt.load_state_dict(saved_opt)
            idx, y = am.local_batch(step, index, count)
            for i, (ci, cy) in enumerate(zip(idx.chunk(micro_batches), y.chunk(micro_batches))):
                last = i == micro_batches - 1
                with contextlib.nullcontext() if last else dmuon.no_sync(model):
                    (((model(ci) - cy) ** 2).mean() / micro_batches).backward()
            opt.step()
            opt.zero_grad()
            strategy = opt.strategy
            clipped.append(strategy.qk_clip.clipped_heads if strategy.qk_clip is not None else 0)
    local_tp = []
    if layout == "fsdp-tp":
        from dmuon.owners.blocks import _local_split, tp_rank_size

        state = model._dmuon_state
        rank_size = tp_rank_size(state.roles.tp)
        local_tp = sorted(r.fqn for r in state.records
                          if _local_split(r, opt.strategy.splits.get(id(r)), *rank_size) is not None)  # here, not in a call of its own: one 2-D mesh per pool session
    state = model._dmuon_state
    return dict(params=full_params(model, rank), clipped=clipped, local_tp=local_tp,
                scheduled=counts["scheduled"], owns=any(r.is_owner for r in state.records),
                group_keys=sorted(k for k in opt.param_groups[0] if k.startswith("qk_clip")),
                tau=opt.param_groups[0].get("qk_clip_threshold"))



def pipeline(rank: int, world_size: int, *, schedule: str = "1f1b", steps: int = 3, tau: float | None = 0.3,
             gain: float = 3.0) -> dict:
    """Per-head Muon and QK-clip under ``torch.distributed.pipelining``, pp 2 x dp 2: stage 0 is
    the embedding and block 0 (Llama-style attention), stage 1 block 1 (fused ``wqkv``) and the
    head, cut as :mod:`tests.pp_cases` cuts (names kept), each stage ``fully_shard``-ed and
    dedicated over its data-parallel mesh; ``pp_cases.MICRO_BATCHES`` micro-batches of
    ``am.LOCAL_BATCH`` sequences per data-parallel rank and step.

    Returns:
        ``params`` (rank 0: every stage's), ``clipped`` (per step, this stage's clipped heads),
        ``dp``.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from tests.pp_cases import MICRO_BATCHES, StageNet, _collect

    pp, dp = 2, world_size // 2
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    dp_mesh, pp_rank = mesh["dp"], mesh["pp"].get_local_rank()
    module = StageNet(am.make_model(gain=gain), [pp_rank], first=pp_rank == 0, last=pp_rank == pp - 1)
    for block in module.blocks.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(module, mesh=dp_mesh)
    dmuon.dedicate_params(module, dp_mesh, group_cost=0.0)
    opt = dmuon.Muon(module, per_head=True, qk_clip_threshold=tau, **KWARGS)
    stage = PipelineStage(module, pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group())
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_microbatches=MICRO_BATCHES, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    dp_rank, per_rank = dp_mesh.get_local_rank(), MICRO_BATCHES * am.LOCAL_BATCH
    clipped = []
    for step in range(steps):
        idx, y = am.global_batch(step, MICRO_BATCHES * dp)
        idx, y = idx[dp_rank * per_rank: (dp_rank + 1) * per_rank], y[dp_rank * per_rank: (dp_rank + 1) * per_rank]
        args = (idx,) if stage.is_first else ()
        if stage.is_last:
            sched.step(*args, target=y, losses=[])
        else:
            sched.step(*args)
        opt.step()
        opt.zero_grad()
        clipped.append(opt.strategy.qk_clip.clipped_heads if opt.strategy.qk_clip is not None else 0)
    return dict(params=_collect([module], rank), clipped=clipped, dp=dp)
