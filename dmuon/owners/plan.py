"""The owner plan: which rank owns which dedicated matrix.

A plan is computed once from parameter shapes (they never change during training), is
identical on every rank (ranks compare :meth:`OwnerPlan.digest` before the first step), and
round-trips through JSON so that ``python -m dmuon.profile`` can solve it offline and
``dedicate_params(model, mesh, plan="plan.json")`` can load it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from dataclasses import replace
from typing import Any, Iterable, Mapping, Sequence

from dmuon.balance.cost import REPLICATE_MODES, ReplicaCost

PLAN_SCHEMA_VERSION = 1


def _as_int(value: Any, field: str, fqn: str | None = None) -> int:
    """An integer field of a plan JSON, or a ValueError naming the field and the value."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    where = f"matrix {fqn!r} has" if fqn is not None else "has"
    raise ValueError(f"dmuon: the plan {where} {field}={value!r}; it must be an integer "
                     f"(owners are ranks 0 .. world_size - 1)")


@dataclass(frozen=True, slots=True, kw_only=True)
class MatrixSpec:
    """One dedicated matrix of the plan.

    Attributes:
        fqn: fully qualified parameter name, as ``model.named_parameters()`` gives it.
        shape: ``(rows, cols)`` of the full (unsharded) matrix.
        owner: rank (in the data-parallel shard dimension) that holds the fp32 master and
            momentum, receives the reduced gradient and runs Newton-Schulz. Under tensor
            parallelism every TP slice of the matrix has this same DP owner index.
        cost: Newton-Schulz cost the balancer used (unit in ``OwnerPlan.cost_unit``).
        tp_owner: TP rank (within the TP group of the DP owner) that gathers the slices and
            runs Newton-Schulz on the full matrix; 0 without tensor parallelism.
        bucket: DDP-style path (``replicas="keep"``) only: the gradient/broadcast bucket the
            matrix travels in (0 = the first to be reduced in backward;
            :func:`build_bucket_plan`); ``None`` elsewhere.
        replicate_mode: HSDP only: ``"compute"`` (every replica's owner runs Newton-Schulz on
            the all-reduced gradient) or ``"broadcast"`` (replica 0's owner runs it and
            broadcasts the fp32 master); ``None`` without a replicate dimension
            (:meth:`OwnerPlan.with_replicate_modes`, :class:`dmuon.balance.cost.ReplicaCost`).
    """

    fqn: str
    shape: tuple[int, int]
    owner: int
    cost: float = 0.0
    tp_owner: int = 0
    bucket: int | None = None
    replicate_mode: str | None = None

    def __post_init__(self) -> None:
        if not self.fqn:
            raise ValueError("dmuon: MatrixSpec.fqn must be a non-empty parameter name")
        if len(self.shape) != 2 or any(int(s) < 0 for s in self.shape):
            raise ValueError(
                f"dmuon: MatrixSpec.shape for {self.fqn!r} must be (rows, cols) with "
                f"non-negative sizes, got {self.shape!r}"
            )
        for name in ("owner", "tp_owner"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"dmuon: MatrixSpec for {self.fqn!r} has {name}={value!r} "
                                f"({type(value).__name__}); owners are integer ranks")
        if self.bucket is not None and self.bucket < 0:
            raise ValueError(f"dmuon: MatrixSpec for {self.fqn!r} has bucket={self.bucket}; buckets are >= 0")
        if self.replicate_mode not in (None,) + REPLICATE_MODES:
            raise ValueError(f"dmuon: MatrixSpec for {self.fqn!r} has replicate_mode={self.replicate_mode!r}; "
                             f"expected None or one of {REPLICATE_MODES}")
        if self.owner < 0 or self.tp_owner < 0:
            raise ValueError(
                f"dmuon: MatrixSpec for {self.fqn!r} has owner={self.owner}, "
                f"tp_owner={self.tp_owner}; ranks are >= 0"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerPlan:
    """Owner assignment of every dedicated matrix.

    Attributes:
        world_size: number of ranks the owners are drawn from (the data-parallel shard group).
        tp_size: size of the tensor-parallel group (1 without TP).
        matrices: one :class:`MatrixSpec` per dedicated matrix, in model order.
        method: how the owners were chosen (``"greedy"``, ``"milp"``, ``"file"``...).
        cost_unit: unit of ``MatrixSpec.cost`` and of ``makespan``/``lower_bound``
            (``"flops"`` from the FLOP model, ``"ms"`` when profiled).
        makespan: cost on the most loaded rank.
        lower_bound: ``max(total / world_size, largest cost)``; no plan can beat it.

    Raises:
        ValueError: on a non-positive world size, a duplicated name, or an owner out of
            ``range(world_size)``.
    """

    world_size: int
    matrices: tuple[MatrixSpec, ...]
    tp_size: int = 1
    method: str = "greedy"
    cost_unit: str = "flops"
    makespan: float = 0.0
    lower_bound: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"dmuon: OwnerPlan.world_size must be >= 1, got {self.world_size}")
        seen: set[str] = set()
        for spec in self.matrices:
            if spec.fqn in seen:
                raise ValueError(f"dmuon: OwnerPlan lists parameter {spec.fqn!r} twice")
            seen.add(spec.fqn)
            if spec.owner >= self.world_size:
                raise ValueError(
                    f"dmuon: OwnerPlan assigns {spec.fqn!r} to rank {spec.owner}, but the "
                    f"world size is {self.world_size} (ranks 0..{self.world_size - 1})"
                )
            if spec.tp_owner >= self.tp_size:
                raise ValueError(
                    f"dmuon: OwnerPlan assigns {spec.fqn!r} to TP rank {spec.tp_owner}, but the "
                    f"TP size is {self.tp_size}"
                )

    # ------------------------------------------------------------------ views
    @property
    def owner_by_fqn(self) -> dict[str, int]:
        return {m.fqn: m.owner for m in self.matrices}

    @property
    def shape_by_fqn(self) -> dict[str, tuple[int, int]]:
        return {m.fqn: m.shape for m in self.matrices}

    def loads(self) -> list[float]:
        """Per-rank sum of ``MatrixSpec.cost`` (unit ``cost_unit``), over the DP x TP grid
        (index ``owner * tp_size + tp_owner``)."""
        loads = [0.0] * (self.world_size * self.tp_size)
        for m in self.matrices:
            loads[m.owner * self.tp_size + m.tp_owner] += m.cost
        return loads

    def owned_by(self, rank: int) -> list[MatrixSpec]:
        return [m for m in self.matrices if m.owner == rank]

    # ------------------------------------------------------------ identity / IO
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "world_size": self.world_size,
            "tp_size": self.tp_size,
            "method": self.method,
            "cost_unit": self.cost_unit,
            "makespan": self.makespan,
            "lower_bound": self.lower_bound,
            "matrices": [
                {"fqn": m.fqn, "shape": list(m.shape), "owner": m.owner, "cost": m.cost,
                 "tp_owner": m.tp_owner, **({} if m.bucket is None else {"bucket": m.bucket}),
                 **({} if m.replicate_mode is None else {"replicate_mode": m.replicate_mode})}
                for m in self.matrices
            ],
            "extra": dict(self.extra),
        }

    def digest(self) -> str:
        """SHA-256 over what every rank must agree on: world size, names, shapes, owners
        (and buckets and HSDP replicate modes, where the plan has them)."""
        canon = json.dumps(
            [self.world_size, self.tp_size,
             [(m.fqn, list(m.shape), m.owner, m.tp_owner) + (() if m.bucket is None else (m.bucket,))
              + (() if m.replicate_mode is None else (m.replicate_mode,))
              for m in self.matrices]],
            separators=(",", ":"),
        )
        return hashlib.sha256(canon.encode()).hexdigest()

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "OwnerPlan":
        version = data.get("schema_version")
        if version != PLAN_SCHEMA_VERSION:
            raise ValueError(
                f"dmuon: plan schema_version is {version!r}, this dmuon reads version "
                f"{PLAN_SCHEMA_VERSION}; re-run `python -m dmuon.profile` to write a new plan"
            )
        try:
            matrices = tuple(
                MatrixSpec(fqn=m["fqn"], shape=tuple(_as_int(s, "shape", m["fqn"]) for s in m["shape"]),
                           owner=_as_int(m["owner"], "owner", m["fqn"]), cost=float(m.get("cost", 0.0)),
                           tp_owner=_as_int(m.get("tp_owner", 0), "tp_owner", m["fqn"]),
                           bucket=None if m.get("bucket") is None else _as_int(m["bucket"], "bucket", m["fqn"]),
                           replicate_mode=m.get("replicate_mode"))
                for m in data["matrices"]
            )
            return cls(
                world_size=_as_int(data["world_size"], "world_size"), matrices=matrices,
                tp_size=_as_int(data.get("tp_size", 1), "tp_size"),
                method=str(data.get("method", "file")), cost_unit=str(data.get("cost_unit", "flops")),
                makespan=float(data.get("makespan", 0.0)), lower_bound=float(data.get("lower_bound", 0.0)),
                extra=dict(data.get("extra", {})),
            )
        except KeyError as e:
            raise ValueError(f"dmuon: plan JSON is missing the field {e.args[0]!r}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "OwnerPlan":
        """Read a plan written by :meth:`save` (``python -m dmuon.profile --out``).

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not JSON, or not a plan (naming the file, the position or
                the field, and the value).
        """
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"dmuon: plan file {str(path)!r} is not valid JSON ({e.msg}: line {e.lineno}, "
                    f"column {e.colno}); write it with OwnerPlan.save or `python -m dmuon.profile --out`"
                ) from None
        if not isinstance(data, Mapping):
            raise ValueError(f"dmuon: plan file {str(path)!r} holds a JSON {type(data).__name__}, not "
                             f"a plan object; write it with OwnerPlan.save or `python -m dmuon.profile --out`")
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{e} (plan file {str(path)!r})") from None

    def with_replicate_modes(self, mode: str | None, cost: ReplicaCost | None = None) -> "OwnerPlan":
        """This plan with every matrix's HSDP replicate mode decided.

        Args:
            mode: ``None`` (no replicate dimension: the plan is returned as it is),
                ``"compute"`` or ``"broadcast"`` (every matrix, replacing what the plan held),
                or ``"auto"``: matrices whose mode is still ``None`` get the cheaper one by
                ``cost``; modes the plan already holds are kept.
            cost: the cost model of ``"auto"``; default :class:`ReplicaCost` (H100 and
                200 Gb/s InfiniBand figures, :mod:`dmuon.balance.cost`).

        Raises:
            ValueError: ``mode`` is not ``None``, ``"auto"``, ``"compute"`` or ``"broadcast"``.
            TypeError: ``cost`` is not a :class:`ReplicaCost`.
        """
        if mode is None:
            return self
        if mode != "auto" and mode not in REPLICATE_MODES:
            raise ValueError(f"dmuon: replicate_mode must be 'auto', 'compute' or 'broadcast', got {mode!r}")
        if cost is not None and not isinstance(cost, ReplicaCost):
            raise TypeError(f"dmuon: replica_cost must be a dmuon.balance.cost.ReplicaCost, got "
                            f"{type(cost).__name__}; build one with ReplicaCost(ns_flops_per_s=..., "
                            f"replica_bytes_per_s=...)")
        cost = cost or ReplicaCost()
        matrices = tuple(
            replace(m, replicate_mode=mode if mode != "auto" else (m.replicate_mode or cost.mode(m.shape)))
            for m in self.matrices
        )
        return replace(self, matrices=matrices)

    # ------------------------------------------------------------- validation
    def check_matches(self, shape_by_fqn: Mapping[str, Sequence[int]], world_size: int,
                      tp_size: int = 1) -> None:
        """Check that this plan fits a model's dedicated matrices and a mesh.

        Args:
            shape_by_fqn: full shape of every dedicated matrix of the model, by FQN.
            world_size: size of the data-parallel mesh the plan will run on.

        Raises:
            ValueError: naming the first mismatch (world size, missing or extra matrix, shape)
                and how to fix it.
        """
        _check_plan_matches(self, shape_by_fqn, world_size, tp_size)


