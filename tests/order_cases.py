"""The order and wrapping a trainer imposes, on every rank of the test pool (issue 31, items 8
and 9): ``dmuon.Muon(model)`` built before a later ``fully_shard`` (what
``accelerator.prepare(model, optimizer)`` does), dmuon's functions given Accelerate's
``AcceleratedOptimizer``, and a grouped ``fully_shard([a, b])`` (Accelerate shards
``[norm, lm_head]`` as one group). The reference is single-process ``torch.optim.Muon`` +
``AdamW`` (``tests/models.run_reference``)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from tests import models
from tests.clip_cases import OPT_KWARGS
from tests.dist_cases import build, full_params


def _steps(model: torch.nn.Module, opt: Any, rank: int, world_size: int, steps: int,
           clip: float | None = None) -> list[float]:
    norms = []
    for step in range(steps):
        idx, y = models.local_batch(step, rank, world_size)
        models.loss_fn(model, idx, y).backward()
        if clip is not None:
            norms.append(float(dmuon.clip_grad_norm_(opt, clip)))
        opt.step()
        opt.zero_grad()
    return norms


def muon_before_fully_shard(rank: int, world_size: int, *, first: str = "forward") -> str:
    """``dedicate_params`` and ``dmuon.Muon`` on the plain model, then ``fully_shard`` of the
    blocks and the root, then a forward (``first="forward"``) or ``opt.step()``: the error."""
    model = models.make_model()
    mesh = init_device_mesh("cpu", (world_size,))
    dmuon.dedicate_params(model, mesh, group_cost=0.0)
    opt = dmuon.Muon(model, **OPT_KWARGS)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        if first == "forward":
            idx, y = models.local_batch(0, rank, world_size)
            models.loss_fn(model, idx, y).backward()
        opt.step()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def accelerated_optimizer(rank: int, world_size: int, *, steps: int = 3, clip: float = 0.05) -> dict:
    """dmuon's functions given Accelerate's ``AcceleratedOptimizer`` around ``dmuon.Muon``:
    ``clip_grad_norm_`` while training, then ``state_dict``, ``dcp.save``, ``load`` and
    ``load_state_dict`` into a fresh model and wrapped optimizer."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model, _ = build(world_size, "fsdp")
    opt = acc.prepare_optimizer(dmuon.Muon(model, **OPT_KWARGS))
    assert type(opt).__name__ == "AcceleratedOptimizer"
    norms = _steps(model, opt, rank, world_size, steps, clip)
    sd = dmuon.state_dict(model, opt)
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save(sd, checkpoint_id=path[0])
    fresh, _ = build(world_size, "fsdp")
    fresh_opt = acc.prepare_optimizer(dmuon.Muon(fresh, **OPT_KWARGS))
    dmuon.load(fresh, fresh_opt, path[0])
    loaded = full_params(fresh, rank)
    again, _ = build(world_size, "fsdp")
    again_opt = acc.prepare_optimizer(dmuon.Muon(again, **OPT_KWARGS))
    dmuon.load_state_dict(again, again_opt, dmuon.state_dict(model, opt))
    return dict(norms=norms, params=full_params(model, rank), loaded=loaded,
                loaded_state_dict=full_params(again, rank))


def grouped_fully_shard(rank: int, world_size: int, *, steps: int = 3) -> dict:
    """``fully_shard`` of the first two blocks, then of ``[blocks[2], head]`` as one group (as
    Accelerate groups ``[norm, lm_head]``), then the root; dmuon trains it. Returns the final
    parameters (rank 0) and the modules whose FSDP2 pre-forward the step check's guard wraps."""
    from dmuon.hooks import fsdp_adapter

    model = models.make_model()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.blocks[0], mesh=mesh)
    fully_shard(model.blocks[1], mesh=mesh)
    fully_shard([model.blocks[2], model.head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    dmuon.dedicate_params(model, mesh, group_cost=0.0)
    opt = dmuon.Muon(model, **OPT_KWARGS)
    _steps(model, opt, rank, world_size, steps)
    state = model._dmuon_state
    names = {id(m._forward_pre_hooks): n for n, m in model.named_modules()}
    guarded = sorted(names[id(h.table)] for h in state.handles
                     if isinstance(h, fsdp_adapter._Restore) and id(h.table) in names)
    return dict(params=full_params(model, rank), guarded=guarded)
