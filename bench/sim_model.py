"""Alpha-beta cost model of one training step under AdamW, vanilla Muon and dmuon.

Pieces (all times in seconds, sizes in bytes):

* :class:`Cluster`: hardware constants, each with its source in ``sources``.
* :class:`AlphaBeta`: collective times on ``p`` GPUs of a cluster, the NCCL-style model of
  nccl-tests' PERFORMANCE.md (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
  all-gather / reduce-scatter of a full tensor of ``n`` bytes cost ``(p-1) a + n (p-1)/p / B``;
  broadcast / reduce (NCCL's pipelined ring: bus bandwidth equals algorithm bandwidth) cost
  ``(p-1) a + n / B``; all-to-all of ``n`` bytes sent per rank costs
  ``(p-1) a + n (p-1)/p / B``. ``B`` is the bottleneck per-GPU bandwidth times an efficiency:
  NVLink inside a node; across nodes ``min(NVLink, NICs per node x NIC rate / GPUs per node)``
  (NCCL runs one ring per NIC rail, so each GPU's inter-node share is its NIC share).
* :class:`FittedComm`: the same interface from measured ``(bytes, seconds)`` points (gloo on CPU).
* :func:`step_times`: the step of each optimizer from per-unit communication lists, forward /
  backward compute, the overlap fraction and the optimizer-step terms.

Exposure model (both FSDP2 and dmuon prefetch one unit ahead): the first unit's communication
of a phase is exposed; the rest hides under that phase's compute up to ``overlap x compute``;
whatever exceeds it is exposed. ``overlap`` is 1 on GPUs (copy engines / NCCL kernels beside
compute) and 0 on the oversubscribed CPU runs (gloo threads take the cores compute needs).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """Hardware constants of a GPU cluster.

    Args:
        name: Label.
        gpus_per_node: GPUs per node.
        nvlink_GBps: NVLink bandwidth per GPU, one direction, GB/s (1e9 bytes/s).
        nic_Gbps: Rate of one inter-node NIC, Gb/s (1e9 bits/s).
        nics_per_node: Inter-node NICs per node.
        alpha_intra_s: Per-step latency of an intra-node collective, s.
        alpha_inter_s: Per-step latency of an inter-node collective, s.
        bus_efficiency: Fraction of the link rate a large collective reaches.
        peak_flops: Dense bf16/fp16 tensor-core peak per GPU, FLOP/s.
        hbm_Bps: HBM bandwidth per GPU, bytes/s.
        mfu_fb: Model FLOPs utilization of forward + backward.
        mfu_ns: Utilization of the Newton-Schulz matmuls (fp16 tensor cores).
        ns_call_s: Fixed cost of one (batched) Newton-Schulz call: ~20 kernel launches.
        overlap: Fraction of a phase's compute that communication can hide under.
        sources: Where each constant comes from.
    """

    name: str
    gpus_per_node: int
    nvlink_GBps: float
    nic_Gbps: float
    nics_per_node: int
    alpha_intra_s: float
    alpha_inter_s: float
    bus_efficiency: float
    peak_flops: float
    hbm_Bps: float
    mfu_fb: float
    mfu_ns: float
    ns_call_s: float
    overlap: float = 1.0
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in ("gpus_per_node", "nvlink_GBps", "nic_Gbps", "nics_per_node", "peak_flops",
                  "hbm_Bps", "mfu_fb", "mfu_ns", "bus_efficiency"):
            if getattr(self, f) <= 0:
                raise ValueError(f"sim_model: Cluster({self.name!r}).{f}={getattr(self, f)}; must be > 0.")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"sim_model: Cluster({self.name!r}).overlap={self.overlap}; must be in [0, 1].")


_COMMON_SOURCES = {
    "alpha": "assumed: NCCL small-message step latency of a few microseconds (nccl-tests "
             "small-size all-reduce on one DGX node is ~10-20 us for ~2 log2(8) steps); "
             "inter-node adds ~2 us of IB verbs latency plus proxy overhead",
    "bus_efficiency": "assumed: nccl-tests reach ~80% of the NVLink/IB line rate as bus bandwidth",
    "mfu_fb": "assumed: 40% MFU for FSDP training of 3-8B models (typical reported range 35-50%)",
    "mfu_ns": "assumed: 50% of fp16 tensor-core peak for the NS matmuls (large GEMMs; the "
              "balancer's profile cache would replace this on a real cluster)",
    "ns_call_s": "assumed: ~20 kernel launches x ~5 us per batched Newton-Schulz call",
    "hbm": "vendor datasheet",
}

A800 = Cluster(
    name="A800-like", gpus_per_node=8, nvlink_GBps=200.0, nic_Gbps=200.0, nics_per_node=4,
    alpha_intra_s=5e-6, alpha_inter_s=10e-6, bus_efficiency=0.8, peak_flops=312e12,
    hbm_Bps=2.039e12, mfu_fb=0.4, mfu_ns=0.5, ns_call_s=100e-6,
    sources={**_COMMON_SOURCES,
             "nvlink": "NVIDIA A800 SXM4 datasheet: NVLink 400 GB/s (bidirectional) -> 200 GB/s per direction",
             "nic": "the paper's cluster: 200 Gb/s InfiniBand (HDR); 4 NICs per 8-GPU node assumed "
                    "(common A800 HGX build; the paper does not state the count)",
             "peak": "A800 = A100 compute: 312 TFLOP/s dense bf16/fp16 (A100 datasheet)",
             "hbm_value": "A800 80GB SXM: 2,039 GB/s"},
)

H100 = Cluster(
    name="H100-like", gpus_per_node=8, nvlink_GBps=450.0, nic_Gbps=400.0, nics_per_node=8,
    alpha_intra_s=5e-6, alpha_inter_s=10e-6, bus_efficiency=0.8, peak_flops=989e12,
    hbm_Bps=3.35e12, mfu_fb=0.4, mfu_ns=0.5, ns_call_s=100e-6,
    sources={**_COMMON_SOURCES,
             "nvlink": "NVIDIA H100 SXM5 datasheet: NVLink 900 GB/s (bidirectional) -> 450 GB/s per direction",
             "nic": "DGX H100 user guide: 8x ConnectX-7 400 Gb/s NDR InfiniBand, one per GPU",
             "peak": "H100 SXM5 datasheet: 989 TFLOP/s dense bf16/fp16 (1,979 with sparsity)",
             "hbm_value": "H100 SXM5 80GB: 3.35 TB/s"},
)

CLUSTERS = {"a800": A800, "h100": H100}


class AlphaBeta:
    """Collective times on ``p`` GPUs of ``cluster`` (see the module docstring for the formulas)."""

    def __init__(self, cluster: Cluster, p: int) -> None:
        if p < 1:
            raise ValueError(f"sim_model: AlphaBeta needs p >= 1 GPUs, got {p}.")
        self.p = p
        intra = cluster.nvlink_GBps * 1e9
        if p <= cluster.gpus_per_node:
            bw, self.alpha = intra, cluster.alpha_intra_s
        else:
            nic = cluster.nic_Gbps / 8 * 1e9 * cluster.nics_per_node / cluster.gpus_per_node
            bw, self.alpha = min(intra, nic), cluster.alpha_inter_s
        self.bw = bw * cluster.bus_efficiency

    def broadcast(self, nbytes: float) -> float:
        """NCCL's broadcast and reduce are pipelined rings: ``p - 1`` hops, ``n`` bytes per link."""
        return 0.0 if self.p == 1 else (self.p - 1) * self.alpha + nbytes / self.bw

    reduce = broadcast

    def all_gather(self, nbytes: float) -> float:
        """``nbytes``: the full (gathered) tensor."""
        p = self.p
        return 0.0 if p == 1 else (p - 1) * self.alpha + nbytes * (p - 1) / p / self.bw

    reduce_scatter = all_gather

    def all_to_all(self, nbytes: float) -> float:
        """``nbytes``: what one rank sends in total."""
        return self.all_gather(nbytes)


