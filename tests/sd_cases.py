"""Rank functions for torch's state-dict and DCP APIs on the hooks path (issue 31, item 4 and 6).

What FSDP2 alone shows: ``model.state_dict()`` gives each matrix as a DTensor laid out like
FSDP2's sharded parameter, ``torch.distributed.checkpoint.state_dict``'s get/set (sharded,
full, ``cpu_offload``) and a generic ``dcp.save`` / ``dcp.load`` round trip work, and the
results are compared with the single-process ``torch.optim.Muon`` + ``AdamW`` reference
(:func:`reference_with_state`). Batches and modes follow ``tests/ckpt_cases.py``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch import nn

import dmuon
from tests import mesh_cases, models
from tests.ckpt_cases import EXACT, GLOBAL_RANKS, batch, run_steps
from tests.dist_cases import full_params

WRAPPED = "_checkpoint_wrapped_module."


def job(rank: int, world_size: int, mode: str = "fsdp", ac: bool = False):
    """The test model (``checkpoint_wrapper`` on each block first if ``ac``), ``fully_shard``
    (mode "fsdp": 1-D mesh; "hsdp": ("replicate", "shard") = (2, world / 2)) or not
    ("replicated"), dedicated, with a ``dmuon.Muon`` in fp32 exact mode.

    Returns:
        ``(model, opt, dp_index, dp_count)``.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    if mode in ("fsdp-tp", "tp"):  # tests/mesh_cases.py: fc1 column-, fc2 row-parallel
        model, mesh, dp_names = mesh_cases.build(mode, group_cost=0.0)
        return (model, dmuon.Muon(model, **EXACT), *mesh_cases.dp_coordinate(mesh, dp_names))
    model = models.make_model()
    if ac:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    if mode in ("fsdp", "hsdp"):
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    dmuon.dedicate_params(model, mesh, group_cost=0.0)
    opt = dmuon.Muon(model, **EXACT)
    return model, opt, rank, world_size


def _canonical_params(model: nn.Module, rank: int) -> dict[str, np.ndarray]:
    return {k.replace(WRAPPED, ""): v for k, v in full_params(model, rank).items()}


def reference_with_state(steps: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Single-process ``torch.optim.Muon`` + ``AdamW`` (fp32 iteration) on the 4-rank global
    batch: final parameters and each parameter's optimizer state by name."""
    model = models.make_model()
    names = set(models.matrix_names(models.make_model()))
    mats = [p for n, p in model.named_parameters() if n in names]
    rest = [p for n, p in model.named_parameters() if n not in names]
    muon = torch.optim.Muon(mats, lr=0.02, weight_decay=0.1, ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW(rest, lr=0.01, weight_decay=0.1)
    with models.reference_ns(torch.float32):
        for step in range(steps):
            models.loss_fn(model, *models.global_batch(step, GLOBAL_RANKS)).backward()
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
    by_param = {**muon.state, **adamw.state}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in by_param[p].items()} for n, p in model.named_parameters()}
    return params, state


def _numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().numpy().copy()
    return value


