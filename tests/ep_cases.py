"""Expert parallelism (issue 26 item 4) on gloo ranks: the torchtitan layout.

The model is :func:`tests.moe_cases.ep_moe_net` (two top-1 MoE blocks of grouped expert stacks
``[E, hidden, width]``, a dense router and projection per block). :func:`parallelize` lays it
out as torchtitan does: a mesh ``(efsdp, ep)`` (torchtitan's ``("efsdp", "ep")``, once
``("dp_shard_mod_ep", "ep")``), each block's expert stacks ``distribute_tensor(..., Shard(0))``
over ``"ep"`` with the tokens dispatched there by all-to-all, ``fully_shard(experts,
mesh=efsdp)``, and every block and the root ``fully_shard`` over the flattened mesh of all ranks.
:func:`train` then runs dmuon on that mesh in fp32 exact mode; the reference is
:func:`tests.moe_cases.reference` (single process, every expert local, ``torch.optim.Muon`` on
each expert's 2-D slice + ``AdamW``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
from torch import nn

from dmuon.integrations.hf_moe import shard_experts
from tests import moe_cases as cases
from tests.moe_cases import full_params
from tests.dist_cases import count_ns
from tests.overlap_cases import counted_jobs, slow_jobs

def _experts_of(block: nn.Module) -> nn.Module | None:
    """The module holding a block's expert stacks: ``block.experts`` (:class:`EPMoE`),
    ``block.mlp.experts`` (a Hugging Face MoE decoder layer), ``None`` for a dense layer."""
    return block.experts if hasattr(block, "experts") else getattr(block.mlp, "experts", None)


def parallelize(model: nn.Module, world_size: int, ep: int, *, one_d: bool = False,
                before: Any = None, replicas: int = 1, case: str = "ep-moe"):
    """torchtitan's layout on ``world_size`` ranks with ``ep`` expert-parallel ranks; returns
    the ``(efsdp, ep)`` mesh (the one dmuon is given).

    With ``one_d`` (``ep == world_size``) the mesh is ``("ep",)``: no expert FSDP2 dim, so the
    expert stacks stay out of the blocks' ``fully_shard`` (``ignored_params``; FSDP2 cannot
    shard a DTensor over a mesh overlapping its own). ``before(mesh)`` runs after the experts
    are distributed and before any ``fully_shard`` (``dedicate_params`` called first).
    With ``replicas > 1``: HSDP in front, ``("replicate", "efsdp", "ep")``; the experts are
    ``fully_shard``-ed over ``("replicate", "efsdp")``, the dense blocks over ``("replicate",
    efsdp x ep)`` (torchtitan's ``dp_replicate`` with expert parallelism)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    if one_d:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
        # the dense blocks' mesh has its own name: a dim named "ep" marks expert parallelism
        ep_mesh, dense = mesh, init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    elif replicas > 1:
        mesh = init_device_mesh("cpu", (replicas, world_size // replicas // ep, ep),
                                mesh_dim_names=("replicate", "efsdp", "ep"))
        ep_mesh = mesh["ep"]
        mesh["efsdp", "ep"]._flatten("dp_shard")
        dense = mesh["replicate", "dp_shard"]
    else:
        mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("efsdp", "ep"))
        ep_mesh = mesh["ep"]
        dense = mesh._flatten("dp")  # every rank: the dense blocks' FSDP2 mesh (torchtitan's "fsdp")
    layout = [(block, _experts_of(block)) for block in cases.CASES[case].blocks(model)
              if _experts_of(block) is not None]  # DeepSeek-V3's first layers are dense
    for block, experts in layout:
        if isinstance(block, cases.EPMoE):
            block.ep_group = ep_mesh.get_group()
            for name, p in list(experts.named_parameters(recurse=False)):
                experts.register_parameter(name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)])))
        else:  # a Hugging Face layer: dmuon's public experts forward dispatches its tokens
            shard_experts(experts, ep_mesh)
    if before is not None:
        before(mesh)
    for block, experts in layout:
        if one_d:
            fully_shard(block, mesh=dense, ignored_params=set(experts.parameters()))
        else:
            fully_shard(experts, mesh=mesh["replicate", "efsdp"] if replicas > 1 else mesh["efsdp"])
            fully_shard(block, mesh=dense)
    fully_shard(model, mesh=dense)
    return mesh


def owned_experts(model: nn.Module) -> list[tuple[str, int]]:
    """``(stack, global expert)`` of every expert-parallel matrix this rank owns."""
    owned = []
    for rec in model._dmuon_state.records:
        if rec.is_owner and rec.group is not None:
            owned += [(rec.fqn, e) for e in range(*rec.experts)]
    return owned


def spread_plan(model: nn.Module, predicate, world_size: int, ep: int):
    """A plan whose expert stacks are split over every rank of their expert group (experts
    priced far above any other matrix); the tiny model's default plan may keep a stack whole."""
    from dmuon.hooks.dedicate import select_matrices
    from dmuon.owners.plan import build_plan

    selected = select_matrices(model, predicate, ep_name="ep", ep_size=ep)
    return build_plan([(s.fqn, s.shape) for s in selected], world_size, method="greedy",
                      costs=[1e6 * s.layout.count if s.layout.is_stack else 1.0 for s in selected],
                      expert_parallel=[s.fqn for s in selected if s.ep > 1], ep_size=ep)


