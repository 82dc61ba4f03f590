"""The author of owner plans: which rank owns which dedicated matrix, solved from shapes.

:func:`build_plan` prices every dedicated matrix (or expert of a stack) by its Newton-Schulz
cost, balances them over the ranks (:func:`dmuon.balance.solve`) and returns an
:class:`OwnerPlan`; under expert parallelism it hands over to
:func:`dmuon.owners.ep_plan.expert_parallel_plan`. :func:`build_bucket_plan` cuts the plain
replicated module's DDP-style buckets. The plan itself (:class:`MatrixSpec`,
:class:`OwnerPlan`, its JSON form) is :mod:`dmuon.owners.owner_plan`, re-exported here, and its
checks against a model and a mesh are :mod:`dmuon.owners.plan_checks`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from dmuon.balance.cost import ReplicaCost
from dmuon.owners.ep_plan import expert_parallel_plan
from dmuon.owners.owner_plan import PLAN_SCHEMA_VERSION, MatrixSpec, OwnerPlan

__all__ = ["PLAN_SCHEMA_VERSION", "MatrixSpec", "OwnerPlan", "build_bucket_plan", "build_plan"]


def build_plan(
    named_shapes: Iterable[tuple[str, Sequence[int]]],
    world_size: int,
    *,
    costs: Sequence[float] | None = None,
    cost_unit: str = "flops",
    blocks: Mapping[str, int] | None = None,
    method: str = "auto",
    time_limit_s: float = 5.0,
    tp_size: int = 1,
    groups: Sequence[int] | None = None,
    group_cost: float = 0.0,
    layout: tuple[int, int] | None = None,
    memory_cap_bytes: float | None = None,
    batch_overhead: Mapping[tuple[int, int], float] | None = None,
    replicate_mode: str | None = None,
    replica_cost: ReplicaCost | None = None,
    solver_report: bool = False,
    bucket_bytes: int | None = None,
    element_size: int = 4,
    expert_parallel: Iterable[str] = (),
    ep_size: int = 1,
    deadlines: Sequence[float] | None = None,
    makespan_slack: float | None = None,
) -> OwnerPlan:
    """Every per-matrix decision of an owner plan, from a model's matrices or an inventory.

    The one plan author: ``dedicate_params`` (matrices and publish groups read off the model),
    ``python -m dmuon.profile`` (a model built on ``meta`` or a named inventory, profiled
    costs, XOR layout, memory cap) and the ``distributed_config`` path
    (:func:`dmuon.distconfig.strategies.balanced_assign_fn`) all call it. It decides the owner
    (balancing Newton-Schulz cost with :func:`dmuon.balance.solve`), the TP owner, the owners'
    spread over the node x GPU grid and within each publish group, and the HSDP replicate mode.

    Args:
        named_shapes: ``(fqn, shape)`` per dedicated parameter, in model order: ``(rows,
            cols)`` for a matrix, ``(*lead, rows, cols)`` for a stack of matrices (experts),
            which the balancer sees expert by expert and the plan records as expert ranges,
            one per owner (:mod:`dmuon.owners.stacks`, the shape seam).
        world_size: number of ranks to spread owners over (the data-parallel shard group).
        costs: per-parameter cost (a stack's is shared evenly by its experts); defaults to
            the Gram Newton-Schulz FLOP model (:func:`dmuon.kernels.ns_flops`) per
            Newton-Schulz matrix. With ``batch_overhead``, the marginal part.
        blocks: row blocks per stored matrix, by FQN (default 1: each matrix whole).
        cost_unit: unit of ``costs`` (``"flops"`` or ``"ms"``).
        method: passed to :func:`dmuon.balance.solve` (``"greedy"``, ``"milp"``, ``"auto"``).
            ``"milp"``/``"auto"`` may stop at a time limit, so their plan can depend on timing:
            solve on one rank and broadcast (``dedicate_params`` does).
        time_limit_s: wall-clock limit of the MILP, seconds.
        tp_size: TP group size; Newton-Schulz then runs on the (DP owner, TP owner) rank, so
            the balancer spreads costs over ``world_size * tp_size`` ranks (solver rank
            ``owner * tp_size + tp_owner``).
        groups: publish group per matrix (its FSDP2 block: :func:`dmuon.hooks.fsdp_adapter.publish_block`
            on a model, :func:`dmuon.balance.inventories.layer_groups` on an inventory), for
            ``group_cost`` and ``layout``. Default with ``layout``: ``layer_groups``.
        group_cost: step time of one publish (group, owner) pair in ``cost_unit``; the solver
            then minimizes ``makespan + group_cost * pairs`` and ``layout`` is not applied.
            Ignored with ``tp_size > 1``, where publications go per DP owner and the solver's
            ranks are (DP, TP) pairs (:mod:`dmuon.balance.grouping`).
        layout: ``(nodes, gpus_per_node)`` with ``nodes * gpus_per_node == world_size *
            tp_size``: owners follow the XOR layout at equal per-rank loads
            (:mod:`dmuon.balance.layout`).
        memory_cap_bytes: bytes of masters, momenta and gradients allowed per rank
            (:func:`dmuon.balance.cost.owner_memory`), or ``None``.
        batch_overhead: per-shape cost paid once per rank owning any matrix of that shape
            (:func:`dmuon.balance.cost.fit_batch_costs`); ``MatrixSpec.cost`` then includes it.
        replicate_mode: HSDP replicate mode per matrix (:meth:`OwnerPlan.with_replicate_modes`);
            ``None`` (default) without a replicate dimension.
        replica_cost: the cost model of ``replicate_mode="auto"`` (default
            :class:`dmuon.balance.cost.ReplicaCost`).
        solver_report: record the solver's ``proven_bound``, ``optimal``, ``detail``,
            ``milp_status``, ``solve_s``, the layout and ``memory_by_rank`` (bytes) in
            ``extra``. Without it, ``extra["milp_status"]`` is still set when CBC failed and
            the plan is the heuristic fallback (:func:`dmuon.balance.milp.milp_fallback`).
        bucket_bytes: the DDP-style path (``replicas="keep"``, plain module on a 1-D mesh):
            matrices are cut into contiguous buckets in backward (reverse model) order, each
            closed once it holds this many bytes (``bucket_cap_mb * 2**20``, > 0, as DDP's), at
            least ``world_size`` of them, where their Newton-Schulz cost plus broadcast bytes
            balance; each bucket gets one owner (:func:`dmuon.balance.buckets.assign_buckets`);
            ``MatrixSpec.bucket`` records it.
            Takes none of ``tp_size > 1``, ``groups``, ``group_cost``, ``layout``,
            ``memory_cap_bytes``, ``batch_overhead``, ``replicate_mode``.
        element_size: bucket path: bytes per gradient element (4 for fp32).
        expert_parallel: FQNs of the expert stacks split ``Shard(0)`` over the mesh's ``"ep"``
            dimension of ``ep_size`` ranks (``named_shapes`` gives their global shape): each
            rank holds ``E / ep_size`` experts of such a stack, and their owners are drawn from
            the ``world_size / ep_size`` ranks holding the same experts. They are balanced
            among themselves in a second solve over that group (the same plan serves every
            ``"ep"`` coordinate, whose experts have the same shapes); the other matrices over
            all ``world_size`` ranks. The plan's makespan and lower bound cover both
            (:meth:`OwnerPlan.loads`); ``extra["expert_parallel"]`` holds the expert solve's.
            Takes none of ``tp_size > 1``, ``layout``, ``replicate_mode``, ``bucket_bytes``.
        ep_size: size of the ``"ep"`` dimension (divides ``world_size``).
        deadlines: forward start of each publish group (``groups``, default ``layer_groups``;
            ids in forward order), in ``cost_unit``: the owners then minimize the Newton-Schulz
            time the next forward waits for under overlap (:func:`dmuon.balance.solve` with
            ``deadlines``) instead of the makespan, without the XOR layout; ``extra`` records
            ``objective="exposed"``, ``exposed`` and ``exposed_bound``. Takes none of
            ``tp_size > 1``, ``group_cost``, ``memory_cap_bytes``, expert parallelism,
            ``bucket_bytes``.
        makespan_slack: with ``deadlines``: the runtime's objective instead
            (:func:`dmuon.balance.solve`, what ``dedicate_params`` solves
            without a plan file): the least exposed time among plans whose makespan is at most
            ``1 + makespan_slack`` times the makespan plan's (and whose publish pairs are no
            more than its, with ``group_cost``); ``group_cost`` is then allowed. ``extra``
            records ``objective="overlap"``, ``exposed``, ``exposed_bound``,
            ``makespan_plan_exposed``, ``makespan_plan_makespan`` and ``candidate``.

    Returns:
        The plan, with makespan and lower bound from the solver; ``extra`` records
        ``group_cost`` and ``publish_pairs`` when a group cost was used (and the report above);
        on the bucket path ``buckets``, ``bucket_cap_bytes``, ``ns_share`` and ``bytes_share``.

    Raises:
        ValueError: from :func:`dmuon.balance.solve` (bad costs, ``group_cost`` without
            ``groups``, an infeasible memory cap), a ``layout`` that does not cover the ranks,
            an unknown ``replicate_mode``, ``bucket_bytes <= 0`` or with an option the bucket
            path does not take.
    """
    from dmuon.balance import solve
    from dmuon.balance.cost import owner_memory
    from dmuon.balance.inventories import layer_groups
    from dmuon.kernels import ns_flops

    from dmuon.owners.stacks import collapse_ranges, owner_items, param_layout

    expert_parallel = set(expert_parallel)
    if deadlines is not None:
        _refuse("deadlines", "the exposed-time objective", tp_size=tp_size != 1,
                group_cost=group_cost != 0 and makespan_slack is None,
                memory_cap_bytes=memory_cap_bytes is not None,
                expert_parallel=bool(expert_parallel) or ep_size != 1,
                bucket_bytes=bucket_bytes is not None)
    if expert_parallel or ep_size != 1:
        return expert_parallel_plan(
            build_plan, list(named_shapes), world_size, expert_parallel, ep_size, costs=costs, cost_unit=cost_unit,
            blocks=blocks, method=method, time_limit_s=time_limit_s,
            given={"tp_size": tp_size != 1, "layout": layout is not None,
                   "replicate_mode": replicate_mode is not None, "bucket_bytes": bucket_bytes is not None},
            groups=groups, group_cost=group_cost, memory_cap_bytes=memory_cap_bytes,
            batch_overhead=batch_overhead, solver_report=solver_report)
    blocks = blocks or {}
    layouts = [(fqn, param_layout(fqn, shape, blocks.get(fqn, 1))) for fqn, shape in named_shapes]
    items = owner_items(layouts)  # what the balancer places: a matrix, or one expert of a stack
    param_of_item = [i for i, (_, layout) in enumerate(layouts) for _ in range(layout.count if layout.is_stack else 1)]
    per_param = [layout.count if layout.is_stack else 1 for _, layout in layouts]
    shapes = [it.matrix_shape for it in items]
    if costs is None:
        costs = [it.matrices * float(ns_flops(*it.matrix_shape, method="gram")) for it in items]
    else:
        if len(costs) != len(layouts):
            raise ValueError(f"dmuon: build_plan got {len(costs)} costs for {len(layouts)} parameters; "
                             f"give one cost per parameter")
        costs = [float(costs[p]) / per_param[p] for p in param_of_item]
    if groups is not None:
        groups = [groups[p] for p in param_of_item]
    # one class per (matrix shape, matrices per item): interchangeable in the MILP
    classes = [it.matrix_shape if it.matrices == 1 else (it.matrix_shape, it.matrices) for it in items]
    if bucket_bytes is not None:
        _refuse("bucket_bytes", "the plain replicated module's path", tp_size=tp_size != 1,
                groups=groups is not None, group_cost=group_cost != 0, layout=layout is not None,
                memory_cap_bytes=memory_cap_bytes is not None, batch_overhead=bool(batch_overhead),
                replicate_mode=replicate_mode is not None)
        return _bucket_plan(items, layouts, world_size, costs, cost_unit, bucket_bytes, element_size)
    if layout is not None and layout[0] * layout[1] != world_size * tp_size:
        raise ValueError(
            f"dmuon: build_plan(layout={tuple(layout)!r}) covers {layout[0] * layout[1]} ranks but "
            f"the plan has world_size * tp_size = {world_size * tp_size}; give nodes * "
            f"gpus_per_node equal to the number of ranks"
        )
    if not items:
        return OwnerPlan(world_size=world_size, matrices=(), tp_size=tp_size, method=method,
                         cost_unit=cost_unit)
    if tp_size > 1:
        # The solver's ranks are (DP owner, TP owner) pairs while publications go per DP
        # owner: pairs would be miscounted, so TP plans balance the makespan alone.
        group_cost = 0.0
    if layout is not None and groups is None:
        groups = layer_groups([it.fqn for it in items])
    xor = layout is not None and group_cost == 0  # a group cost keeps groups on few owners instead
    # bytes per matrix only where asked for (a cap, or the per-rank report)
    memory = ([it.matrices * m for it, m in zip(items, owner_memory(shapes))]
              if memory_cap_bytes is not None or solver_report else None)
    if deadlines is not None:
        groups = layer_groups([it.fqn for it in items]) if groups is None else groups
        xor = False  # the layout would move matrices between units' owners: deadlines decide
    result = solve(list(costs), world_size * tp_size, classes=classes, method=method,
                   time_limit_s=time_limit_s, memory=memory, memory_cap=memory_cap_bytes,
                   batch_overhead=batch_overhead or None,
                   groups=None if groups is None or (tp_size > 1 and not xor) else list(groups),
                   group_cost=group_cost, layout=tuple(layout) if xor else None,
                   units=None if deadlines is None else list(groups), deadlines=deadlines,
                   makespan_slack=makespan_slack)
    overhead = batch_overhead or {}
    block_of = dict(blocks)
    matrices = tuple(
        MatrixSpec(fqn=r.fqn, shape=items[r.items[0]].matrix_shape, owner=int(r.owner) // tp_size,
                   cost=sum(costs[i] for i in r.items) + float(overhead.get(classes[r.items[0]], 0.0)),
                   tp_owner=int(r.owner) % tp_size, experts=r.experts, blocks=block_of.get(r.fqn, 1))
        for r in collapse_ranges(items, result.owners)
    )
    extra: dict[str, Any] = ({"group_cost": float(group_cost), "publish_pairs": result.publish_pairs}
                             if result.group_cost > 0 else {})
    if result.fell_back:  # why the plan is the heuristic's: every rank's copy says so
        extra["milp_status"] = result.milp_status
    if result.problem != "makespan":
        extra.update(objective=result.problem, exposed=result.exposed,
                     exposed_bound=result.exposed_bound)
    if result.problem == "overlap":
        extra.update(makespan_plan_exposed=result.makespan_plan_exposed,
                     makespan_plan_makespan=result.makespan_plan_makespan,
                     candidate=result.candidate, makespan_slack=float(makespan_slack))
    if solver_report:
        extra.update(
            proven_bound=result.proven_bound, optimal=result.optimal, detail=result.detail,
            milp_status=result.milp_status,
            solve_s=result.solve_s, layout="xor" if xor else "none",
            nodes=None if layout is None else layout[0],
            gpus_per_node=None if layout is None else layout[1],
            group_cost=float(group_cost), publish_pairs=result.publish_pairs,
            memory_cap_bytes=memory_cap_bytes, memory_by_rank=list(result.memory),
            batch_overhead={f"{s[0]}x{s[1]}": v for s, v in overhead.items()},
        )
    plan = OwnerPlan(
        world_size=world_size, matrices=matrices, tp_size=tp_size, method=result.method,
        cost_unit=cost_unit, makespan=float(result.makespan), lower_bound=float(result.lower_bound),
        extra=extra,
    )
    return plan.with_replicate_modes(replicate_mode, replica_cost)


def _refuse(option: str, path: str, **given: bool) -> None:
    """Raise ValueError naming the options ``path`` does not take that were given."""
    names = [k for k, v in given.items() if v]
    if names:
        raise ValueError(f"dmuon: build_plan({option}=...) ({path}) takes no {names}; leave them "
                         f"out")


def build_bucket_plan(
    named_shapes: Iterable[tuple[str, Sequence[int]]],
    world_size: int,
    *,
    bucket_bytes: int,
    element_size: int = 4,
    costs: Sequence[float] | None = None,
    cost_unit: str = "flops",
    blocks: Mapping[str, int] | None = None,
) -> OwnerPlan:
    """The plan of the DDP-style path (``replicas="keep"``): :func:`build_plan` with
    ``bucket_bytes`` (see there)."""
    return build_plan(named_shapes, world_size, bucket_bytes=bucket_bytes, element_size=element_size,
                      costs=costs, cost_unit=cost_unit, blocks=blocks)


def _bucket_plan(items, layouts, world_size, costs, cost_unit, bucket_bytes, element_size) -> OwnerPlan:
    """:func:`build_plan`'s DDP-style path: size-capped buckets in backward order, one owner each
    (:func:`dmuon.balance.buckets.assign_buckets`); a stack's experts split at bucket edges."""
    from dmuon.balance.buckets import assign_buckets
    from dmuon.owners.stacks import collapse_ranges

    nbytes = [it.numel * element_size for it in items]
    result = assign_buckets(costs, nbytes, world_size, bucket_bytes)
    owners = [result.owner_of_bucket[b] for b in result.bucket]
    block_of = {fqn: layout.blocks for fqn, layout in layouts}
    matrices = tuple(
        MatrixSpec(fqn=r.fqn, shape=items[r.items[0]].matrix_shape, owner=r.owner,
                   cost=float(sum(costs[i] for i in r.items)), bucket=r.bucket, experts=r.experts,
                   blocks=block_of[r.fqn])
        for r in collapse_ranges(items, owners, list(result.bucket))
    )
    loads = [0.0] * world_size
    for m in matrices:
        loads[m.owner] += m.cost
    total = sum(costs)
    return OwnerPlan(
        world_size=world_size, matrices=matrices, method="buckets", cost_unit=cost_unit,
        makespan=max(loads, default=0.0),
        lower_bound=max(total / world_size, max(costs, default=0.0)),
        extra={"buckets": len(result.owner_of_bucket), "bucket_cap_bytes": result.cap_bytes,
               "ns_share": list(result.ns_share), "bytes_share": list(result.bytes_share)},
    )
