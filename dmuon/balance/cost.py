"""Cost model: Newton-Schulz FLOPs, owner memory, batched-NS cost fits, publication and HSDP
replica costs. Every cost constant of dmuon lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

#: Bytes a dedicated matrix costs its owner per element: fp32 master (4) + fp32 momentum (4)
#: + fp32 reduced gradient (4).
OWNER_BYTES_PER_ELEMENT = 12

#: Step time (s) one more publish (group, owner) pair costs on gloo (its broadcasts and reduce,
#: on every rank): 1.3 to 2.7 ms measured on 2 CPU cores, 4 ranks, the ``dmuon.train`` model
#: (bench/results/history/step_cpu_4r_grouped_owners*.json).
GLOO_PAIR_COST_S = 2.5e-3
#: fp32 Newton-Schulz FLOP/s of one CPU thread on that model's shapes (median of 3.4e10-8.3e10):
#: converts :data:`GLOO_PAIR_COST_S` into the FLOP model's unit.
CPU_NS_FLOP_PER_S = 6e10
#: FLOPs one more matrix costs a CPU owner beyond its NS FLOPs (its share of a batched NS call
#: and its element-wise update), fitted on ``dmuon.train``'s policy: ``t = FLOPs / 8.6e10 s +
#: 0.19 ms`` per matrix. Used on CPU by :func:`matrix_costs`.
CPU_MATRIX_OVERHEAD_FLOPS = 1.6e7

#: NS throughput (FLOP/s) of one owner, for :class:`ReplicaCost` (H100, effective fp16).
NS_FLOPS_PER_S = 400e12
#: Bytes/s of one fp32 master's broadcast across HSDP replicas, for :class:`ReplicaCost` (200 Gb/s
#: InfiniBand, the DMuon paper's cluster): broadcasting wins for squares above ~2,150 rows.
REPLICA_BYTES_PER_S = 25e9
#: The HSDP replicate modes a plan may hold (:attr:`dmuon.owners.plan.MatrixSpec.replicate_mode`).
REPLICATE_MODES = ("compute", "broadcast")


def ns_flops(rows: int, cols: int, *, steps: int = 5, method: str = "gram", batch: int = 1) -> float:
    """FLOPs of one Newton-Schulz orthogonalization of a ``[rows, cols]`` matrix (x ``batch``):
    :func:`dmuon.kernels.ns_flops` (the optimizer's own count), Gram method by default."""
    from dmuon.kernels import ns_flops as kernel_flops

    return float(kernel_flops(int(rows), int(cols), steps=steps, method=method, batch=batch))


def flop_costs(shapes: Sequence[tuple[int, int]], *, steps: int = 5, method: str = "gram") -> list[float]:
    """Per-matrix NS FLOPs (:func:`ns_flops`), one per ``(rows, cols)`` shape."""
    keys = [(int(s[0]), int(s[1])) for s in shapes]
    per = {k: ns_flops(*k, steps=steps, method=method) for k in set(keys)}
    return [per[k] for k in keys]


def matrix_costs(shapes: Sequence[tuple[int, int]], device_type: str) -> list[float]:
    """Per-matrix step cost of an owner in FLOPs: :func:`flop_costs`, plus
    :data:`CPU_MATRIX_OVERHEAD_FLOPS` per matrix when the owners run on CPU."""
    overhead = CPU_MATRIX_OVERHEAD_FLOPS if device_type == "cpu" else 0.0
    return [c + overhead for c in flop_costs(shapes)]


def owner_memory(shapes: Sequence[tuple[int, int]]) -> list[float]:
    """Bytes each matrix costs its owner: ``rows * cols * OWNER_BYTES_PER_ELEMENT``."""
    return [float(int(r) * int(c) * OWNER_BYTES_PER_ELEMENT) for r, c in shapes]


def default_group_cost(backend: str, cost_unit: str) -> float:
    """The ``group_cost`` of :func:`dmuon.balance.solve` for a backend (e.g. ``"gloo"`` or
    ``"cpu:gloo,cuda:nccl"``), in ``cost_unit`` ``"flops"`` or ``"ms"``: 0 where NCCL groups
    several owners' broadcasts into one call, :data:`GLOO_PAIR_COST_S` on gloo alone.

    Raises:
        ValueError: on another ``cost_unit``.
    """
    if cost_unit not in ("flops", "ms"):
        raise ValueError(f"dmuon: default_group_cost(cost_unit={cost_unit!r}) must be 'flops' or 'ms'")
    if "nccl" in backend or "gloo" not in backend:
        return 0.0
    return GLOO_PAIR_COST_S * (CPU_NS_FLOP_PER_S if cost_unit == "flops" else 1e3)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaCost:
    """The cost model behind ``replicate_mode="auto"`` on an HSDP mesh: every replica's owner
    runs Newton-Schulz (``"compute"``), or replica 0's runs it and broadcasts the fp32 master
    (``"broadcast"``); :meth:`mode` picks the cheaper per matrix.

    Attributes:
        ns_flops_per_s: Newton-Schulz throughput of one owner, FLOP/s (> 0).
        replica_bytes_per_s: bandwidth of the master's broadcast across replicas, bytes/s (> 0).

    Raises:
        ValueError: a throughput that is not a finite number > 0.
    """

    ns_flops_per_s: float = NS_FLOPS_PER_S
    replica_bytes_per_s: float = REPLICA_BYTES_PER_S

    def __post_init__(self) -> None:
        for name in ("ns_flops_per_s", "replica_bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"dmuon: ReplicaCost.{name} must be a finite number > 0, got {value!r}")

    def mode(self, shape: tuple[int, int]) -> str:
        """``"compute"`` or ``"broadcast"`` for a ``[rows, cols]`` matrix: the smaller of
        ``ns_flops(rows, cols) / ns_flops_per_s`` (Gram NS, 5 steps) and
        ``4 * rows * cols / replica_bytes_per_s`` seconds (ties: ``"compute"``)."""
        compute_s = ns_flops(shape[0], shape[1], method="gram") / self.ns_flops_per_s
        broadcast_s = 4 * shape[0] * shape[1] / self.replica_bytes_per_s
        return "compute" if compute_s <= broadcast_s else "broadcast"


def fit_batch_costs(timings_ms: Mapping[int, float]) -> tuple[float, float]:
    """``(fixed_ms, marginal_ms)``: the least-squares fit ``t(k) = fixed + k * marginal``, both
    clipped to ``>= 0``, of one shape's timings ``{batch size k >= 1: ms for the batch}`` (one
    timing gives ``(0, t(k) / k)``).

    Raises:
        ValueError: when empty or a batch size is < 1 or a time is negative.
    """
    if not timings_ms:
        raise ValueError("dmuon: fit_batch_costs needs at least one (batch, ms) timing")
    pts = sorted((int(k), float(t)) for k, t in timings_ms.items())
    for k, t in pts:
        if k < 1 or t < 0:
            raise ValueError(f"dmuon: fit_batch_costs got batch={k}, ms={t}; need batch >= 1, ms >= 0")
    if len(pts) == 1:
        return 0.0, pts[0][1] / pts[0][0]
    n = len(pts)
    mk = sum(k for k, _ in pts) / n
    mt = sum(t for _, t in pts) / n
    var = sum((k - mk) ** 2 for k, _ in pts)
    slope = sum((k - mk) * (t - mt) for k, t in pts) / var
    fixed = mt - slope * mk
    if fixed < 0:  # refit through the origin
        return 0.0, sum(k * t for k, t in pts) / sum(k * k for k, _ in pts)
    if slope < 0:
        return mt, 0.0
    return fixed, slope
