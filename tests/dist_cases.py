"""Functions that run on every rank of the test pool (see ``tests/_pool.py``)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from tests import models, ns_accumulation


def build(world_size: int, mode: str, *, plan=None, predicate=None, variant: str = "",
          keep_block: int | None = None, **dedicate_kwargs):
    """The test model on a 1-D mesh: ``mode`` is "fsdp" (dedicate after fully_shard),
    "fsdp-before" (dedicate first) or "replicated" (no FSDP2). ``keep_block``: that block gets
    ``fully_shard(reshard_after_forward=False)``."""
    model = models.make_model(variant=variant)
    mesh = init_device_mesh("cpu", (world_size,))
    # NCCL's default: owners spread by makespan alone, so blocks have several owners and the
    # multi-owner publish and bucket paths are exercised; gloo's "auto" has its own test.
    dedicate_kwargs.setdefault("group_cost", 0.0)
    if mode == "fsdp-before":
        dmuon.dedicate_params(model, mesh, plan=plan, predicate=predicate, **dedicate_kwargs)
    if mode in ("fsdp", "fsdp-before"):
        for i, block in enumerate(model.blocks):
            fully_shard(block, mesh=mesh, **({"reshard_after_forward": False} if i == keep_block else {}))
        fully_shard(model, mesh=mesh)
    if mode in ("fsdp", "replicated"):
        dmuon.dedicate_params(model, mesh, plan=plan, predicate=predicate, **dedicate_kwargs)
    return model, mesh


def count_ns(opt: Any) -> dict:
    """Counts, in the returned ``{"n": int}``, the matrices whose Newton-Schulz ``opt.step()``
    runs on this rank (under tensor parallelism: those it is the TP owner of), by wrapping
    this optimizer's ``step_muon``."""
    strategy = opt.strategy
    step_muon = strategy.step_muon
    counter = {"n": 0}

    def counted(group: dict, clip: Any = None) -> None:
        state = strategy.state
        counter["n"] += sum(1 for *_, rec in strategy._owned(group)
                            if state.roles.tp is None or rec.tp_owner == state.tp_rank)
        step_muon(group, clip)

    strategy.step_muon = counted
    return counter


def full_params(model: torch.nn.Module, rank: int) -> dict[str, np.ndarray]:
    """Every parameter's full value on rank 0 (``{}`` elsewhere), assembled from the owners'
    masters (TP slices concatenated, HSDP replica 0) and full FSDP2/TP tensors (collective).
    A model without owners (the ``distributed_config`` path): its parameters, full."""
    state = getattr(model, "_dmuon_state", None)
    if state is not None:  # Muon(overlap=...): masters read directly, after their pending updates
        state.pending.wait_all()
    mine = {} if state is None else {
        rec.fqn: (state.tp_rank, rec.tp_shard_dim, rec.master.detach().numpy().copy())
        for rec in state.records if rec.is_owner and state.replicate_rank == 0}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    pieces: dict[str, list] = {}
    for part in parts:
        for fqn, piece in part.items():
            pieces.setdefault(fqn, []).append(piece)
    out: dict[str, np.ndarray] = {}
    for fqn, ps in pieces.items():
        ps.sort(key=lambda p: p[0])
        dim = ps[0][1]
        out[fqn] = ps[0][2] if dim is None else np.concatenate([p[2] for p in ps], axis=dim)
    for name, p in model.named_parameters():
        if name not in out:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = t.detach().numpy().copy()
    return out if rank == 0 else {}

