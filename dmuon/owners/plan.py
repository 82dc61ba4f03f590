"""Owner plans: which rank owns which dedicated matrix, solved from shapes by :func:`build_plan`.

A plan is the same on every rank (checked by :meth:`OwnerPlan.digest`) and round-trips through
JSON (``python -m dmuon.profile --out``, ``dedicate_params(..., plan="plan.json")``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from dmuon.balance.cost import REPLICATE_MODES, ReplicaCost

__all__ = ["PLAN_SCHEMA_VERSION", "MatrixSpec", "OwnerPlan", "build_plan"]

PLAN_SCHEMA_VERSION = 1
#: The :class:`MatrixSpec` fields a plan's JSON holds only where they differ from these defaults.
_OPTIONAL = {"bucket": None, "replicate_mode": None, "experts": None, "blocks": 1, "ep": False}


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
        shape: ``(rows, cols)`` of one full (unsharded) Newton-Schulz matrix.
        experts: the range ``(start, stop)`` of a stack's experts (flattened leading dims) the
            entry covers; ``None`` for a 2-D parameter.
        blocks: row blocks each stored matrix is cut into.
        owner: data-parallel shard rank that holds the fp32 master and momentum and runs
            Newton-Schulz (under TP, the DP owner of every TP slice).
        cost: Newton-Schulz cost the balancer used (unit in ``OwnerPlan.cost_unit``).
        tp_owner: TP rank that runs Newton-Schulz on the full matrix; 0 without TP.
        bucket: DDP-style path (``replicas="keep"``) only: the bucket the matrix travels in (0 =
            the first reduced in backward); ``None`` elsewhere.
        replicate_mode: HSDP only: ``"compute"`` (every replica runs Newton-Schulz) or
            ``"broadcast"`` (replica 0 runs it and broadcasts the master); else ``None``.
        ep: expert parallelism: ``experts`` ranges over one rank's ``E / ep_size`` local
            experts and ``owner`` is a rank of the expert group (``world_size / ep_size``
            ranks holding the same experts).
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
        if self.experts is not None and (len(self.experts) != 2
                                         or not 0 <= self.experts[0] < self.experts[1]):
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
            raise ValueError(f"dmuon: MatrixSpec for {self.fqn!r} has replicate_mode="
                             f"{self.replicate_mode!r}; expected None or one of {REPLICATE_MODES}")
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
        cost_unit: unit of ``MatrixSpec.cost``, ``makespan`` and ``lower_bound`` (``"flops"``
            from the FLOP model, ``"ms"`` when profiled).
        makespan: cost on the most loaded rank; ``lower_bound``: no plan can beat it.
        ep_size: size of the mesh's expert-parallel ``"ep"`` dimension (1 without one).

    Raises:
        ValueError: a non-positive world size, a duplicated name, an owner out of range, an
            ``ep_size`` that does not divide the world size, or both ``ep_size`` and ``tp_size``.
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

    @property
    def owner_by_fqn(self) -> dict[str, int]:
        """Owner per entry key (:attr:`MatrixSpec.key`)."""
        return {m.key: m.owner for m in self.matrices}

    def specs_by_fqn(self) -> dict[str, list[MatrixSpec]]:
        """Every entry of each parameter, in expert order (one for a 2-D parameter)."""
        out: dict[str, list[MatrixSpec]] = {}
        for m in self.matrices:
            out.setdefault(m.fqn, []).append(m)
        for specs in out.values():
            specs.sort(key=lambda m: (m.experts or (0, 0))[0])
        return out

    def loads(self) -> list[float]:
        """Per-rank sum of ``MatrixSpec.cost``, index ``owner * tp_size + tp_owner``; an
        expert-parallel entry's owner ``x`` loads ranks ``x * ep_size + c`` for every ``"ep"``
        coordinate ``c`` (the mesh's row-major ``(expert shard, ep)`` order)."""
        loads = [0.0] * (self.world_size * self.tp_size)
        for m in self.matrices:
            if m.ep:
                for c in range(self.ep_size):
                    loads[m.owner * self.ep_size + c] += m.cost
            else:
                loads[m.owner * self.tp_size + m.tp_owner] += m.cost
        return loads

    def check_matches(self, shape_by_fqn: Mapping[str, Any], world_size: int, tp_size: int = 1, *,
                      ep_size: int = 1, expert_parallel: Iterable[str] = ()) -> None:
        """Check that this plan fits a model's dedicated matrices and a mesh.

        Args:
            shape_by_fqn: every dedicated parameter of the model, by FQN: its full shape
                (``(rows, cols)`` or a stack's ``(*lead, rows, cols)``) or its
                :class:`dmuon.owners.stacks.ParamLayout` (with row blocks); a stack's expert
                ranges must cover its experts once each.
            world_size, tp_size: sizes of the data-parallel and TP dimensions of the mesh.
            ep_size: size of its expert-parallel ``"ep"`` dimension (1 without one).
            expert_parallel: the FQNs of the stacks split over ``"ep"`` (their
                ``shape_by_fqn`` entry is one rank's local stack, ``[E / ep_size, rows, cols]``).

        Raises:
            ValueError: naming the first mismatch (world, TP or ep size, a missing or extra
                matrix, shape, expert ranges, expert parallelism) and the fix: re-solve the plan.
        """
        from dmuon.owners.stacks import ParamLayout

        if world_size != self.world_size:
            raise ValueError(
                f"dmuon: the plan was solved for {self.world_size} ranks but the mesh has "
                f"{world_size}; re-solve it with `python -m dmuon.profile --nodes N "
                f"--gpus-per-node G` for this world size"
            )
        if tp_size != self.tp_size:
            raise ValueError(
                f"dmuon: the plan was solved for TP size {self.tp_size} but the mesh has TP size "
                f"{tp_size}; re-solve it for this mesh"
            )
        layouts = {fqn: (v if isinstance(v, ParamLayout) else ParamLayout(tuple(int(x) for x in v)))
                   for fqn, v in shape_by_fqn.items()}
        mine = self.specs_by_fqn()
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
                    f"solved for matrices {tuple(specs[0].shape)} with {specs[0].blocks} "
                    f"block(s); re-solve the plan for this model"
                )
            ranges = [m.experts for m in specs]
            if layout.is_stack:
                covered = (ranges[0] is not None and ranges[0][0] == 0 and ranges[-1][1] == layout.count
                           and all(a is not None and b is not None and a[1] == b[0]
                                   for a, b in zip(ranges, ranges[1:])))
                if not covered:
                    raise ValueError(
                        f"dmuon: parameter {fqn!r} is a stack of {layout.count} matrices (shape "
                        f"{layout.shape}) but the plan's expert ranges {ranges} do not cover "
                        f"0..{layout.count} once each; re-solve the plan for this model"
                    )
            elif ranges != [None]:
                raise ValueError(
                    f"dmuon: parameter {fqn!r} is one matrix (shape {layout.shape}) but the plan "
                    f"gives it expert ranges {ranges}; re-solve the plan for this model"
                )
        if ep_size != self.ep_size:
            raise ValueError(
                f"dmuon: the plan was solved for an expert-parallel ('ep') size of {self.ep_size} "
                f"but the mesh has {ep_size}; re-solve the plan for this mesh")
        expert_parallel = set(expert_parallel)
        for fqn, specs in mine.items():
            in_plan, in_model = specs[0].ep, fqn in expert_parallel
            if any(m.ep != in_plan for m in specs) or in_plan != in_model:
                raise ValueError(
                    f"dmuon: parameter {fqn!r} is {'' if in_model else 'not '}split over the 'ep' "
                    f"mesh dimension in this model but the plan "
                    f"{'does not treat' if in_model else 'treats'} it as expert-parallel; "
                    f"re-solve the plan for this model and mesh")

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
                 "tp_owner": m.tp_owner,
                 **{k: list(v) if k == "experts" else v for k, default in _OPTIONAL.items()
                    if (v := getattr(m, k)) != default}}
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
                           bucket=None if m.get("bucket") is None else
                           _as_int(m["bucket"], "bucket", m["fqn"]),
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
                             f"a plan object; write it with OwnerPlan.save or "
                             f"`python -m dmuon.profile --out`")
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{e} (plan file {str(path)!r})") from None

    def with_replicate_modes(self, mode: str | None, cost: ReplicaCost | None = None) -> "OwnerPlan":
        """This plan with every matrix's HSDP replicate mode decided.

        Args:
            mode: ``None`` (no replicate dimension: the plan as it is), ``"compute"`` or
                ``"broadcast"`` (every matrix), or ``"auto"``: matrices without a mode get the
                cheaper one by ``cost`` (default :class:`ReplicaCost`).

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


#: The options each path of :func:`build_plan` does not take (it would drop them silently).
_REFUSED = {
    "deadlines": ("tp_size", "group_cost", "memory_cap_bytes", "expert_parallel", "bucket_bytes"),
    "expert_parallel": ("tp_size", "layout", "replicate_mode", "bucket_bytes"),
    "bucket_bytes": ("tp_size", "groups", "group_cost", "layout", "memory_cap_bytes", "batch_overhead",
                     "replicate_mode"),
}


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
    """Owner (and TP owner, bucket, HSDP replicate mode) of every matrix, balancing
    Newton-Schulz cost with :func:`dmuon.balance.solve`. The ``deadlines``, ``expert_parallel``
    and ``bucket_bytes`` paths refuse some options (:data:`_REFUSED`).

    Args:
        named_shapes: ``(fqn, shape)`` per dedicated parameter, in model order: ``(rows,
            cols)``, or ``(*lead, rows, cols)`` for a stack of experts, balanced expert by
            expert and recorded as one expert range per owner.
        world_size: number of ranks to spread owners over (the data-parallel shard group).
        costs: per-parameter cost (a stack's shared evenly by its experts); default the Gram
            Newton-Schulz FLOPs (:func:`dmuon.kernels.ns_flops`). With ``batch_overhead``, the
            marginal part.
        cost_unit: unit of ``costs`` (``"flops"`` or ``"ms"``).
        blocks: row blocks per stored matrix, by FQN (default 1: each matrix whole).
        method: :func:`dmuon.balance.solve`'s (``"greedy"``, ``"milp"``, ``"auto"``); the MILP
            stops at ``time_limit_s`` (seconds), so solve on one rank and broadcast.
        tp_size: TP group size: the balancer spreads costs over ``world_size * tp_size``
            ranks (solver rank ``owner * tp_size + tp_owner``).
        groups: publish group per matrix (its FSDP2 block), for ``group_cost``, ``layout`` and
            ``deadlines``; default :func:`dmuon.balance.inventories.layer_groups` with those.
        group_cost: step time of one publish (group, owner) pair in ``cost_unit``; the solver
            then minimizes ``makespan + group_cost * pairs`` and ``layout`` is not applied.
            Ignored with ``tp_size > 1`` (publications go per DP owner).
        layout: ``(nodes, gpus_per_node)`` covering ``world_size * tp_size`` ranks: owners
            follow the XOR layout at equal per-rank loads (:mod:`dmuon.balance.layout`).
        memory_cap_bytes: bytes of masters, momenta and gradients allowed per rank, or ``None``.
        batch_overhead: per-shape cost paid once per rank owning any matrix of that shape
            (:func:`dmuon.balance.cost.fit_batch_costs`); ``MatrixSpec.cost`` then includes it.
        replicate_mode, replica_cost: as :meth:`OwnerPlan.with_replicate_modes` takes them.
        solver_report: record the solver's ``proven_bound``, ``optimal``, ``detail``,
            ``milp_status``, ``solve_s``, the layout and ``memory_by_rank`` (bytes) in
            ``extra`` (``milp_status`` is always there when CBC failed).
        bucket_bytes, element_size: the DDP-style path (``replicas="keep"``): contiguous
            buckets in backward order of about ``bucket_bytes`` (> 0) of gradients of
            ``element_size`` bytes per element, at least ``world_size``, one owner each
            (:func:`dmuon.balance.buckets.assign_buckets`).
        expert_parallel, ep_size: FQNs of the expert stacks split ``Shard(0)`` over the
            ``"ep"`` mesh dimension of ``ep_size`` ranks (global shapes in ``named_shapes``):
            their local experts are balanced over an expert group, the rest over all ranks;
            ``extra["expert_parallel"]`` holds the expert solve's figures.
        deadlines: forward start of each publish group in ``cost_unit`` (ids in forward
            order): minimize the Newton-Schulz time the next forward waits for instead of the
            makespan; ``extra`` records ``objective="exposed"``, ``exposed``, ``exposed_bound``.
        makespan_slack: with ``deadlines``, the least exposed time among plans within ``1 +
            makespan_slack`` of the makespan plan's makespan (:func:`dmuon.balance.solve`);
            ``extra`` records ``objective="overlap"`` and the makespan plan's figures.

    Returns:
        The plan; ``extra`` records ``group_cost`` and ``publish_pairs`` when a group cost was
        used, and on the bucket path ``buckets``, ``bucket_cap_bytes``, ``ns_share``, ``bytes_share``.

    Raises:
        ValueError: from :func:`dmuon.balance.solve` (bad costs, an infeasible memory cap),
            a cost count other than the parameter count, a ``layout`` that does not cover the
            ranks, an unknown ``replicate_mode``, an option a path does not take, a bad
            ``ep_size`` or ``expert_parallel`` entry, or ``bucket_bytes <= 0``.
    """
    from dmuon.balance import solve
    from dmuon.balance.cost import owner_memory
    from dmuon.balance.inventories import layer_groups
    from dmuon.kernels import ns_flops
    from dmuon.owners.stacks import collapse_ranges, owner_items, param_layout

    named_shapes = list(named_shapes)
    expert_parallel = set(expert_parallel)
    given = {"tp_size": tp_size != 1, "groups": groups is not None, "group_cost": group_cost != 0,
             "layout": layout is not None, "memory_cap_bytes": memory_cap_bytes is not None,
             "batch_overhead": bool(batch_overhead), "replicate_mode": replicate_mode is not None,
             "expert_parallel": bool(expert_parallel) or ep_size != 1,
             "bucket_bytes": bucket_bytes is not None, "deadlines": deadlines is not None}
    for option, refused in _REFUSED.items():
        names = [k for k in refused if given[k]
                 and not (option == "deadlines" and k == "group_cost" and makespan_slack is not None)]
        if given[option] and names:
            raise ValueError(f"dmuon: build_plan({option}=...) takes no {names}; leave them out")
    if given["expert_parallel"]:
        return _expert_parallel_plan(
            named_shapes, world_size, expert_parallel, ep_size, costs=costs, groups=groups, blocks=blocks,
            options=dict(cost_unit=cost_unit, method=method, time_limit_s=time_limit_s,
                         group_cost=group_cost, memory_cap_bytes=memory_cap_bytes,
                         batch_overhead=batch_overhead, solver_report=solver_report))
    blocks = dict(blocks or {})
    layouts = [(fqn, param_layout(fqn, shape, blocks.get(fqn, 1))) for fqn, shape in named_shapes]
    items = owner_items(layouts)  # what the balancer places: a matrix, or one expert of a stack
    per_param = [layout.count if layout.is_stack else 1 for _, layout in layouts]
    param_of_item = [p for p, n in enumerate(per_param) for _ in range(n)]
    if costs is None:
        costs = [it.matrices * float(ns_flops(*it.matrix_shape, method="gram")) for it in items]
    else:
        if len(costs) != len(layouts):
            raise ValueError(f"dmuon: build_plan got {len(costs)} costs for {len(layouts)} parameters; "
                             f"give one cost per parameter")
        costs = [float(costs[p]) / per_param[p] for p in param_of_item]
    if bucket_bytes is not None:
        return _bucket_plan(items, layouts, world_size, costs, cost_unit, bucket_bytes, element_size)
    if groups is not None:
        groups = [groups[p] for p in param_of_item]
    # one class per (matrix shape, matrices per item): interchangeable in the MILP
    classes = [it.matrix_shape if it.matrices == 1 else (it.matrix_shape, it.matrices) for it in items]
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
    if (layout is not None or deadlines is not None) and groups is None:
        groups = layer_groups([it.fqn for it in items])
    # a group cost keeps groups on few owners instead; deadlines decide the units' owners
    xor = layout is not None and group_cost == 0 and deadlines is None
    # bytes per matrix only where asked for (a cap, or the per-rank report)
    memory = ([it.matrices * m for it, m in zip(items, owner_memory([it.matrix_shape for it in items]))]
              if memory_cap_bytes is not None or solver_report else None)
    result = solve(list(costs), world_size * tp_size, classes=classes, method=method,
                   time_limit_s=time_limit_s, memory=memory, memory_cap=memory_cap_bytes,
                   batch_overhead=batch_overhead or None,
                   groups=None if groups is None or (tp_size > 1 and not xor) else list(groups),
                   group_cost=group_cost, layout=tuple(layout) if xor else None,
                   units=None if deadlines is None else list(groups), deadlines=deadlines,
                   makespan_slack=makespan_slack)
    overhead = batch_overhead or {}
    matrices = tuple(
        MatrixSpec(fqn=r.fqn, shape=items[r.items[0]].matrix_shape, owner=int(r.owner) // tp_size,
                   cost=sum(costs[i] for i in r.items) + float(overhead.get(classes[r.items[0]], 0.0)),
                   tp_owner=int(r.owner) % tp_size, experts=r.experts, blocks=blocks.get(r.fqn, 1))
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


def _bucket_plan(items, layouts, world_size, costs, cost_unit, bucket_bytes, element_size) -> OwnerPlan:
    """:func:`build_plan`'s DDP-style path; a stack's experts split at bucket edges."""
    from dmuon.balance.assignment import trivial_lower_bound
    from dmuon.balance.buckets import assign_buckets
    from dmuon.owners.stacks import collapse_ranges

    nbytes = [it.matrices * it.matrix_shape[0] * it.matrix_shape[1] * element_size for it in items]
    result = assign_buckets(costs, nbytes, world_size, bucket_bytes)
    owners = [result.owner_of_bucket[b] for b in result.bucket]
    block_of = {fqn: layout.blocks for fqn, layout in layouts}
    matrices = tuple(
        MatrixSpec(fqn=r.fqn, shape=items[r.items[0]].matrix_shape, owner=r.owner,
                   cost=float(sum(costs[i] for i in r.items)), bucket=r.bucket, experts=r.experts,
                   blocks=block_of[r.fqn])
        for r in collapse_ranges(items, owners, list(result.bucket))
    )
    plan = OwnerPlan(
        world_size=world_size, matrices=matrices, method="buckets", cost_unit=cost_unit,
        lower_bound=trivial_lower_bound(costs, world_size),
        extra={"buckets": len(result.owner_of_bucket), "bucket_cap_bytes": result.cap_bytes,
               "ns_share": list(result.ns_share), "bytes_share": list(result.bytes_share)},
    )
    return replace(plan, makespan=max(plan.loads(), default=0.0))


def _expert_parallel_plan(named_shapes: list, world_size: int, expert_parallel: set[str], ep_size: int, *,
                          costs, groups, blocks, options: dict) -> OwnerPlan:
    """:func:`build_plan` with expert parallelism: dense matrices over ``world_size`` ranks and
    the stacks' local experts over an expert group (the same for every group), two solves
    merged in model order. ValueError for an ``ep_size`` not dividing ``world_size``, an unknown
    FQN in ``expert_parallel``, or one that is not a stack whose experts ``ep_size`` divides.
    """
    from dmuon.owners.stacks import param_layout

    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or world_size % ep_size:
        raise ValueError(f"dmuon: build_plan(ep_size={ep_size!r}) must be a positive int dividing "
                         f"world_size={world_size}")
    unknown = expert_parallel - {fqn for fqn, _ in named_shapes}
    if unknown:
        raise ValueError(f"dmuon: build_plan(expert_parallel=...) names {sorted(unknown)[:3]}, which "
                         f"are not among the matrices")
    blocks = dict(blocks or {})
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
    group_size = world_size // ep_size
    dense, experts = (
        build_plan([named[i] for i in members], group_size if ep else world_size,
                   costs=None if costs is None else [costs[i] for i in members],
                   groups=None if groups is None else [groups[i] for i in members],
                   blocks={named[i][0]: blocks[named[i][0]] for i in members if named[i][0] in blocks},
                   **options)
        for ep, members in parts.items())
    # The two solves are independent; the expert group's owner x lands on the ranks x * ep + c
    # of every ep coordinate c: pair the most loaded expert owners with the expert-shard
    # positions whose dense load is lightest (a relabelling: each solve's balance is kept).
    dense_loads = dense.loads()
    expert_loads = experts.loads()  # one solve, tp_size 1: owner x's load at index x
    heavy_first = sorted(range(group_size), key=lambda x: (-expert_loads[x], x))
    light_first = sorted(range(group_size),
                         key=lambda x: (max(dense_loads[x * ep_size: (x + 1) * ep_size]), x))
    relabel = dict(zip(heavy_first, light_first))
    order = {fqn: i for i, (fqn, _) in enumerate(named)}
    matrices = sorted([*dense.matrices,
                       *(replace(m, ep=True, owner=relabel[m.owner]) for m in experts.matrices)],
                      key=lambda m: order[m.fqn])  # stable: a stack's ranges stay in expert order
    extra = dict(dense.extra)
    extra["expert_parallel"] = {"ep_size": ep_size, "group_size": group_size,
                                "method": experts.method, "makespan": experts.makespan,
                                "lower_bound": experts.lower_bound, **dict(experts.extra)}
    plan = replace(dense, world_size=world_size, matrices=tuple(matrices),
                   method=dense.method if dense.matrices else experts.method, extra=extra, ep_size=ep_size)
    loads = plan.loads()
    # the merged bound: the two solves' work spread over every rank, or the largest item
    largest = max([dense.lower_bound if not dense.matrices else
                   max(m.cost / m.matrices for m in dense.matrices),
                   *(m.cost / m.matrices for m in experts.matrices)], default=0.0)
    bound = max(sum(loads) / world_size, largest, dense.lower_bound, experts.lower_bound)
    makespan = max(loads, default=0.0)
    if options["solver_report"]:  # the merged report (dmuon.profile reads it)
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