def _check_plan_matches(plan: OwnerPlan, shape_by_fqn: Mapping[str, Sequence[int]], world_size: int,
                        tp_size: int) -> None:
    """:meth:`OwnerPlan.check_matches`: the first mismatch raises ``ValueError``."""
    if world_size != plan.world_size:
        raise ValueError(
            f"dmuon: the plan was solved for {plan.world_size} ranks but the mesh has "
            f"{world_size}; re-solve it with `python -m dmuon.profile --nodes N "
            f"--gpus-per-node G` for this world size"
        )
    if tp_size != plan.tp_size:
        raise ValueError(
            f"dmuon: the plan was solved for TP size {plan.tp_size} but the mesh has TP size "
            f"{tp_size}; re-solve it for this mesh"
        )
    mine = plan.shape_by_fqn
    missing = [f for f in shape_by_fqn if f not in mine]
    if missing:
        raise ValueError(
            f"dmuon: the plan assigns no owner to {len(missing)} dedicated matrices of this "
            f"model, e.g. {missing[:3]}; it was solved for another model or predicate"
        )
    extra = [f for f in mine if f not in shape_by_fqn]
    if extra:
        raise ValueError(
            f"dmuon: the plan names {len(extra)} matrices this model does not dedicate, "
            f"e.g. {extra[:3]}; it was solved for another model or predicate"
        )
    for fqn, shape in shape_by_fqn.items():
        if tuple(shape) != tuple(mine[fqn]):
            raise ValueError(
                f"dmuon: parameter {fqn!r} has shape {tuple(shape)} but the plan was solved "
                f"for shape {tuple(mine[fqn])}; re-solve the plan for this model"
            )