def train(rank: int, world_size: int, *, mode: str = "fsdp", steps: int = 5,
          opt_kwargs: dict | None = None, clip: float | None = None,
          lr_gamma: float | None = None, dedicate_kwargs: dict | None = None,
          micro_batches: int = 1, accumulate_with: str = "dmuon", variant: str = "",
          fp32_accumulate: bool = False) -> dict:
    """Train the test model with dmuon; return final params (rank 0), losses, NS counts.

    ``micro_batches > 1`` splits each local batch and accumulates gradients without sync on
    all but the last micro-batch, through ``dmuon.no_sync`` or FSDP2's
    ``set_requires_gradient_sync`` (``accumulate_with="fsdp"``).
    """
    model, _ = build(world_size, mode, variant=variant, **(dedicate_kwargs or {}))
    kwargs = dict(lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
                  ns_dtype=torch.float32, ns_coefficients="muon")
    kwargs.update(opt_kwargs or {})
    opt = dmuon.Muon(model, **kwargs)
    ns = count_ns(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=lr_gamma) if lr_gamma else None
    losses, norms, counts = [], [], []
    state = model._dmuon_state
    # fp32_accumulate: the Newton-Schulz products accumulate in fp32 whatever the CPU's kernels
    # do (tests/ns_accumulation.py); restored on exit, the pool's workers are reused.
    with ns_accumulation.fp32_accumulation() if fp32_accumulate else contextlib.nullcontext():
        for step in range(steps):
            idx, y = models.local_batch(step, rank, world_size)
            if micro_batches == 1:
                loss = models.loss_fn(model, idx, y)
                loss.backward()
            else:
                chunks = list(zip(idx.chunk(micro_batches), y.chunk(micro_batches)))
                for i, (ci, cy) in enumerate(chunks):
                    last = i == len(chunks) - 1
                    if accumulate_with == "fsdp":
                        model.set_requires_gradient_sync(last)
                        ctx = contextlib.nullcontext()
                    else:
                        ctx = contextlib.nullcontext() if last else dmuon.no_sync(model)
                    with ctx:
                        loss = models.loss_fn(model, ci, cy) / micro_batches
                        loss.backward()
            losses.append(loss.item())
            if clip is not None:
                norms.append(float(dmuon.clip_grad_norm_(model, clip)))
            before = ns["n"]
            opt.step()
            counts.append(ns["n"] - before)
            opt.zero_grad()
            if sched is not None:
                sched.step()
    owned = sorted(rec.fqn for rec in state.records if rec.is_owner)
    placeholders_empty = all(rec.master.numel() == 0 for rec in state.records if not rec.is_owner)
    listed = {n for n, _ in model.named_parameters()}
    return dict(params=full_params(model, rank), losses=losses, norms=norms, ns_counts=counts,
                owned=owned, placeholders_empty=placeholders_empty, listed=sorted(listed),
                publish_groups=len(state.groups), plan_extra=dict(state.plan.extra))


def state_dict_roundtrip(rank: int, world_size: int, *, mode: str = "fsdp", first: int = 3,
                         then: int = 2) -> dict:
    """Train ``first`` steps, save model+optimizer state dicts, restore into a fresh model and
    optimizer, train ``then`` more; also train ``first + then`` uninterrupted. Return both."""
    kwargs = dict(lr=0.02, adamw_lr=0.01, ns_method="standard", ns_dtype=torch.float32,
                  ns_coefficients="muon")

    def run(model, opt, steps):
        for step in steps:
            idx, y = models.local_batch(step, rank, world_size)
            models.loss_fn(model, idx, y).backward()
            opt.step()
            opt.zero_grad()

    model, _ = build(world_size, mode)
    opt = dmuon.Muon(model, **kwargs)
    run(model, opt, range(first))
    saved_model = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                   for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # state_dict() aliases live buffers
    run(model, opt, range(first, first + then))
    straight = full_params(model, rank)

    model2, _ = build(world_size, mode)
    opt2 = dmuon.Muon(model2, **kwargs)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    run(model2, opt2, range(first, first + then))
    return dict(straight=straight, restored=full_params(model2, rank))