def model_state_dict_view(rank: int, world_size: int, *, mode: str = "fsdp", ac: bool = False,
                          steps: int = 2) -> dict:
    """Train ``steps``; describe every dedicated entry of ``model.state_dict()`` as FSDP2 shows
    it (type, global and local shape, placements) and its full value (rank 0); the same for the
    full and cpu-offloaded state dicts of torch's API, model and optimizer.

    Returns:
        ``entries``: ``{key: (type name, global shape, local shape, placements)}`` on every rank;
        on rank 0 ``values`` (``model.state_dict()`` gathered), ``full`` (``get_model_state_dict``
        full, cpu_offload), ``full_optim`` (``{fqn: {name: array}}``), ``groups`` (the full
        optimizer state dict's ``param_groups`` without tensors), ``params`` (full_params).
    """
    model, opt, dp_index, dp_count = job(rank, world_size, mode, ac)
    run_steps(model, opt, range(steps), dp_index, dp_count)
    sd = model.state_dict()
    entries, values = {}, {}
    for key, value in sd.items():
        local = value.to_local() if hasattr(value, "to_local") else value
        entries[key] = (type(value).__name__, tuple(value.shape), tuple(local.shape),
                        tuple(str(p) for p in getattr(value, "placements", ())))
        values[key] = _numpy(value)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    osd = get_optimizer_state_dict(model, opt, options=options)
    sharded_osd = get_optimizer_state_dict(model, opt)
    momentum_kind = {fqn: type(s["momentum_buffer"]).__name__ for fqn, s in sharded_osd["state"].items()
                     if "momentum_buffer" in s}
    out = dict(entries=entries, momentum_kind=momentum_kind)
    if rank == 0:
        out.update(values=values, full={k: _numpy(v) for k, v in full.items()},
                   full_optim={fqn: {k: _numpy(v) for k, v in s.items()} for fqn, s in osd["state"].items()},
                   groups=[{k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
                           for g in osd["param_groups"]],
                   params=_canonical_params(model, rank))
    else:
        _canonical_params(model, rank)
    return out


def dcp_roundtrip(rank: int, world_size: int, *, path: str, mode: str = "fsdp", ac: bool = False,
                  first: int = 2, then: int = 2, how: str = "dcp") -> dict:
    """Train ``first`` steps; save with torch's API; load into a fresh model and optimizer;
    train ``then`` more. Full parameters (rank 0) right after loading and at the end.

    ``how``: ``"dcp"``: ``dcp.save(get_state_dict(...))``, then in the fresh job
    ``dcp.load`` into its ``get_state_dict`` and ``set_state_dict``. ``"full"``: full state
    dicts (every rank) from ``get_model_state_dict`` / ``get_optimizer_state_dict``
    (``full_state_dict=True``) set into the fresh job with the same options. ``"module"``:
    ``model.state_dict()`` / ``opt.state_dict()`` copied, then ``load_state_dict``.
    """
    import copy

    model, opt, dp_index, dp_count = job(rank, world_size, mode, ac)
    run_steps(model, opt, range(first), dp_index, dp_count)
    saved = _canonical_params(model, rank)
    full = StateDictOptions(full_state_dict=True)
    if how == "dcp":
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    elif how == "full":
        msd, osd = get_model_state_dict(model, options=full), get_optimizer_state_dict(model, opt, options=full)
    else:
        msd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    model2, opt2, *_ = job(rank, world_size, mode, ac)
    if how == "dcp":
        msd2, osd2 = get_state_dict(model2, opt2)
        sd = {"model": msd2, "optim": osd2}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    elif how == "full":
        set_model_state_dict(model2, msd, options=full)
        set_optimizer_state_dict(model2, opt2, osd, options=full)
    else:
        model2.load_state_dict(msd)
        opt2.load_state_dict(osd)
    loaded = _canonical_params(model2, rank)
    run_steps(model2, opt2, range(first, first + then), dp_index, dp_count)
    return dict(saved=saved, loaded=loaded, final=_canonical_params(model2, rank))


def init_state_changes_nothing(rank: int, world_size: int, *, mode: str = "fsdp") -> dict:
    """A fresh job asks torch for its optimizer state dict (``_init_optim_state`` steps with zero
    gradients and lr 0): parameters before and after (rank 0)."""
    model, opt, *_ = job(rank, world_size, mode)
    before = _canonical_params(model, rank)
    get_optimizer_state_dict(model, opt)
    return dict(before=before, after=_canonical_params(model, rank))


def _local_snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Every tensor this rank holds live: parameters (local pieces, masters), optimizer state."""
    out = {}
    for name, p in model.named_parameters():
        out[f"param {name}"] = _local(p)
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            for k, v in opt.state.get(p, {}).items():
                out[f"state {gi}/{pi}/{k}"] = _local(v)
    return out


def _local(t: torch.Tensor) -> np.ndarray:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().clone().numpy()


def failed_load(rank: int, world_size: int, *, path: str, damage: str, api: str = "dmuon") -> dict:
    """Save after 2 steps, damage the checkpoint (rank 0: ``"missing"`` deletes ``__1_0.distcp``,
    ``"truncated"`` cuts it to half), train a third step, then try to load.

    ``api``: ``"dmuon"`` (``dmuon.load``) or ``"torch"`` (``dcp.load`` into ``get_state_dict``
    then ``set_state_dict``). Returns the error text and the live tensors that changed on this
    rank (for ``"torch"``: only the dedicated masters and their momentum are compared; FSDP2's
    own shards alias the state dict, as in FSDP2 alone).
    """
    model, opt, dp_index, dp_count = job(rank, world_size)
    run_steps(model, opt, range(2), dp_index, dp_count)
    dcp.save(dmuon.state_dict(model, opt) if api == "dmuon" else
             dict(zip(("model", "optim"), get_state_dict(model, opt))), checkpoint_id=path)
    dist.barrier()
    if rank == 0:
        victim = os.path.join(path, "__1_0.distcp")
        if damage == "missing":
            os.remove(victim)
        else:
            with open(victim, "r+b") as f:
                f.truncate(os.path.getsize(victim) // 2)
    dist.barrier()
    run_steps(model, opt, range(2, 3), dp_index, dp_count)
    before = _local_snapshot(model, opt)
    error = "no error"
    try:
        if api == "dmuon":
            dmuon.load(model, opt, path)
        else:
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        error = f"{type(e).__name__}: {e}"
    after = _local_snapshot(model, opt)
    if api == "torch":
        dedicated = {rec.master for rec in model._dmuon_state.records}
        keep = {f"param {n}" for n, p in model.named_parameters() if p in dedicated}
        keep |= {f"state 0/{i}/momentum_buffer" for i in range(len(opt.param_groups[0]["params"]))}
        before = {k: v for k, v in before.items() if k in keep}
    changed = sorted(k for k, v in before.items() if not np.array_equal(v, after[k]))
    return dict(error=error, changed=changed, compared=len(before))


def bad_load_state_dict(rank: int, world_size: int) -> dict:
    """``model.load_state_dict`` where rank 1's entry for one matrix has the wrong shape: every
    rank must raise naming dmuon, and no rank's masters may change."""
    model, opt, dp_index, dp_count = job(rank, world_size)
    run_steps(model, opt, range(1), dp_index, dp_count)
    names = set(models.matrix_names(models.make_model()))
    sd = {k: v.full_tensor() * 2 for k, v in model.state_dict().items() if k in names}  # another state
    if rank == 1:
        sd["blocks.1.fc1.weight"] = torch.zeros(3, 3)
    before = _local_snapshot(model, opt)
    try:
        model.load_state_dict(sd, strict=False)
        error = "no error"
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    after = _local_snapshot(model, opt)
    dedicated = {rec.master for rec in model._dmuon_state.records}
    keys = [f"param {n}" for n, p in model.named_parameters() if p in dedicated]
    return dict(error=error, changed=[k for k in keys if not np.array_equal(before[k], after[k])])


def canonical_keys(rank: int, world_size: int) -> dict:
    """Block 0 under ``checkpoint_wrapper``, block 1 under ``torch.compile`` (never called), all
    ``fully_shard``-ed and dedicated: the model keys of ``dmuon.state_dict``, of torch's
    ``get_model_state_dict`` and of ``model.state_dict()``, and the optimizer state keys of
    ``dmuon.state_dict`` and ``get_optimizer_state_dict``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    model = models.make_model()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.blocks[0] = checkpoint_wrapper(model.blocks[0], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    model.blocks[1] = torch.compile(model.blocks[1])
    dmuon.dedicate_params(model, mesh, group_cost=0.0)
    opt = dmuon.Muon(model, **EXACT)
    mine = dmuon.state_dict(model, opt)
    keys = dict(dmuon_model=sorted(mine["model"]),
                dmuon_optim=sorted(mine["optim"]["state"]),
                torch_model=sorted(get_model_state_dict(model)),
                torch_optim=sorted(get_optimizer_state_dict(model, opt)["state"]),
                module=sorted(model.state_dict()),
                fqns=[rec.fqn for rec in model._dmuon_state.records])
    return keys


def dmuon_checkpoint_with_ac(rank: int, world_size: int, *, path: str, first: int = 2,
                             then: int = 2) -> dict:
    """``dmuon.state_dict`` + ``dcp.save`` of a model with ``checkpoint_wrapper`` on every
    block, ``dmuon.load`` into a fresh one, ``then`` more steps: full parameters (rank 0)."""
    model, opt, dp_index, dp_count = job(rank, world_size, ac=True)
    run_steps(model, opt, range(first), dp_index, dp_count)
    dcp.save(dmuon.state_dict(model, opt), checkpoint_id=path)
    model2, opt2, *_ = job(rank, world_size, ac=True)
    dmuon.load(model2, opt2, path)
    run_steps(model2, opt2, range(first, first + then), dp_index, dp_count)
    return dict(final=_canonical_params(model2, rank))


def torch_save(rank: int, world_size: int, *, path: str, first: int, mode: str = "fsdp") -> dict:
    """Train ``first`` steps and ``dcp.save(get_state_dict(model, opt))``: full params (rank 0)."""
    model, opt, dp_index, dp_count = job(rank, world_size, mode)
    run_steps(model, opt, range(first), dp_index, dp_count)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return dict(saved=_canonical_params(model, rank))


def torch_load_continue(rank: int, world_size: int, *, path: str, first: int, then: int,
                        mode: str = "fsdp") -> dict:
    """A fresh job on ``world_size`` ranks: ``dcp.load`` into ``get_state_dict``,
    ``set_state_dict``, train steps ``first .. first + then``: full params (rank 0)."""
    model, opt, dp_index, dp_count = job(rank, world_size, mode)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    loaded = _canonical_params(model, rank)
    run_steps(model, opt, range(first, first + then), dp_index, dp_count)
    return dict(loaded=loaded, final=_canonical_params(model, rank))


def split_stack_refused(rank: int, world_size: int) -> dict:
    """Hugging Face Qwen3-MoE under FSDP2, its expert stacks cut into owner ranges: torch's
    ``model.state_dict()`` and ``opt.state_dict()`` refuse by name (dmuon.state_dict works)."""
    from tests import moe_cases

    model = moe_cases.build("hf-qwen3-moe")
    mesh = init_device_mesh("cpu", (world_size,))
    for block in moe_cases.CASES["hf-qwen3-moe"].blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    predicate = dmuon.default_predicate(model)
    dmuon.dedicate_params(model, mesh, predicate=predicate, group_cost=0.0,
                          plan=moe_cases.spread_plan(model, predicate, world_size))
    opt = dmuon.Muon(model, **EXACT)
    out = dict(split=any(rec.stack is not None for rec in model._dmuon_state.records))
    for what, call in (("model", model.state_dict), ("optim", opt.state_dict)):
        try:
            call()
            out[what] = "no error"
        except Exception as e:  # noqa: BLE001 - the test reads type and message
            out[what] = f"{type(e).__name__}: {e}"
    out["dmuon"] = len(dmuon.state_dict(model, opt)["model"])
    return out