def build_plan(
    named_shapes: Iterable[tuple[str, tuple[int, int]]],
    world_size: int,
    *,
    costs: Sequence[float] | None = None,
    cost_unit: str = "flops",
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
) -> OwnerPlan:
    """Every per-matrix decision of an owner plan, from a model's matrices or an inventory.

    The one plan author: ``dedicate_params`` (matrices and publish groups read off the model),
    ``python -m dmuon.profile`` (a model built on ``meta`` or a named inventory, profiled
    costs, XOR layout, memory cap) and the ``distributed_config`` path
    (:func:`dmuon.distconfig.strategies.balanced_assign_fn`) all call it. It decides the owner
    (balancing Newton-Schulz cost with :func:`dmuon.balance.solve`), the TP owner, the owners'
    spread over the node x GPU grid and within each publish group, and the HSDP replicate mode.

    Args:
        named_shapes: ``(fqn, (rows, cols))`` per dedicated matrix, in model order.
        world_size: number of ranks to spread owners over (the data-parallel shard group).
        costs: per-matrix cost; defaults to the Gram Newton-Schulz FLOP model
            (:func:`dmuon.kernels.ns_flops`). With ``batch_overhead``, the marginal part.
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
            the plan is the heuristic fallback (:func:`dmuon.balance.solver.milp_fallback`).
        bucket_bytes: the DDP-style path (``replicas="keep"``, plain module on a 1-D mesh):
            matrices are cut into contiguous buckets in backward (reverse model) order, each
            closed once it holds this many bytes (``bucket_cap_mb * 2**20``, > 0, as DDP's), at
            least ``world_size`` of them, where their Newton-Schulz cost plus broadcast bytes
            balance; each bucket gets one owner (:func:`dmuon.balance.buckets.assign_buckets`);
            ``MatrixSpec.bucket`` records it.
            Takes none of ``tp_size > 1``, ``groups``, ``group_cost``, ``layout``,
            ``memory_cap_bytes``, ``batch_overhead``, ``replicate_mode``.
        element_size: bucket path: bytes per gradient element (4 for fp32).

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

    named_shapes = [(fqn, (int(s[0]), int(s[1]))) for fqn, s in named_shapes]
    shapes = [shape for _, shape in named_shapes]
    if costs is None:
        costs = [float(ns_flops(*shape, method="gram")) for shape in shapes]
    if bucket_bytes is not None:
        given = {"tp_size": tp_size != 1, "groups": groups is not None, "group_cost": group_cost != 0,
                 "layout": layout is not None, "memory_cap_bytes": memory_cap_bytes is not None,
                 "batch_overhead": bool(batch_overhead), "replicate_mode": replicate_mode is not None}
        if any(given.values()):
            raise ValueError(f"dmuon: build_plan(bucket_bytes=...) is the plain replicated module's "
                             f"path and takes no {[k for k, v in given.items() if v]}; leave them out")
        return _bucket_plan(named_shapes, world_size, costs, cost_unit, bucket_bytes, element_size)
    if layout is not None and layout[0] * layout[1] != world_size * tp_size:
        raise ValueError(
            f"dmuon: build_plan(layout={tuple(layout)!r}) covers {layout[0] * layout[1]} ranks but "
            f"the plan has world_size * tp_size = {world_size * tp_size}; give nodes * "
            f"gpus_per_node equal to the number of ranks"
        )
    if not named_shapes:
        return OwnerPlan(world_size=world_size, matrices=(), tp_size=tp_size, method=method,
                         cost_unit=cost_unit)
    if tp_size > 1:
        # The solver's ranks are (DP owner, TP owner) pairs while publications go per DP
        # owner: pairs would be miscounted, so TP plans balance the makespan alone.
        group_cost = 0.0
    if layout is not None and groups is None:
        groups = layer_groups([fqn for fqn, _ in named_shapes])
    xor = layout is not None and group_cost == 0  # a group cost keeps groups on few owners instead
    # bytes per matrix only where asked for (a cap, or the per-rank report)
    memory = owner_memory(shapes) if memory_cap_bytes is not None or solver_report else None
    result = solve(list(costs), world_size * tp_size, classes=shapes, method=method,
                   time_limit_s=time_limit_s, memory=memory, memory_cap=memory_cap_bytes,
                   batch_overhead=batch_overhead or None,
                   groups=None if groups is None or (tp_size > 1 and not xor) else list(groups),
                   group_cost=group_cost, layout=tuple(layout) if xor else None)
    overhead = batch_overhead or {}
    matrices = tuple(
        MatrixSpec(fqn=fqn, shape=shape, owner=int(owner) // tp_size,
                   cost=float(cost) + float(overhead.get(shape, 0.0)), tp_owner=int(owner) % tp_size)
        for (fqn, shape), owner, cost in zip(named_shapes, result.owners, costs)
    )
    extra: dict[str, Any] = ({"group_cost": float(group_cost), "publish_pairs": result.publish_pairs}
                             if result.group_cost > 0 else {})
    if result.fell_back:  # why the plan is the heuristic's: every rank's copy says so
        extra["milp_status"] = result.milp_status
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


def build_bucket_plan(
    named_shapes: Iterable[tuple[str, tuple[int, int]]],
    world_size: int,
    *,
    bucket_bytes: int,
    element_size: int = 4,
    costs: Sequence[float] | None = None,
    cost_unit: str = "flops",
) -> OwnerPlan:
    """The plan of the DDP-style path (``replicas="keep"``): :func:`build_plan` with
    ``bucket_bytes`` (kept for its callers; see there)."""
    return build_plan(named_shapes, world_size, bucket_bytes=bucket_bytes, element_size=element_size,
                      costs=costs, cost_unit=cost_unit)


def _bucket_plan(named_shapes, world_size, costs, cost_unit, bucket_bytes, element_size) -> OwnerPlan:
    """:func:`build_plan`'s DDP-style path: size-capped buckets in backward order, one owner each
    (:func:`dmuon.balance.buckets.assign_buckets`)."""
    from dmuon.balance.buckets import assign_buckets

    nbytes = [shape[0] * shape[1] * element_size for _, shape in named_shapes]
    result = assign_buckets(costs, nbytes, world_size, bucket_bytes)
    matrices = tuple(
        MatrixSpec(fqn=fqn, shape=shape, owner=result.owner_of_bucket[b], cost=float(cost), bucket=b)
        for (fqn, shape), cost, b in zip(named_shapes, costs, result.bucket)
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