class FittedComm:
    """Collective times ``a + b n`` fitted (least squares) to measured ``[bytes, s]`` points.

    Args:
        points: ``{"broadcast": [[bytes, s], ...], "reduce": ..., "all_gather": ...}`` (and
            ``"all_reduce"`` in runs since the gradient buckets); the
            all-gather points give the *per-rank input* size (``torch.distributed``'s
            ``all_gather_into_tensor``).
        p: Ranks.

    Raises:
        ValueError: If a collective has fewer than two points.
    """

    def __init__(self, points: Mapping[str, Sequence[Sequence[float]]], p: int) -> None:
        self.p = p
        self.fit = {name: _line_fit(pts, name) for name, pts in points.items()}

    def _t(self, name: str, nbytes: float) -> float:
        a, b = self.fit[name]
        return a + b * nbytes

    def broadcast(self, nbytes: float) -> float:
        return self._t("broadcast", nbytes)

    def reduce(self, nbytes: float) -> float:
        return self._t("reduce", nbytes)

    def all_reduce(self, nbytes: float) -> float:
        if "all_reduce" not in self.fit:
            raise ValueError("sim_model: this calibration has no 'all_reduce' points (an older bench_step run).")
        return self._t("all_reduce", nbytes)

    def all_gather(self, nbytes: float) -> float:
        return self._t("all_gather", nbytes / self.p)

    def reduce_scatter(self, nbytes: float) -> float:
        # Not calibrated: gloo's ring reduce-scatter moves the all-gather's bytes (plus adds).
        return self.all_gather(nbytes)

    all_to_all = all_gather


