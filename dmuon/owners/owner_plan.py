"""The owner plan as data: which rank owns which dedicated matrix.

A plan is computed once from parameter shapes (they never change during training), is
identical on every rank (ranks compare :meth:`OwnerPlan.digest` before the first step), and
round-trips through JSON so that ``python -m dmuon.profile`` can solve it offline and
``dedicate_params(model, mesh, plan="plan.json")`` can load it.

This module holds the plan itself: :class:`MatrixSpec` and :class:`OwnerPlan`, their field
validation, views, digest and JSON form. Its author is :func:`dmuon.owners.plan.build_plan`
(which re-exports both classes); its checks against a model and a mesh
(:meth:`OwnerPlan.check_matches`) are :mod:`dmuon.owners.plan_checks`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from dmuon.balance.cost import REPLICATE_MODES, ReplicaCost
from dmuon.owners.plan_checks import PlanChecks

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
class OwnerPlan(PlanChecks):
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
