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
          resume_at: int | None = None, dcp_path: str | None = None) -> dict:
    """Train the attention model with dmuon; ``resume_at``: save the model and optimizer state
    dicts after that many steps and go on in a fresh model and optimizer that load them (built
    with another QK-clip threshold: the loaded param group must bring ``tau`` back); with
    ``dcp_path``, through ``dmuon.state_dict`` + ``dcp.save`` / ``dcp.load`` + ``dmuon.load_state_dict``."""
    model, (index, count) = build(layout, world_size, gain)
    opt = dmuon.Muon(model, per_head=per_head, qk_clip_threshold=tau, **KWARGS)
    clipped = []
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
    return dict(params=full_params(model, rank), clipped=clipped, local_tp=local_tp,
                group_keys=sorted(k for k in opt.param_groups[0] if k.startswith("qk_clip")),
                tau=opt.param_groups[0].get("qk_clip_threshold"))