def _line_fit(pts: Sequence[Sequence[float]], name: str) -> tuple[float, float]:
    if len(pts) < 2:
        raise ValueError(f"sim_model: need >= 2 calibration points for {name!r}, got {len(pts)}.")
    xs, ys = [float(x) for x, _ in pts], [float(y) for _, y in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    b = max(b, 0.0)
    a = max(my - b * mx, min(ys) * 0.5)  # a negative intercept is a fit artefact
    return a, b


def exposed(comm: Sequence[float], compute: float, overlap: float, *, tail: bool = False) -> float:
    """Exposed seconds of a phase's per-unit communication list with one-unit prefetch.

    The first unit's communication (or, with ``tail``, the last one's, which nothing follows)
    is exposed; the rest hides under ``overlap * compute``.
    """
    if not comm:
        return 0.0
    edge = comm[-1] if tail else comm[0]
    rest = sum(comm) - edge
    return edge + max(0.0, rest - overlap * compute)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepInputs:
    """What :func:`step_times` needs for one optimizer variant.

    Args:
        forward_s: Forward compute.
        backward_s: Backward compute.
        comm_forward: Per-unit communication in forward, forward order.
        comm_backward: Per-unit communication in backward, backward order.
        optimizer_s: Optimizer step (NS, elementwise, its own collectives).
        overlap: See :func:`exposed`.
        micro_batches: Forward/backward passes per optimizer step (gradient accumulation);
            compute and communication are per pass and repeat, the optimizer runs once.
    """

    forward_s: float
    backward_s: float
    comm_forward: tuple[float, ...]
    comm_backward: tuple[float, ...]
    optimizer_s: float
    overlap: float
    micro_batches: int = 1


def step_times(x: StepInputs) -> dict[str, float]:
    """Phase times of one step: compute, exposed communication, optimizer and total (s)."""
    m = x.micro_batches
    exp_f = m * exposed(x.comm_forward, x.forward_s, x.overlap)
    exp_b = m * exposed(x.comm_backward, x.backward_s, x.overlap, tail=True)
    total = m * (x.forward_s + x.backward_s) + exp_f + exp_b + x.optimizer_s
    return {"forward_compute": m * x.forward_s, "backward_compute": m * x.backward_s,
            "exposed_comm_forward": exp_f, "exposed_comm_backward": exp_b,
            "optimizer": x.optimizer_s, "total": total}
