"""Rank functions for tests/test_distconfig_dcp.py: torch's state-dict API and DCP on the
``distributed_config`` path (run by the gloo pool, see tests/_pool.py).

Layouts: ``"fsdp"`` (``fully_shard`` over every rank, ``tests.models.Net``), ``"hsdp"``
((replicate, shard) = (2, world/2), ``Net``), ``"fsdp_tp"`` ((dp, tp) = (2, world/2), fc1
colwise, fc2 and the head rowwise, then ``fully_shard`` over dp) and ``"tp"`` (tensor
parallelism over every rank). The TP layouts use :func:`tp_model` (even dimensions: DTensor's
reassembly of uneven ``_StridedShard`` is not FSDP2's, see tests/distconfig_cases.py).
References: :func:`reference`, single-process ``torch.optim.Muon`` + ``AdamW``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from tests import distconfig_cases, models

EXACT = dict(ns_method="standard", ns_dtype=torch.float32, ns_coefficients="muon")
HYPER = dict(lr=0.02, adamw_lr=0.01, weight_decay=0.1)
TP_WIDTH = 8


def tp_model(seed: int = 0) -> nn.Module:
    """An embedding, two blocks (hidden 8 and 16) and a ``[1, 8]`` head: dimensions that TP 2
    x FSDP 2 (and TP 4) split evenly, except the head's single row under FSDP."""
    torch.manual_seed(seed)
    return models.BlocksNet(models.VOCAB, TP_WIDTH,
                            lambda: [models.Block(TP_WIDTH, TP_WIDTH), models.Block(TP_WIDTH, 2 * TP_WIDTH)])


def make(layout: str, seed: int) -> nn.Module:
    return models.make_model(seed) if layout in ("fsdp", "hsdp") else tp_model(seed)