def call_and_capture(rank: int, world_size: int, *, case: str) -> str:
    """Run a bad-input case; return ``"<ExceptionType>: <message>"`` (or "no error")."""
    try:
        _bad_input(case, rank, world_size)
    except Exception as e:  # noqa: BLE001 - the test inspects the exact type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _bad_input(case: str, rank: int, world_size: int) -> None:
    if case == "mesh-2d-unnamed":
        model = models.make_model()
        mesh = init_device_mesh("cpu", (2, world_size // 2))
        dmuon.dedicate_params(model, mesh)
    elif case == "twice":
        model, mesh = build(world_size, "fsdp")
        dmuon.dedicate_params(model, mesh)
    elif case == "non-2d-predicate":
        model, mesh = models.make_model(), init_device_mesh("cpu", (world_size,))
        dmuon.dedicate_params(model, mesh, predicate=lambda name, p: p.ndim >= 1 and "emb" not in name)
    elif case == "bad-reduce-mode":
        model, mesh = models.make_model(), init_device_mesh("cpu", (world_size,))
        dmuon.dedicate_params(model, mesh, reduce_mode="scatter")
    elif case == "bad-group-cost":
        model, mesh = models.make_model(), init_device_mesh("cpu", (world_size,))
        dmuon.dedicate_params(model, mesh, group_cost=-1.0)
    elif case == "plan-other-world":
        model, mesh = models.make_model(), init_device_mesh("cpu", (world_size,))
        names = [(n, tuple(p.shape)) for n, p in model.named_parameters() if n in models.matrix_names(model)]
        dmuon.dedicate_params(model, mesh, plan=dmuon.build_plan(names, world_size + 1))
    elif case == "plan-other-model":
        model, mesh = models.make_model(), init_device_mesh("cpu", (world_size,))
        dmuon.dedicate_params(model, mesh, plan=dmuon.build_plan([("other.weight", (4, 4))], world_size))
    elif case == "plan-differs-by-rank":
        model, mesh = models.make_model(), init_device_mesh("cpu", (world_size,))
        names = [(n, tuple(p.shape)) for n, p in model.named_parameters() if n in models.matrix_names(model)]
        plan = dmuon.build_plan(names, world_size)
        if rank == world_size - 1:  # the last rank moves one matrix to another owner
            m0 = plan.matrices[0]
            moved = dmuon.MatrixSpec(fqn=m0.fqn, shape=m0.shape, owner=(m0.owner + 1) % world_size)
            plan = dmuon.OwnerPlan(world_size=world_size, matrices=(moved, *plan.matrices[1:]))
        dmuon.dedicate_params(model, mesh, plan=plan)
    else:
        raise KeyError(case)


def tied_dedicated_refused(rank: int, world_size: int) -> str:
    """A predicate that selects a tied matrix must be refused at dedicate_params time."""
    model = models.make_model(variant="tied")
    mesh = init_device_mesh("cpu", (world_size,))
    try:
        dmuon.dedicate_params(model, mesh, predicate=lambda name, p: p.ndim == 2)
    except ValueError as e:
        return str(e)
    return "no error"


def publish_counts(rank: int, world_size: int, *, steps: int = 3, one_owner: bool = False,
                   keep_block: int | None = None, reshard: bool | None = None) -> dict:
    """Broadcasts dmuon issues per training step (forward, backward and the step's own
    publication), counted by wrapping ``dmuon.comm.collectives.publish`` (what each publish group calls), and the number of
    (block, owner) publish groups per FSDP2 block, counted from the plan's owners.

    Args:
        one_owner: rank 0 owns every matrix, so each block's two matrices (``fc1``, ``fc2``:
            two modules, two units) form one group.
        keep_block: ``fully_shard`` this block with ``reshard_after_forward=False``.
        reshard: dmuon's ``reshard_after_forward`` (None: follow FSDP2).
    """
    import dmuon.comm.collectives as comm

    plan = None
    if one_owner:
        model = models.make_model()
        plan = dmuon.OwnerPlan(world_size=world_size, matrices=tuple(
            dmuon.MatrixSpec(fqn=n, shape=tuple(p.shape), owner=0)
            for n, p in model.named_parameters() if n in models.matrix_names(model)))
    model, _ = build(world_size, "fsdp", plan=plan, keep_block=keep_block, reshard_after_forward=reshard)
    opt = dmuon.Muon(model, lr=0.02, ns_dtype=torch.float32)
    calls = []
    original = comm.publish

    def counting(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)

    comm.publish = counting
    try:
        per_step = []
        for step in range(steps):
            before = len(calls)
            idx, y = models.local_batch(step, rank, world_size)
            models.loss_fn(model, idx, y).backward()
            opt.step()
            opt.zero_grad()
            per_step.append(len(calls) - before)
    finally:
        comm.publish = original
    state = model._dmuon_state
    owners: dict[str, set[int]] = {}
    for spec in state.plan.matrices:
        block = ".".join(spec.fqn.split(".")[:2]) if spec.fqn.startswith("blocks.") else "root"
        owners.setdefault(block, set()).add(spec.owner)
    return dict(per_step=per_step, groups={b: len(o) for b, o in owners.items()},
                first_unit_groups=len(state.units[0].groups))