def train(rank: int, world_size: int, *, ep: int, case: str = "ep-moe", steps: int = 3, spread: bool = True,
          one_d: bool = False, dedicate_first: bool = False, micro_batches: int = 1,
          replicas: int = 1, replicate_mode: str = "auto", overlap: str = "off") -> dict[str, Any]:
    """:func:`parallelize`, dedicate (with ``spread``, a plan that splits every expert stack over
    its expert group), train ``steps`` in fp32 exact mode. Returns the full parameters (rank 0),
    the losses, the plan entries and, per rank, the local expert shard sizes FSDP2 had."""
    import dmuon

    model = cases.build(case)
    predicate = dmuon.default_predicate(model)
    dedicated: list = []

    def dedicate(mesh) -> None:
        plan = spread_plan(model, predicate, world_size // replicas, ep) if spread else None
        # without spread, the default plan as dedicate_params solves it (group cost by backend)
        dedicated.append(dmuon.dedicate_params(model, mesh, predicate=predicate, plan=plan,
                                               group_cost=0.0 if spread else "auto",
                                               replicate_mode=replicate_mode))

    mesh = parallelize(model, world_size, ep, one_d=one_d, before=dedicate if dedicate_first else None,
                       replicas=replicas, case=case)
    shard_rows = [tuple(p.to_local().shape)[0] for n, p in model.named_parameters()
                  if n.endswith(("experts.w1", "experts.gate_up_proj"))]
    if not dedicate_first:
        dedicate(mesh)
    plan = dedicated[0]
    opt = dmuon.Muon(model, **cases.OPT_KWARGS, overlap=overlap)
    ns = count_ns(opt)
    # overlapped: every job starts 20 ms late, so a reader that did not wait would see old weights
    counts: dict = {}
    with slow_jobs() if overlap != "off" else contextlib.nullcontext(), counted_jobs(counts):
        losses, norm0 = _train_steps(model, opt, case, steps, rank, world_size, micro_batches)
    return dict(params=full_params(model, rank), losses=losses, shard_rows=shard_rows, grad_norm0=norm0,
                owned_experts=owned_experts(model),
                entries=[(m.key, m.owner, m.ep) for m in plan.matrices], digest=plan.digest(),
                ns_matrices=ns["n"], scheduled=counts["scheduled"])


def _train_steps(model: nn.Module, opt: Any, case: str, steps: int, rank: int, world_size: int,
                 micro_batches: int) -> tuple[list[float], float | None]:
    """:func:`train`'s loop: ``steps`` steps of ``micro_batches`` each; the losses and the
    first step's global gradient norm."""
    import dmuon

    losses, norm0 = [], None
    for step in range(steps):
        batch = cases.local_batch(case, step, rank, world_size)
        chunks = list(zip(*(t.chunk(micro_batches) for t in batch)))
        loss = 0.0
        for k, chunk in enumerate(chunks):  # gradient accumulation: dmuon.no_sync but the last
            part = cases.CASES[case].loss(model, *chunk) / len(chunks)
            if k < len(chunks) - 1:
                with dmuon.no_sync(model):
                    part.backward()
            else:
                part.backward()
            loss += part.detach()
        if step == 0:  # the global gradient norm over dense and expert-parallel matrices
            norm0 = float(dmuon.clip_grad_norm_(model, float("inf")))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norm0


def checkpoint_roundtrip(rank: int, world_size: int, *, ep: int = 2, path: str | None = None) -> dict[str, Any]:
    """Train 2 steps with the expert stacks split over their groups, take ``dmuon.state_dict``
    (``dcp.save`` to ``path``, or a deep copy without one), train a third step, load it back,
    train the third step again: bitwise the same. Returns whether it was, and the dedicated
    keys this rank offers."""
    import copy

    import torch.distributed.checkpoint as dcp

    import dmuon

    model = cases.build("ep-moe")
    mesh = parallelize(model, world_size, ep)
    predicate = dmuon.default_predicate(model)
    dmuon.dedicate_params(model, mesh, predicate=predicate, plan=spread_plan(model, predicate, world_size, ep))
    opt = dmuon.Muon(model, **cases.OPT_KWARGS)

    def step(i: int) -> None:
        cases.CASES["ep-moe"].loss(model, *cases.local_batch("ep-moe", i, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()

    for i in range(2):
        step(i)
    saved = dmuon.state_dict(model, opt)
    keys = sorted(k for k in saved["model"] if "experts" in k)
    if path is None:
        saved = copy.deepcopy(saved)
    else:  # DCP writes each key once: two expert groups offering one key would lose one
        dcp.save(saved, checkpoint_id=path)
    step(2)
    first = full_params(model, rank)
    if path is not None:
        saved = dmuon.state_dict(model, opt)
        dcp.load(saved, checkpoint_id=path)
    dmuon.load_state_dict(model, opt, saved)
    step(2)
    again = full_params(model, rank)
    same = set(first) == set(again) and all(np.array_equal(first[k], again[k]) for k in first)
    return dict(same=same, keys=keys)


def bad_ep(rank: int, world_size: int, *, case: str) -> str:
    """``dedicate_params`` on a bad expert-parallel layout; the error this rank raises.

    ``"indivisible"``: 3 experts ``Shard(0)`` over an ``"ep"`` dimension of 2 ranks.
    ``"no-ep-mesh"``: 4 experts ``Shard(0)`` over ``"ep"``, but ``dedicate_params`` is given a
    mesh without an ``"ep"`` dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dmuon

    torch.manual_seed(0)
    model = cases.GroupedExperts(8, 6, 3 if case == "indivisible" else 4)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    model.w1 = nn.Parameter(distribute_tensor(model.w1.data, mesh, [Shard(0)]))
    given = mesh if case == "indivisible" else init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    try:
        dmuon.dedicate_params(model, given)
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def reference_grad_norm(case: str, world_size: int) -> float:
    """The single-process model's total gradient 2-norm at step 0 on the global batch."""
    model = cases.build(case)
    cases.CASES[case].loss(model, *cases.CASES[case].batch(0, cases.LOCAL_BATCH * world_size)).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