def reference(layout: str, dp: int | list[int], steps: int) -> dict[str, dict[str, torch.Tensor]]:
    """Single-process ``torch.optim.Muon`` (matrices, fp32 Newton-Schulz) + ``AdamW`` (the
    rest) on the global batch of ``dp`` data-parallel ranks (a list: per step).

    Returns:
        ``{"params": {fqn: tensor}, "momentum_buffer": {fqn: tensor}, "exp_avg": {fqn: tensor}}``.
    """
    model = make(layout, 0)
    names = set(models.matrix_names(model))
    mats = [p for n, p in model.named_parameters() if n in names]
    rest = [p for n, p in model.named_parameters() if n not in names]
    muon = torch.optim.Muon(mats, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
                            ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW(rest, lr=HYPER["adamw_lr"], weight_decay=HYPER["weight_decay"])
    with models.reference_ns(torch.float32):
        for step in range(steps):
            idx, y = models.global_batch(step, dp[step] if isinstance(dp, list) else dp)
            models.loss_fn(model, idx, y).backward()
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
    named = dict(model.named_parameters())
    return {"params": {n: p.detach().clone() for n, p in named.items()},
            "momentum_buffer": {n: muon.state[p]["momentum_buffer"].clone() for n, p in named.items()
                                if n in names},
            "exp_avg": {n: adamw.state[p]["exp_avg"].clone() for n, p in named.items() if n not in names}}


_MESHES = [0]


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """``init_device_mesh`` with dim names unique to this call (``"shard"`` -> ``"shard_3"``).

    DeviceMesh equality (and DTensor's sharding-propagation cache, keyed on it) ignores the
    process groups; the pool destroys a call's groups afterwards, so a later call's mesh equal
    to an earlier one can be handed the earlier, destroyed groups by that cache (seen: "Could
    not resolve the process group registered under the name 3" in ``full_tensor``)."""
    _MESHES[0] += 1
    return init_device_mesh("cpu", shape, mesh_dim_names=tuple(f"{n}_{_MESHES[0]}" for n in names))


def build(layout: str, world_size: int, seed: int, named: bool = True) -> tuple[nn.Module, Any, int, int]:
    """``(model, dmuon.Muon with create_dtensor_config, data-parallel rank, dp size)``.

    ``named``: param groups of ``(fqn, parameter)`` pairs (torch's named parameters, so each
    group carries ``param_names``); else of parameters.
    """
    model = make(layout, seed)
    rank = dist.get_rank()
    if layout in ("fsdp", "hsdp"):
        if layout == "fsdp":
            mesh = _mesh((world_size,), ("shard",))
        else:
            mesh = _mesh((2, world_size // 2), ("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        dp_rank, dp = rank, world_size
    else:
        shape, names = ((2, world_size // 2), ("dp", "tp")) if layout == "fsdp_tp" else ((world_size,), ("tp",))
        mesh = _mesh(shape, names)
        tp_mesh = mesh[mesh.mesh_dim_names[-1]]
        for block in model.blocks:
            parallelize_module(block, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        # the head reads the replicated residual stream: Replicate in, sliced to its Shard(1) columns
        parallelize_module(model, tp_mesh, {"head": RowwiseParallel(input_layouts=Replicate())})
        if layout == "fsdp_tp":
            dp_mesh = mesh[mesh.mesh_dim_names[0]]
            for block in model.blocks:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
            dp_rank, dp = mesh.get_coordinate()[0], mesh.size(0)
        else:
            dp_rank, dp = 0, 1
    matrices = set(models.matrix_names(model))
    pairs = list(model.named_parameters())
    mats = [(n, p) if named else p for n, p in pairs if n in matrices]
    rest = [(n, p) if named else p for n, p in pairs if n not in matrices]
    opt = dmuon.Muon([{"params": mats}, {"params": rest, "use_muon": False}],
                     distributed_config=dmuon.create_dtensor_config(), **HYPER, **EXACT)
    return model, opt, dp_rank, dp


def train(model: nn.Module, opt: Any, steps: range, dp_rank: int, dp: int) -> None:
    for step in steps:
        idx, y = models.local_batch(step, dp_rank, dp)
        models.loss_fn(model, idx, y).backward()
        opt.step()
        opt.zero_grad()


def layout_problems(model: nn.Module, opt: Any) -> list[str]:
    """Every optimizer state tensor of ``opt.state_dict()`` that is not laid out like its
    parameter (DTensor with the same mesh, placements and global shape)."""
    sd = opt.state_dict()
    ids = [p for g in opt.param_groups for p in g["params"]]
    names = {id(p): n for n, p in model.named_parameters()}
    problems = []
    for pid, entries in sd["state"].items():
        p = ids[pid]
        for key, value in entries.items():
            if key == "step":
                continue
            where = f"{names[id(p)]}/{key}"
            if hasattr(p, "device_mesh") != hasattr(value, "device_mesh"):
                problems.append(f"{where}: {type(value).__name__} {tuple(value.shape)} for a "
                                f"{type(p).__name__} {tuple(p.shape)}")
            elif hasattr(p, "device_mesh") and (value.shape != p.shape or value.placements != p.placements
                                                or value.device_mesh != p.device_mesh):
                problems.append(f"{where}: {tuple(value.shape)} {value.placements} vs {tuple(p.shape)} "
                                f"{p.placements}")
    return problems


def dcp_resume(rank: int, world_size: int, layout: str, path: str, before: int = 3, after: int = 2,
               named: bool = True, flatten: bool = False) -> dict:
    """Train ``before`` steps, ``dcp.save(get_state_dict(model, opt))``, load into a fresh model
    and optimizer (other weights) with ``dcp.load`` + ``set_state_dict``, train ``after`` more.

    Returns:
        ``params`` (full, from ``get_model_state_dict(full_state_dict=True)``), ``momentum_buffer``
        and ``exp_avg`` (full, from ``get_optimizer_state_dict(full_state_dict=True)``, or
        ``full_error``), ``layout`` (problems of :func:`layout_problems` after the save and
        after the resume), ``groups`` (the full state dict's param_groups minus params).
    """
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model, opt, dp_rank, dp = build(layout, world_size, 0, named)
    train(model, opt, range(before), dp_rank, dp)
    problems = layout_problems(model, opt)
    msd, osd = get_state_dict(model, opt, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    model2, opt2, _, _ = build(layout, world_size, 1, named)
    msd2, osd2 = get_state_dict(model2, opt2, options=options)
    sd2 = {"model": msd2, "optim": osd2}
    dcp.load(sd2, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=sd2["model"], optim_state_dict=sd2["optim"], options=options)
    train(model2, opt2, range(before, before + after), dp_rank, dp)
    problems += layout_problems(model2, opt2)
    full = StateDictOptions(full_state_dict=True)
    params = {n: t.numpy() for n, t in get_model_state_dict(model2, options=full).items()}
    out = dict(params=params, layout=problems, full_error=None, live_ns_dtype=opt2.param_groups[0]["ns_dtype"])
    try:
        fosd = get_optimizer_state_dict(model2, opt2, options=full)
    except Exception as err:  # noqa: BLE001 - reported to the test (old main: ns_dtype)
        out["full_error"] = f"{type(err).__name__}: {err}"
        return out
    for key in ("momentum_buffer", "exp_avg"):
        out[key] = {n: st[key].numpy() for n, st in fosd["state"].items() if key in st}
    out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in fosd["param_groups"]]
    return out


def dcp_save_after(rank: int, world_size: int, layout: str, path: str, steps: int = 3) -> None:
    """Train ``steps`` steps on ``layout`` and ``dcp.save(get_state_dict(model, opt))``."""
    model, opt, dp_rank, dp = build(layout, world_size, 0)
    train(model, opt, range(steps), dp_rank, dp)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def dcp_resume_from(rank: int, world_size: int, layout: str, path: str, before: int = 3,
                    after: int = 2) -> dict:
    """A fresh ``layout`` model and optimizer (other weights) loaded from ``path`` (saved by
    :func:`dcp_save_after`, possibly on another world size or layout) with ``dcp.load`` +
    ``set_state_dict``, trained ``after`` more steps; the full parameters and momentum."""
    model, opt, dp_rank, dp = build(layout, world_size, 1)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    train(model, opt, range(before, before + after), dp_rank, dp)
    full = StateDictOptions(full_state_dict=True)
    fosd = get_optimizer_state_dict(model, opt, options=full)
    return dict(params={n: t.numpy() for n, t in get_model_state_dict(model, options=full).items()},
                momentum_buffer={n: st["momentum_buffer"].numpy() for n, st in fosd["state"].items()
                                 if "momentum_buffer" in st},
                layout=layout_problems(model, opt))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def init_optim_state(rank: int, world_size: int, layout: str) -> dict:
    """``get_optimizer_state_dict`` on a fresh optimizer (reads, does not step), then on one
    whose state was cleared (DCP's ``_init_optim_state`` steps with zero gradients, ``lr`` 0).

    Returns:
        ``steps_after_get``: the AdamW step counts after the first read; ``changed``: parameters
        whose local piece changed; ``grads``: parameters left with a gradient; ``nonzero``:
        state tensors not zero; ``lrs``: the groups' lr after; ``layout``: see
        :func:`layout_problems`; ``keys``: state entries per parameter after the second read.
    """
    model, opt, _, _ = build(layout, world_size, 0, named=False)
    get_optimizer_state_dict(model, opt)
    steps_after_get = sorted({float(st["step"]) for st in opt.state.values() if "step" in st})
    opt.state.clear()
    before = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
    get_optimizer_state_dict(model, opt)
    named = list(model.named_parameters())
    names = {id(p): n for n, p in named}
    nonzero = [f"{names[id(p)]}/{k}" for p, st in opt.state.items() for k, v in st.items()
               if k != "step" and _local(v).numel() and float(_local(v).abs().max()) != 0.0]
    return dict(steps_after_get=steps_after_get,
                changed=[n for n, p in named if not torch.equal(_local(p).detach(), before[n])],
                grads=[n for n, p in named if p.grad is not None], nonzero=nonzero,
                lrs=[g["lr"] for g in opt.param_groups], layout=layout_problems(model, opt),
                keys=sorted({tuple(sorted(st)) for st in opt.state.values()}),
                stateful=len(opt.state), params=len(named))


def mislaid_state(rank: int, world_size: int) -> str:
    """``opt.load_state_dict`` with a momentum_buffer whose shape is not the parameter's
    local piece (plain replicas here): the next step raises ``RuntimeError`` naming it."""
    mats = [nn.Parameter(torch.ones(6, 4)), nn.Parameter(torch.ones(5, 4))]
    opt = dmuon.Muon(mats, distributed_config=dmuon.create_dtensor_config(), **EXACT)
    sd = opt.state_dict()
    sd["state"][1]["momentum_buffer"] = torch.zeros(3, 4)
    opt.load_state_dict(sd)
    return distconfig_cases.step_error(opt, mats)
