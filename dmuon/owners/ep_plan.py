"""Owner plans under expert parallelism (experts ``Shard(0)`` over an ``"ep"`` mesh dim).

Ranks that differ in the ``"ep"`` coordinate hold different experts; ranks that share it (an
*expert group*, ``world / ep`` ranks) hold the same ``E / ep`` of every stack. Every group's
local stacks have the same shapes, so one plan serves all groups: the local experts are
balanced over the expert group, the dense matrices over all ranks, in two solves merged here
(:func:`expert_parallel_plan`, called by :func:`dmuon.owners.plan.build_plan`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping

from dmuon.owners.owner_plan import OwnerPlan


def expert_parallel_plan(solve: Callable[..., OwnerPlan], named_shapes: list, world_size: int,
                         expert_parallel: set[str], ep_size: int, *, costs, given: Mapping[str, bool], groups,
                         **options) -> OwnerPlan:
    """:func:`dmuon.owners.plan.build_plan` with expert parallelism (it calls this): the dense
    matrices over ``world_size`` ranks, the expert-parallel stacks' local experts over the
    ``world_size / ep_size`` ranks of an expert group, merged in model order.

    Args:
        solve: :func:`dmuon.owners.plan.build_plan` (passed in: this module does not import
            the module that imports it).
        named_shapes: ``(fqn, global shape)`` per dedicated parameter, in model order.
        world_size: ranks of the shard group (every rank of a replica of the mesh).
        expert_parallel: the FQNs of the stacks split ``Shard(0)`` over ``"ep"``.
        ep_size: size of the ``"ep"`` dimension.
        costs, groups: ``build_plan``'s, per parameter (split between the two solves).
        given: which of ``build_plan``'s options that this path does not take were given.
        options: the rest of ``build_plan``'s options, passed to both solves.

    Returns:
        The merged :class:`dmuon.owners.owner_plan.OwnerPlan` (``ep_size`` set, ``MatrixSpec.ep`` on
        the expert entries, ``extra["expert_parallel"]`` the expert solve's figures).

    Raises:
        ValueError: an ``ep_size`` that does not divide ``world_size``, an option this path
            does not take, an unknown FQN in ``expert_parallel``, or an expert-parallel
            parameter that is not a stack whose experts ``ep_size`` divides.
    """
    from dmuon.owners.stacks import param_layout

    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or world_size % ep_size:
        raise ValueError(f"dmuon: build_plan(ep_size={ep_size!r}) must be a positive int dividing "
                         f"world_size={world_size}")
    if any(given.values()):
        raise ValueError(f"dmuon: build_plan with expert parallelism takes no "
                         f"{[k for k, v in given.items() if v]}; leave them out")
    unknown = expert_parallel - {fqn for fqn, _ in named_shapes}
    if unknown:
        raise ValueError(f"dmuon: build_plan(expert_parallel=...) names {sorted(unknown)[:3]}, which "
                         f"are not among the matrices")
    blocks = dict(options.pop("blocks", None) or {})
    parts: dict[bool, list[int]] = {False: [], True: []}
    named: list[tuple[str, tuple[int, ...]]] = []
    for i, (fqn, shape) in enumerate(named_shapes):
        layout = param_layout(fqn, shape, blocks.get(fqn, 1))
        ep = fqn in expert_parallel
        if ep and (not layout.is_stack or layout.shape[0] % ep_size):
            raise ValueError(f"dmuon: expert-parallel parameter {fqn!r} has shape {layout.shape}; "
                             f"it must be a stack whose {layout.shape[0] if layout.is_stack else 0} "
                             f"experts the ep size {ep_size} divides")
        parts[ep].append(i)
        named.append((fqn, layout.local(ep_size).shape if ep else layout.shape))
    solved: dict[bool, OwnerPlan] = {}
    for ep, members in parts.items():
        solved[ep] = solve(
            [named[i] for i in members], world_size // ep_size if ep else world_size,
            costs=None if costs is None else [costs[i] for i in members],
            groups=None if groups is None else [groups[i] for i in members],
            blocks={named[i][0]: blocks[named[i][0]] for i in members if named[i][0] in blocks}, **options)
    # The two solves are independent; the expert group's owner x lands on the ranks x * ep + c
    # of every ep coordinate c: pair the most loaded expert owners with the expert-shard
    # positions whose dense load is lightest (a relabelling: each solve's balance is kept).
    group_size = world_size // ep_size
    dense_loads = solved[False].loads()
    expert_loads = [0.0] * group_size
    for m in solved[True].matrices:
        expert_loads[m.owner] += m.cost
    heavy_first = sorted(range(group_size), key=lambda x: (-expert_loads[x], x))
    light_first = sorted(range(group_size),
                         key=lambda x: (max(dense_loads[x * ep_size: (x + 1) * ep_size]), x))
    relabel = dict(zip(heavy_first, light_first))
    order = {fqn: i for i, (fqn, _) in enumerate(named)}
    matrices = sorted([*solved[False].matrices,
                       *(replace(m, ep=True, owner=relabel[m.owner]) for m in solved[True].matrices)],
                      key=lambda m: order[m.fqn])  # stable: a stack's ranges stay in expert order
    dense, experts = solved[False], solved[True]
    extra = dict(dense.extra)
    extra["expert_parallel"] = {"ep_size": ep_size, "group_size": world_size // ep_size,
                                "method": experts.method, "makespan": experts.makespan,
                                "lower_bound": experts.lower_bound, **dict(experts.extra)}
    plan = replace(dense, world_size=world_size, matrices=tuple(matrices),
                   method=dense.method if dense.matrices else experts.method, extra=extra, ep_size=ep_size)
    loads = plan.loads()
    # the merged bound: the two solves' work spread over every rank, or the largest item
    largest = max([dense.lower_bound if not dense.matrices else max(m.cost / m.matrices for m in dense.matrices),
                   *(m.cost / m.matrices for m in experts.matrices)], default=0.0)
    bound = max(sum(loads) / world_size, largest, dense.lower_bound, experts.lower_bound)
    makespan = max(loads, default=0.0)
    if options.get("solver_report"):  # the merged report (dmuon.profile reads it)
        inverse = {new: old for old, new in relabel.items()}
        dense_mem = dense.extra.get("memory_by_rank") or [0.0] * world_size
        expert_mem = experts.extra.get("memory_by_rank") or [0.0] * group_size
        proven = max(bound, *(float(p.extra.get("proven_bound") or 0.0) for p in (dense, experts)))
        extra.update(
            memory_by_rank=[dense_mem[g] + expert_mem[inverse[g // ep_size]] for g in range(world_size)],
            proven_bound=proven, optimal=makespan <= proven * (1 + 1e-12),
            detail=f"dense {dense.extra.get('detail')}, experts {experts.extra.get('detail')}",
            milp_status=", ".join(f"{name} {p.extra.get('milp_status')}" for name, p in
                                  (("dense", dense), ("experts", experts))),
            solve_s=float(dense.extra.get("solve_s", 0.0)) + float(experts.extra.get("solve_s", 0.0)))
        plan = replace(plan, extra=extra)
    return replace(plan, makespan=makespan, lower_bound=bound)
