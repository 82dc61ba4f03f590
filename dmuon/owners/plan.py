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
        shape: ``(rows, cols)`` of the full (unsharded) matrix; for a stack of matrices
            (``experts`` set, or ``blocks > 1``), of one Newton-Schulz matrix.
        experts: a stack parameter ``[*lead, rows, cols]`` only: the range ``(start, stop)``
            of its flattened leading dims (experts) this entry covers; ``None`` for a 2-D
            parameter (:mod:`dmuon.owners.stacks`).
        blocks: row blocks each stored matrix is cut into for Newton-Schulz (1: whole).
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
        ep: expert parallelism: the entry is a range of the ``E / ep_size`` experts each rank
            holds of an expert stack split ``Shard(0)`` over the mesh's ``"ep"`` dimension, and
            ``owner`` is a rank of the *expert group* (the ``world_size / ep_size`` ranks that
            share an ``"ep"`` coordinate, hence hold the same experts). The same entry serves
            every ``"ep"`` coordinate: each group owns its own experts with the same layout.
    """

    fqn: str
    shape: tuple[int, int]
    owner: int
    cost: float = 0.0
    tp_owner: int = 0
    bucket: int | None = None
    replicate_mode: str | None = None
    experts: tuple[int, int] | None = None
    blocks: int = 1
    ep: bool = False

    @property
    def key(self) -> str:
        """Unique name of the entry: the FQN, with ``[start:stop]`` for an expert range."""
        return self.fqn if self.experts is None else f"{self.fqn}[{self.experts[0]}:{self.experts[1]}]"

    @property
    def matrices(self) -> int:
        """Newton-Schulz matrices the entry holds."""
        count = 1 if self.experts is None else self.experts[1] - self.experts[0]
        return count * self.blocks

    def __post_init__(self) -> None:
        if not self.fqn:
            raise ValueError("dmuon: MatrixSpec.fqn must be a non-empty parameter name")
        if self.experts is not None and (len(self.experts) != 2 or not 0 <= self.experts[0] < self.experts[1]):
            raise ValueError(f"dmuon: MatrixSpec for {self.fqn!r} has experts={self.experts!r}; "
                             f"expected a non-empty range (start, stop) with 0 <= start < stop")
        if isinstance(self.blocks, bool) or not isinstance(self.blocks, int) or self.blocks < 1:
            raise ValueError(f"dmuon: MatrixSpec for {self.fqn!r} has blocks={self.blocks!r}; "
                             f"expected an integer >= 1")
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
        ep_size: size of the mesh's expert-parallel ``"ep"`` dimension (1 without one); the
            owners of ``ep`` entries are drawn from ``world_size / ep_size`` ranks.

    Raises:
        ValueError: on a non-positive world size, a duplicated name, an owner out of
            ``range(world_size)`` (``range(world_size / ep_size)`` for an ``ep`` entry), or an
            ``ep_size`` that does not divide the world size.
    """

    world_size: int
    matrices: tuple[MatrixSpec, ...]
    tp_size: int = 1
    method: str = "greedy"
    cost_unit: str = "flops"
    makespan: float = 0.0
    lower_bound: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    ep_size: int = 1

    @property
    def expert_group_size(self) -> int:
        """Ranks an ``ep`` entry's owner is drawn from (``world_size / ep_size``)."""
        return self.world_size // self.ep_size

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"dmuon: OwnerPlan.world_size must be >= 1, got {self.world_size}")
        if isinstance(self.ep_size, bool) or not isinstance(self.ep_size, int) or self.ep_size < 1 \
                or self.world_size % self.ep_size:
            raise ValueError(f"dmuon: OwnerPlan.ep_size must be a positive int dividing world_size="
                             f"{self.world_size}, got {self.ep_size!r}")
        if self.ep_size > 1 and self.tp_size > 1:
            raise ValueError("dmuon: OwnerPlan with both ep_size > 1 and tp_size > 1: expert "
                             "parallelism with tensor parallelism is not supported")
        seen: set[str] = set()
        for spec in self.matrices:
            if spec.key in seen:
                raise ValueError(f"dmuon: OwnerPlan lists parameter {spec.key!r} twice")
            seen.add(spec.key)
            if spec.ep and spec.owner >= self.expert_group_size:
                raise ValueError(
                    f"dmuon: OwnerPlan assigns the expert-parallel entry {spec.key!r} to rank "
                    f"{spec.owner} of its expert group, which has {self.expert_group_size} ranks "
                    f"(world size {self.world_size} / ep size {self.ep_size})"
                )
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
        """Owner per entry key (:attr:`MatrixSpec.key`: the FQN, ``fqn[start:stop]`` for an
        expert range)."""
        return {m.key: m.owner for m in self.matrices}

    @property
    def shape_by_fqn(self) -> dict[str, tuple[int, int]]:
        """Newton-Schulz matrix shape per parameter FQN."""
        return {m.fqn: m.shape for m in self.matrices}

    def specs_by_fqn(self) -> dict[str, list[MatrixSpec]]:
        """Every entry of each parameter, in expert order (one for a 2-D parameter)."""
        out: dict[str, list[MatrixSpec]] = {}
        for m in self.matrices:
            out.setdefault(m.fqn, []).append(m)
        for specs in out.values():
            specs.sort(key=lambda m: (m.experts or (0, 0))[0])
        return out

    def loads(self) -> list[float]:
        """Per-rank sum of ``MatrixSpec.cost`` (unit ``cost_unit``), over the DP x TP grid
        (index ``owner * tp_size + tp_owner``). An expert-parallel entry's owner ``x`` stands
        for the ranks ``x * ep_size + c`` of every ``"ep"`` coordinate ``c`` (the mesh's
        row-major order, ``(expert shard, ep)``): each holds its own experts of that cost."""
        loads = [0.0] * (self.world_size * self.tp_size)
        for m in self.matrices:
            if m.ep:
                for c in range(self.ep_size):
                    loads[m.owner * self.ep_size + c] += m.cost
            else:
                loads[m.owner * self.tp_size + m.tp_owner] += m.cost
        return loads

    def owned_by(self, rank: int) -> list[MatrixSpec]:
        """The entries whose owner index is ``rank``: a rank of the shard group, or for an
        ``ep`` entry a rank of the expert group (:attr:`MatrixSpec.ep`)."""
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
                 **({} if m.replicate_mode is None else {"replicate_mode": m.replicate_mode}),
                 **({} if m.experts is None else {"experts": list(m.experts)}),
                 **({} if m.blocks == 1 else {"blocks": m.blocks}),
                 **({"ep": True} if m.ep else {})}
                for m in self.matrices
            ],
            **({} if self.ep_size == 1 else {"ep_size": self.ep_size}),
            "extra": dict(self.extra),
        }

    def digest(self) -> str:
        """SHA-256 over what every rank must agree on: world size, names, shapes, owners
        (and buckets, HSDP replicate modes, expert ranges, row blocks and the expert-parallel
        grouping, where the plan has them)."""
        canon = json.dumps(
            [self.world_size, self.tp_size,
             [(m.fqn, list(m.shape), m.owner, m.tp_owner) + (() if m.bucket is None else (m.bucket,))
              + (() if m.replicate_mode is None else (m.replicate_mode,))
              + (() if m.experts is None else ("experts", list(m.experts)))
              + (() if m.blocks == 1 else ("blocks", m.blocks))
              + (("ep",) if m.ep else ())
              for m in self.matrices]] + ([] if self.ep_size == 1 else [("ep_size", self.ep_size)]),
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
                           replicate_mode=m.get("replicate_mode"),
                           experts=None if m.get("experts") is None else
                           tuple(_as_int(e, "experts", m["fqn"]) for e in m["experts"]),
                           blocks=_as_int(m.get("blocks", 1), "blocks", m["fqn"]),
                           ep=bool(m.get("ep", False)))
                for m in data["matrices"]
            )
            return cls(
                world_size=_as_int(data["world_size"], "world_size"), matrices=matrices,
                tp_size=_as_int(data.get("tp_size", 1), "tp_size"),
                method=str(data.get("method", "file")), cost_unit=str(data.get("cost_unit", "flops")),
                makespan=float(data.get("makespan", 0.0)), lower_bound=float(data.get("lower_bound", 0.0)),
                extra=dict(data.get("extra", {})),
                ep_size=_as_int(data.get("ep_size", 1), "ep_size"),
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
    def check_matches(self, shape_by_fqn: Mapping[str, Any], world_size: int,
                      tp_size: int = 1, *, ep_size: int = 1, expert_parallel: Iterable[str] = ()) -> None:
        """Check that this plan fits a model's dedicated matrices and a mesh.

        Args:
            shape_by_fqn: every dedicated parameter of the model, by FQN: its full shape
                (``(rows, cols)`` or a stack's ``(*lead, rows, cols)``) or its
                :class:`dmuon.owners.stacks.ParamLayout` (with row blocks); a stack's expert
                ranges must cover its experts once each.
            world_size: size of the data-parallel mesh the plan will run on.
            ep_size: size of its expert-parallel ``"ep"`` dimension (1 without one).
            expert_parallel: the FQNs of the stacks split over ``"ep"`` (their
                ``shape_by_fqn`` entry is one rank's local stack, ``[E / ep_size, rows, cols]``).

        Raises:
            ValueError: naming the first mismatch (world size, ep size, missing or extra
                matrix, shape, a stack expert-parallel in the model and not in the plan or the
                other way round) and how to fix it.
        """
        _check_plan_matches(self, shape_by_fqn, world_size, tp_size)
        _check_expert_parallel(self, ep_size, set(expert_parallel))


def _check_expert_parallel(plan: OwnerPlan, ep_size: int, expert_parallel: set[str]) -> None:
    """The plan's expert-parallel grouping is the mesh's and the model's (a plan solved for one
    layout must not run on another: its owners would be ranks of different groups)."""
    if ep_size != plan.ep_size:
        raise ValueError(
            f"dmuon: the plan was solved for an expert-parallel ('ep') size of {plan.ep_size} but "
            f"the mesh has {ep_size}; re-solve the plan for this mesh")
    for fqn, specs in plan.specs_by_fqn().items():
        in_plan, in_model = specs[0].ep, fqn in expert_parallel
        if any(m.ep != in_plan for m in specs) or in_plan != in_model:
            raise ValueError(
                f"dmuon: parameter {fqn!r} is {'' if in_model else 'not '}split over the 'ep' "
                f"mesh dimension in this model but the plan {'does not treat' if in_model else 'treats'} "
                f"it as expert-parallel; re-solve the plan for this model and mesh")


def _check_plan_matches(plan: OwnerPlan, shape_by_fqn: Mapping[str, Any], world_size: int,
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
    from dmuon.owners.stacks import ParamLayout

    layouts = {fqn: (v if isinstance(v, ParamLayout) else ParamLayout(tuple(int(x) for x in v)))
               for fqn, v in shape_by_fqn.items()}
    mine = plan.specs_by_fqn()
    missing = [f for f in layouts if f not in mine]
    if missing:
        raise ValueError(
            f"dmuon: the plan assigns no owner to {len(missing)} dedicated matrices of this "
            f"model, e.g. {missing[:3]}; it was solved for another model or predicate"
        )
    extra = [f for f in mine if f not in layouts]
    if extra:
        raise ValueError(
            f"dmuon: the plan names {len(extra)} matrices this model does not dedicate, "
            f"e.g. {extra[:3]}; it was solved for another model or predicate"
        )
    for fqn, layout in layouts.items():
        specs = mine[fqn]
        got = (tuple(specs[0].shape), specs[0].blocks)
        if got != (layout.matrix_shape, layout.blocks) or any(
                (tuple(m.shape), m.blocks) != got for m in specs):
            raise ValueError(
                f"dmuon: parameter {fqn!r} has shape {layout.shape} (Newton-Schulz matrices "
                f"{layout.matrix_shape}, {layout.blocks} row block(s) each) but the plan was "
                f"solved for matrices {tuple(specs[0].shape)} with {specs[0].blocks} block(s); "
                f"re-solve the plan for this model"
            )
        ranges = [m.experts for m in specs]
        if layout.is_stack:
            covered = ranges[0] is not None and ranges[0][0] == 0 and ranges[-1][1] == layout.count and all(
                a is not None and b is not None and a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            if not covered:
                raise ValueError(
                    f"dmuon: parameter {fqn!r} is a stack of {layout.count} matrices (shape "
                    f"{layout.shape}) but the plan's expert ranges {ranges} do not cover 0..{layout.count} "
                    f"once each; re-solve the plan for this model"
                )
        elif ranges != [None]:
            raise ValueError(
                f"dmuon: parameter {fqn!r} is one matrix (shape {layout.shape}) but the plan "
                f"gives it expert ranges {ranges}; re-solve the plan for this model"
            )


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
    if expert_parallel or ep_size != 1:
        from dmuon.owners.ep_plan import expert_parallel_plan

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
        given = {"tp_size": tp_size != 1, "groups": groups is not None, "group_cost": group_cost != 0,
                 "layout": layout is not None, "memory_cap_bytes": memory_cap_bytes is not None,
                 "batch_overhead": bool(batch_overhead), "replicate_mode": replicate_mode is not None}
        if any(given.values()):
            raise ValueError(f"dmuon: build_plan(bucket_bytes=...) is the plain replicated module's "
                             f"path and takes no {[k for k, v in given.items() if v]}; leave them out")
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
    result = solve(list(costs), world_size * tp_size, classes=classes, method=method,
                   time_limit_s=time_limit_s, memory=memory, memory_cap=memory_cap_bytes,
                   batch_overhead=batch_overhead or None,
                   groups=None if groups is None or (tp_size > 1 and not xor) else list(groups),
                   group_cost=group_cost, layout=tuple(layout) if xor else None)
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
    ``bucket_bytes`` (kept for its callers; see there)."""
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
