"""The owner plan ``dedicate_params`` solves without a plan file, from shapes.

It is solved before ``Muon`` knows its ``overlap``, so it serves both: the least exposed time
(:mod:`dmuon.balance.deadline`) among plans within
:data:`dmuon.balance.deadline.MAKESPAN_SLACK` of the best makespan. Forward times are
estimated from the dedicated matrices' shapes, units in registration order (deadlines come
early); for models that interleave units (pi0), ``python -m dmuon.profile --objective
exposed`` does better.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from torch import nn

from dmuon.balance.deadline import MAKESPAN_SLACK, deadlines_from_forward
from dmuon.balance.profiler import unit_times
from dmuon.hooks import fsdp_adapter as fsdp
from dmuon.hooks.bind import Selected, publish_units
from dmuon.owners.plan import OwnerPlan, build_plan

#: Default tokens per rank per micro-batch through each dedicated matrix: the forward times
#: that set each unit's deadline (``python -m dmuon.profile --tokens``' default too).
DEFAULT_FORWARD_TOKENS = 4096

#: Wall-clock limit of the runtime solve's searches, seconds: Pi0's 420 matrices on 8 ranks
#: solve in ~0.55 s on a shared 2-core VM.
RUNTIME_TIME_LIMIT_S = 0.5

#: CBC's time limit with ``solver="milp"``, seconds.
RUNTIME_MILP_TIME_LIMIT_S = 5.0

#: ``dedicate_params(solver=...)``: ``"heuristic"`` (within 1% of the MILP on the shipped
#: inventories, docs/performance.md) or ``"milp"`` (CBC warm-started from it, never worse).
SOLVERS = ("heuristic", "milp")


def default_plan(model: nn.Module, selected: list[Selected], world_size: int, *, tp_size: int,
                 blocks: Mapping[str, int], expert_parallel: Sequence[str], ep_size: int,
                 group_cost: float, forward_tokens: int, solver: str = "heuristic") -> OwnerPlan:
    """The plan of the module docstring; the makespan plan under tensor or expert parallelism.
    A unit's forward FLOPs: ``2 * forward_tokens * rows * cols`` per matrix (a stack as one),
    0 for a unit holding another (the FSDP2 root). ``ValueError``: ``solver`` not in
    :data:`SOLVERS`."""
    if solver not in SOLVERS:
        raise ValueError(f"dmuon: solver must be one of {SOLVERS}, got {solver!r}")
    limit = RUNTIME_MILP_TIME_LIMIT_S if solver == "milp" else RUNTIME_TIME_LIMIT_S
    named = [(s.fqn, s.shape) for s in selected]
    units, modules = publish_units(model, selected, fsdp.parent_map(model))
    if tp_size > 1 or expert_parallel or ep_size != 1:
        return build_plan(named, world_size, tp_size=tp_size,
                          groups=units if group_cost > 0 else None, group_cost=group_cost,
                          blocks=blocks, expert_parallel=expert_parallel, ep_size=ep_size,
                          method=solver, time_limit_s=limit)
    shapes: list[list[tuple[int, int]]] = [[] for _ in modules]
    for sel, k in zip(selected, units):
        shapes[k].append((int(sel.shape[-2]), int(sel.shape[-1])))
    forward, _, _ = unit_times(shapes, tokens=forward_tokens, measure=False)
    unit_ids = {id(m) for m in modules}
    holds = [any(id(m) in unit_ids for m in unit.modules() if m is not unit) for unit in modules]
    forward = [0.0 if hold else f for f, hold in zip(forward, holds)]
    plan = build_plan(named, world_size, groups=units, group_cost=group_cost, blocks=blocks,
                      deadlines=deadlines_from_forward(forward), makespan_slack=MAKESPAN_SLACK,
                      method=solver, time_limit_s=limit)
    extra = dict(plan.extra, forward_tokens=int(forward_tokens),
                 forward_source=f"FLOP model 2 x {int(forward_tokens)} tokens x rows x cols")
    return dataclasses.replace(plan, extra=extra)
