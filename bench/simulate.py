"""Simulated step time of AdamW, vanilla Muon and dmuon at 8-256 GPUs, and its CPU validation.

GPU prediction (``predict``): for Pi0 and Qwen2.5-7B (matrix inventories from
:mod:`dmuon.balance.inventories`), on A800-like and H100-like clusters
(:data:`bench.sim_model.CLUSTERS`, every constant with its source), at 8, 16, 32, 64, 128 and 256
GPUs (8 per node, weak scaling: fixed work per GPU):

* forward + backward compute, per micro-batch (one per optimizer step by default; with
  accumulation FSDP2 and dmuon communicate per micro-batch, the optimizer runs once): ``6 N T``
  FLOPs (+ attention ``12 L d s T`` for Qwen) at
  ``mfu_fb`` of peak, split 1:2; ``T`` the tokens per GPU of the stated workload;
* FSDP2 (AdamW, vanilla, and dmuon's non-matrix parameters): per layer, bf16 all-gather in
  forward and again in backward, fp32 reduce-scatter in backward;
* dmuon (as built): per unit (FSDP2 block), the bf16 broadcasts of its matrices from their
  owners in forward and again in backward (the default for a layer block; the root block keeps
  its weights in dmuon as in FSDP2, which the model ignores for both alike), and
  the fp32 reduces of its gradient bucket to the owners in backward, each batch issued as one
  NCCL group call (``dmuon.comm.collectives.issued_together``): bytes add up, the ring latency is
  paid once per unit;
  optimizer step = the makespan of the owner plan from :func:`dmuon.balance.solve` (NS seconds
  from :func:`dmuon.kernels.ns_flops` (Gram, 5 steps) at ``mfu_ns`` of peak, plus ``ns_call_s``
  per batched shape class), XOR layout over the node x GPU grid, plus owner-side elementwise
  work at HBM speed;
* dmuon_overlap (issue 39): dmuon with the owners' NS overlapped with the next forward in
  forward order under the deadline-aware plan (:func:`dmuon.balance.solve` with ``deadlines``);
  the optimizer phase keeps the owners' elementwise work and the forward stalls for what NS the
  forward cannot hide, with the contention assumed in :mod:`sim_overlap`;
* dmuon_per_matrix: the first build, one collective per matrix (ring latency per matrix),
  kept to show what the group calls buy at scale;
* vanilla: per matrix, a blocking fp32 all-gather of the momentum update and the NS on every
  rank (``ns_call_s`` per matrix: it does not batch), plus elementwise work;
* AdamW: the elementwise update of the local shard (28 bytes per element at HBM speed).

Replicated (DDP-style) path (``predict_replicated``, ``--replicated``): the model replicated on
every GPU, fp32 weights and gradients, ``bucket_cap_mb`` 25 as DDP:

* DDP + AdamW: every parameter's gradient all-reduced in 25 MB buckets in backward (ring:
  ``2 (p - 1)`` latencies, ``2 n (p - 1) / p`` bytes per link), AdamW on every parameter on
  every rank (28 bytes per element at HBM speed);
* dmuon (``replicas="keep"``, as built): the matrices in the buckets of
  :func:`dmuon.owners.plan.build_plan` (``bucket_bytes``), one fp32 ``reduce`` per bucket in backward and
  one fp32 ``broadcast`` per bucket after the step, overlapping the next forward; the other
  parameters all-reduced in 25 MB buckets; optimizer step = the most loaded owner's NS seconds
  (plus ``ns_call_s`` per shape it owns) and its elementwise work, plus AdamW on the others;
* vanilla Muon under DDP: DDP's all-reduce, then every rank runs NS on every matrix.

CPU validation (``validate``): the same step model with constants calibrated from a
``bench_step.py`` JSON (gloo broadcast/reduce/all-gather fits, per-shape NS seconds measured
under the run's contention, forward/backward compute = AdamW's measured phases minus its modeled
FSDP communication, optimizer per-tensor cost from AdamW's measured step, overlap 0), predicting
the vanilla and dmuon step and optimizer-step times that were measured; errors are reported.

Usage::

    python bench/simulate.py --validate bench/results/step_cpu_4r.json --out bench/results/sim_gpu.json
    python bench/simulate.py --tiny   # CI smoke mode: one model, two scales, no MILP
    python bench/simulate.py --measured bench/results/rank_view_cpu_gpu_n8.json ... --out FILE.json

Measured compute, modelled communication (``--measured``, :func:`predict_measured`): the
per-phase times a rank view measured (``bench/rank_view.py``: one rank of an N-GPU job on one
device, its compute and hook work at that job's shard sizes and Newton-Schulz share) replace
the FLOP model's compute; the collectives stay the alpha-beta model above. The table is
labelled "measured compute (<device>) + modelled NCCL".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import sys

if __package__ in (None, ""):  # run as a script: make the repository and bench/ importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from dmuon.balance import solve  # noqa: E402
from dmuon.balance.inventories import inventory, layer_groups  # noqa: E402
from dmuon.kernels import ns_flops  # noqa: E402
from sim_model import CLUSTERS, AlphaBeta, Cluster, StepInputs, step_times  # noqa: E402
from sim_overlap import NS_OVERLAP_RATE, SENSITIVITY_RATES, overlap_ns, unit_forward_flops  # noqa: E402

logger = logging.getLogger(__name__)

GPU_COUNTS = (8, 16, 32, 64, 128, 256)
VARIANTS = ("adamw", "vanilla", "dmuon")
#: The paper's claims (issue 7): dmuon within +2% of AdamW end to end; speedups over vanilla.
PAPER = {"dmuon_over_adamw_max": 1.02, "end_to_end_speedup": (1.48, 3.01),
         "optimizer_step_speedup": (6.85, 163.0), "public_dmuon_overhead": (0.017, 0.034)}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """A model and the work per GPU per step.

    Args:
        name: Inventory name (:func:`dmuon.balance.inventories.inventory`).
        other_params: Parameters outside the Muon inventory (embeddings, heads, norms), stepped by AdamW.
        fb_flops: Forward + backward FLOPs per GPU per micro-batch.
        micro_batches: Micro-batches per optimizer step (gradient accumulation).
        source: How ``other_params``, ``fb_flops`` and ``micro_batches`` were chosen.
    """

    name: str
    other_params: float
    fb_flops: float
    micro_batches: int
    source: str


def _matrix_params(inv, prefix: str = "") -> float:
    return float(sum(r * c for fqn, (r, c) in matrices(inv) if fqn.startswith(prefix)))


def matrices(inv) -> list[tuple[str, tuple[int, int]]]:
    """The inventory's Newton-Schulz matrices: a stack ``(experts, rows, cols)`` is its experts'
    matrices, each under the stack's name (same layer), through the shape seam
    (:mod:`dmuon.owners.stacks`)."""
    from dmuon.owners.stacks import param_layout

    out = []
    for fqn, shape in inv:
        layout = param_layout(fqn, shape)
        out += [(fqn, layout.matrix_shape)] * layout.count
    return out


#: MoE models: (inventory, layers, attention width (heads x head dim), experts active / total,
#: embedding + untied head parameters). Public configs, see :mod:`dmuon.balance.inventories`.
MOE = {
    "qwen3-30b-a3b": dict(layers=48, attn=4096, active=8 / 128, embed=2 * 151_936 * 2048),
    "moonlight-16b-a3b": dict(layers=27, attn=16 * 128, active=6 / 64, embed=2 * 163_840 * 2048),
    "kimi-k2": dict(layers=61, attn=64 * 128, active=8 / 384, embed=2 * 163_840 * 7168),
}


def moe_workload(name: str, tokens: int = 16384, accumulation: int = 1) -> Workload:
    """An MoE model's per-GPU work: ``6 N_active T + 12 L d s T`` (s = 4096), where
    ``N_active`` counts the dense matrices, the embedding/head and ``active`` of the experts.
    FSDP2 (and dmuon) over every parameter, no expert parallelism: every expert is gathered
    (published) in forward and backward, as the simulator's FSDP2 model does for a dense model."""
    cfg = MOE[name]
    inv = inventory(name)
    experts = float(sum(r * c for fqn, (r, c) in matrices(inv) if ".experts." in fqn))
    dense = _matrix_params(inv) - experts
    active = dense + experts * cfg["active"] + cfg["embed"]
    flops = 6.0 * active * tokens + 12.0 * cfg["layers"] * cfg["attn"] * 4096 * tokens
    return Workload(name=name, other_params=cfg["embed"] + 1e6, fb_flops=flops, micro_batches=accumulation,
                    source=f"assumed: {accumulation} micro-batch(es) of {tokens} tokens/GPU (sequences of "
                           f"4096); {cfg['active']:.4f} of the experts active per token; FSDP2 over every "
                           "parameter, no expert parallelism; 6 N_active T + 12 L d s T")


def workloads(pi0_batch: int = 32, qwen_tokens: int = 16384, accumulation: int = 1) -> dict[str, Workload]:
    """Pi0 and Qwen2.5-7B per-GPU workloads (weak scaling; the per-GPU sizes are assumptions)."""
    pi = inventory("pi0")
    vis = _matrix_params(pi, "paligemma.vision_tower") + _matrix_params(pi, "paligemma.multi_modal")
    lm = _matrix_params(pi, "paligemma.language_model")
    ex = _matrix_params(pi) - vis - lm
    img, text, suffix = 3 * 256, 48, 51  # 3 cameras x 256 SigLIP tokens, 48 text, 50 actions + state
    pi_embed = 257_152 * 2048  # Gemma vocabulary x width (tied head)
    pi_flops = 6.0 * pi0_batch * (vis * img + lm * (img + text) + ex * suffix)  # no LM head in Pi0
    qw = inventory("qwen2.5-7b")
    qw_embed = 152_064 * 3584  # embedding and untied lm_head, each
    qw_flops = 6.0 * (_matrix_params(qw) + qw_embed) * qwen_tokens + 12.0 * 28 * 3584 * 4096 * qwen_tokens
    return {
        **{name: moe_workload(name, qwen_tokens, accumulation) for name in MOE},
        "pi0": Workload(name="pi0", other_params=pi_embed + 1e6, fb_flops=pi_flops,
                        micro_batches=accumulation,
                        source=f"assumed: {accumulation} micro-batches of {pi0_batch} samples/GPU per "
                               "optimizer step; openpi Pi0 sample = 3x256 image + 48 text + 51 "
                               "action/state tokens; Gemma 257,152 x 2048 tied embedding"),
        "qwen2.5-7b": Workload(name="qwen2.5-7b", other_params=2 * qw_embed + 1e6, fb_flops=qw_flops,
                               micro_batches=accumulation,
                               source=f"assumed: {accumulation} micro-batch(es) of {qwen_tokens} tokens/GPU "
                                      "(sequences of 4096) per optimizer step, i.e. a 4M-token global batch "
                                      "at 256 GPUs; Qwen2.5-7B config.json; 6N T + 12 L d s T (s = 4096)"),
    }


def _units(inv) -> list[list[tuple[int, int]]]:
    """Matrix shapes grouped per layer (FSDP2 unit / dmuon publication unit), forward order."""
    inv = matrices(inv)
    groups = layer_groups([f for f, _ in inv])
    units: list[list[tuple[int, int]]] = [[] for _ in range(max(groups) + 1)]
    for g, (_, shape) in zip(groups, inv):
        units[g].append(shape)
    return units


def predict_one(work: Workload, cluster: Cluster, p: int, *, method: str = "auto",
                overlap: bool | None = None) -> dict:
    """Predicted phase times (s) of the three optimizers for one model, cluster and GPU count.

    With ``overlap`` (default: for inventories of at most 2,000 matrices, i.e. not the MoE
    models) also ``dmuon_overlap``: NS overlapped with the next forward under the deadline-aware
    plan (:mod:`sim_overlap`), its ratio to AdamW, and the same at the sensitivity rates.
    """
    inv = matrices(inventory(work.name))  # an expert stack: one matrix per expert
    comm = AlphaBeta(cluster, p)
    nodes = max(1, p // cluster.gpus_per_node)
    units = _units(inv)
    shapes = [s for _, s in inv]
    matrix_n = sum(r * c for r, c in shapes)
    ns_s = [ns_flops(r, c, steps=5, method="gram") / (cluster.peak_flops * cluster.mfu_ns) for r, c in shapes]
    plan = solve(ns_s, p, groups=layer_groups([f for f, _ in inv]), classes=shapes,
                 batch_overhead={s: cluster.ns_call_s for s in set(shapes)},
                 layout=(nodes, p // nodes), method=method, time_limit_s=5.0)
    fwd = work.fb_flops / 3 / (cluster.peak_flops * cluster.mfu_fb)
    bwd = 2 * fwd
    other = work.other_params
    # FSDP2 over every parameter: the non-matrix parameters travel with the first unit.
    unit_n = [sum(r * c for r, c in u) for u in units]
    unit_n[0] += other
    fsdp_f = tuple(comm.all_gather(2 * n) for n in unit_n)
    fsdp_b = tuple(comm.all_gather(2 * n) + comm.reduce_scatter(4 * n) for n in reversed(unit_n))
    adamw_elem = 28.0 * (matrix_n + other) / p / cluster.hbm_Bps
    # dmuon: matrices by owner broadcast/reduce; the non-matrix parameters stay on FSDP2.
    dm_f = [sum(comm.broadcast(2 * r * c) for r, c in u) for u in units]
    dm_b = [sum(comm.broadcast(2 * r * c) + comm.reduce(4 * r * c) for r, c in u) for u in units]
    # As built: one unit's broadcasts (and its bucket's reduces) go out as one NCCL group call,
    # paying the ring latency once per unit; dm_* is the per-matrix first build.
    lat = comm.broadcast(0.0)
    dg_f = [x - lat * (len(u) - 1) for x, u in zip(dm_f, units)]
    dg_b = [x - 2 * lat * (len(u) - 1) for x, u in zip(dm_b, units)]
    for lists in (dm_f, dg_f):
        lists[0] += comm.all_gather(2 * other)
    for lists in (dm_b, dg_b):
        lists[0] += comm.all_gather(2 * other) + comm.reduce_scatter(4 * other)
    owned = [0.0] * p
    for (r, c), o in zip(shapes, plan.owners):
        owned[o] += r * c
    # owner: momentum lerp + Nesterov + apply (~24 B/elem) + bf16 refresh (6 B/elem)
    dm_opt = plan.makespan + 30.0 * max(owned) / cluster.hbm_Bps + 28.0 * other / p / cluster.hbm_Bps
    van_opt = (sum(comm.all_gather(4 * r * c) for r, c in shapes) + sum(ns_s)
               + cluster.ns_call_s * len(shapes) + adamw_elem)
    out = {"gpus": p, "nodes": nodes, "plan": {"method": plan.method, "detail": plan.detail,
                                               "makespan_s": plan.makespan, "lower_bound_s": plan.lower_bound}}
    common = dict(forward_s=fwd, backward_s=bwd, overlap=cluster.overlap, micro_batches=work.micro_batches)
    out["adamw"] = step_times(StepInputs(comm_forward=fsdp_f, comm_backward=fsdp_b, optimizer_s=adamw_elem, **common))
    out["vanilla"] = step_times(StepInputs(comm_forward=fsdp_f, comm_backward=fsdp_b, optimizer_s=van_opt, **common))
    out["dmuon"] = step_times(StepInputs(comm_forward=tuple(dg_f), comm_backward=tuple(reversed(dg_b)),
                                         optimizer_s=dm_opt, **common))
    out["dmuon_per_matrix"] = step_times(StepInputs(comm_forward=tuple(dm_f), comm_backward=tuple(reversed(dm_b)),
                                                    optimizer_s=dm_opt, **common))
    out["dmuon_per_matrix_over_adamw"] = out["dmuon_per_matrix"]["total"] / out["adamw"]["total"]
    if overlap if overlap is not None else len(shapes) <= 2000:
        _add_overlap(out, work, cluster, p, inv, ns_s, shapes, plan.owners, fwd, dg_f, dg_b, other,
                     method=method, common=common)
    out["dmuon_over_adamw"] = out["dmuon"]["total"] / out["adamw"]["total"]
    out["speedup_end_to_end"] = out["vanilla"]["total"] / out["dmuon"]["total"]
    out["speedup_optimizer"] = out["vanilla"]["optimizer"] / out["dmuon"]["optimizer"]
    return out


def _add_overlap(out, work, cluster, p, inv, ns_s, shapes, makespan_owners, fwd, dg_f, dg_b, other, *,
                 method, common) -> None:
    """``out["dmuon_overlap"]``: dmuon with NS overlapped with the next forward (sim_overlap):
    the optimizer phase keeps the owners' elementwise work, the NS adds only its exposed time to
    the first micro-batch's forward."""
    groups = layer_groups([f for f, _ in inv])
    # unit_forward_flops counts the default sizes (32 Pi0 samples, 16,384 tokens per GPU); FLOPs
    # scale with them, so a workload of other sizes scales by its FLOPs over the default's
    scale = work.fb_flops / workloads(accumulation=work.micro_batches)[work.name].fb_flops
    unit_flops = [f * scale for f in unit_forward_flops(work.name, inv, groups)]
    rate_fb = cluster.peak_flops * cluster.mfu_fb
    forward_s = [f / rate_fb for f in unit_flops]
    if sum(forward_s) > fwd * (1 + 1e-9):
        raise ValueError(f"simulate: units' forward {sum(forward_s):.4f} s exceeds the workload's {fwd:.4f} s")
    rows = {}
    for rate in (NS_OVERLAP_RATE,) + SENSITIVITY_RATES:
        info = overlap_ns(ns_s, shapes, groups, forward_s, p, ns_call_s=cluster.ns_call_s,
                          method=method if rate == NS_OVERLAP_RATE else "greedy", rate=rate,
                          makespan_owners=makespan_owners)
        owned = [0.0] * p
        for (r, c), o in zip(shapes, info.pop("owners")):
            owned[o] += r * c
        elem = 30.0 * max(owned) / cluster.hbm_Bps + 28.0 * other / p / cluster.hbm_Bps
        t = step_times(StepInputs(comm_forward=tuple(dg_f), comm_backward=tuple(reversed(dg_b)),
                                  optimizer_s=elem, **common))
        t["exposed_ns"] = info["exposed_s"]
        t["total"] += info["exposed_s"]
        rows[rate] = (t, info)
    out["dmuon_overlap"], out["overlap"] = rows[NS_OVERLAP_RATE]
    out["dmuon_overlap_over_adamw"] = out["dmuon_overlap"]["total"] / out["adamw"]["total"]
    out["overlap"]["sensitivity_over_adamw"] = {
        str(rate): rows[rate][0]["total"] / out["adamw"]["total"] for rate in SENSITIVITY_RATES}
    out["overlap"]["forward_units_s"] = sum(forward_s)


def _view_units(view: dict) -> tuple[list[list[tuple[int, int]]], float]:
    """The measured model's Muon matrices per FSDP2 unit (forward order) and its other
    parameters, rebuilt on the meta device from a rank view's policy config."""
    import torch

    from dmuon.hooks.dedicate import default_predicate
    from dmuon.train.model import Pi0Policy, PolicyConfig

    described = view["model_description"]
    if described.get("kind") != "Pi0Policy":
        raise ValueError(f"simulate: --measured takes rank views of a Pi0Policy, got {described.get('kind')!r}")
    with torch.device("meta"):
        model = Pi0Policy(PolicyConfig(**described["config"]))
    pick = default_predicate(model)
    units, matrix_n = [], 0
    for block in model.shardable_blocks():
        shapes = [tuple(p.shape) for n, p in block.named_parameters() if pick(n, p)]
        units.append(shapes)
        matrix_n += sum(r * c for r, c in shapes)
    total = sum(p.numel() for p in model.parameters())
    return units, float(total - matrix_n)


def predict_measured(view: dict, cluster: Cluster, *, overlap: float | None = None) -> dict:
    """Step times of one rank of an N-GPU job: the rank view's *measured* per-phase times
    (``bench/rank_view.py``: that rank's compute and hook work, FSDP2 + AdamW and dmuon) for the
    compute side, and the alpha-beta model of this module for NCCL (the same formulas as
    :func:`predict_one`: FSDP2's all-gathers and reduce-scatters per unit; dmuon's per-unit
    broadcast and reduce group calls; the non-matrix parameters with the first unit).

    The optimizer phase is the measured step, which holds the busiest owner's Newton-Schulz
    share; the owners' publications after the step overlap the next forward in the model (the
    measured forward already waits for nothing: the fake group's collectives return at once).
    """
    p = int(view["world"])
    units, other = _view_units(view)
    comm = AlphaBeta(cluster, p)
    unit_n = [float(sum(r * c for r, c in u)) for u in units]
    unit_n[0] += other
    fsdp_f = tuple(comm.all_gather(2 * n) for n in unit_n)
    fsdp_b = tuple(comm.all_gather(2 * n) + comm.reduce_scatter(4 * n) for n in reversed(unit_n))
    lat = comm.broadcast(0.0)
    dg_f = [sum(comm.broadcast(2 * r * c) for r, c in u) - lat * max(0, len(u) - 1) for u in units]
    dg_b = [sum(comm.broadcast(2 * r * c) + comm.reduce(4 * r * c) for r, c in u) - 2 * lat * max(0, len(u) - 1)
            for u in units]
    dg_f[0] += comm.all_gather(2 * other)
    dg_b[0] += comm.all_gather(2 * other) + comm.reduce_scatter(4 * other)
    med = {v: {ph: view["variants"][v][ph]["median_s"] for ph in ("forward", "backward", "step")}
           for v in ("adamw", "dmuon") if v in view["variants"]}
    ov = cluster.overlap if overlap is None else overlap
    out = {"gpus": p, "rank": view["rank"], "measured_on": view["device"], "model": view["model"],
           "layers_note": view.get("layers_note")}
    for v, (cf, cb) in (("adamw", (fsdp_f, fsdp_b)), ("dmuon", (tuple(dg_f), tuple(reversed(dg_b))))):
        if v in med:
            out[v] = step_times(StepInputs(forward_s=med[v]["forward"], backward_s=med[v]["backward"],
                                           comm_forward=cf, comm_backward=cb, optimizer_s=med[v]["step"],
                                           overlap=ov))
    if "adamw" in out and "dmuon" in out:
        out["dmuon_over_adamw"] = out["dmuon"]["total"] / out["adamw"]["total"]
    return out


def format_measured_table(rows: list[dict]) -> str:
    lines = ["measured compute (CPU) + modelled NCCL: one rank of an N-GPU job",
             f"{'cluster':10s} {'GPUs':>5s} {'rank':>5s} {'AdamW s':>9s} {'dmuon s':>9s} {'dmuon/AdamW':>12s}"]
    for r in rows:
        lines.append(f"{r['cluster']:10s} {r['gpus']:5d} {r['rank']:5d} {r['adamw']['total']:9.3f} "
                     f"{r['dmuon']['total']:9.3f} {r['dmuon_over_adamw']:12.3f}")
    return "\n".join(lines)


def _ring_all_reduce(comm: AlphaBeta, nbytes: float) -> float:
    """NCCL ring all-reduce: reduce-scatter + all-gather of ``nbytes``."""
    return comm.reduce_scatter(nbytes) + comm.all_gather(nbytes)


def _buckets(sizes: list[float], cap: float) -> list[float]:
    """DDP's bucketing of element counts in backward order: close a bucket at ``cap``."""
    out, cur = [], 0.0
    for n in reversed(sizes):
        cur += n
        if cur >= cap:
            out.append(cur)
            cur = 0.0
    return out + ([cur] if cur else [])


def predict_replicated(work: Workload, cluster: Cluster, p: int, *, bucket_cap_mb: float = 25.0) -> dict:
    """Predicted phase times (s) on the replicated path: DDP + AdamW, vanilla under DDP, dmuon keep."""
    from dmuon.owners.plan import build_plan

    inv = matrices(inventory(work.name))
    comm = AlphaBeta(cluster, p)
    shapes = [s for _, s in inv]
    matrix_n = float(sum(r * c for r, c in shapes))
    other = work.other_params
    cap = bucket_cap_mb * 2**20
    fwd = work.fb_flops / 3 / (cluster.peak_flops * cluster.mfu_fb)
    common = dict(forward_s=fwd, backward_s=2 * fwd, overlap=cluster.overlap, micro_batches=work.micro_batches)
    rate = cluster.peak_flops * cluster.mfu_ns
    ns_s = [ns_flops(r, c, steps=5, method="gram") / rate for r, c in shapes]
    # DDP: every parameter (model order: the embedding first, then the matrices), fp32 grads
    ddp_b = tuple(_ring_all_reduce(comm, 4 * n) for n in _buckets([other] + [r * c for r, c in shapes], cap / 4))
    adamw_all = 28.0 * (matrix_n + other) / cluster.hbm_Bps
    plan = build_plan(inv, p, bucket_bytes=int(cap), costs=ns_s, cost_unit="s")
    bucket_n: dict[int, float] = {}
    owner_of: dict[int, int] = {}
    for m in plan.matrices:
        bucket_n[m.bucket] = bucket_n.get(m.bucket, 0.0) + m.shape[0] * m.shape[1]
        owner_of[m.bucket] = m.owner
    order = sorted(bucket_n)  # bucket 0 is reduced first (the end of the model)
    dm_b = tuple([comm.reduce(4 * bucket_n[b]) for b in order]
                 + [_ring_all_reduce(comm, 4 * n) for n in _buckets([other], cap / 4)])
    dm_f = tuple(comm.broadcast(4 * bucket_n[b]) for b in reversed(order))  # forward order
    ns_by, elem_by, classes = [0.0] * p, [0.0] * p, [set() for _ in range(p)]
    for m, t in zip(plan.matrices, ns_s):
        ns_by[m.owner] += t
        elem_by[m.owner] += m.shape[0] * m.shape[1]
        classes[m.owner].add(m.shape)
    owner_s = [ns_by[r] + cluster.ns_call_s * len(classes[r]) + 30.0 * elem_by[r] / cluster.hbm_Bps
               for r in range(p)]
    dm_opt = max(owner_s) + 28.0 * other / cluster.hbm_Bps
    van_opt = sum(ns_s) + cluster.ns_call_s * len(shapes) + 24.0 * matrix_n / cluster.hbm_Bps \
        + 28.0 * other / cluster.hbm_Bps
    out = {"gpus": p, "nodes": max(1, p // cluster.gpus_per_node), "buckets": len(order),
           "bucket_cap_bytes": plan.extra["bucket_cap_bytes"],
           "ns_share_max": max(plan.extra["ns_share"]), "bytes_share_max": max(plan.extra["bytes_share"])}
    out["adamw"] = step_times(StepInputs(comm_forward=(), comm_backward=ddp_b, optimizer_s=adamw_all, **common))
    out["vanilla"] = step_times(StepInputs(comm_forward=(), comm_backward=ddp_b, optimizer_s=van_opt, **common))
    out["dmuon"] = step_times(StepInputs(comm_forward=dm_f, comm_backward=dm_b, optimizer_s=dm_opt, **common))
    out["dmuon_over_adamw"] = out["dmuon"]["total"] / out["adamw"]["total"]
    out["dmuon_opt_over_vanilla_opt"] = out["dmuon"]["optimizer"] / out["vanilla"]["optimizer"]
    return out


def format_replicated_table(rows: list[dict]) -> str:
    """Replicated-path table: step seconds, dmuon / DDP+AdamW, optimizer step vs vanilla."""
    lines = [f"{'model':6s} {'cluster':9s} {'GPUs':>4s} {'buckets':>7s} {'DDP+AdamW s':>11s} {'vanilla s':>9s} "
             f"{'dmuon s':>8s} {'dmuon/DDP+AdamW':>15s} {'opt dmuon/vanilla':>17s}"]
    for r in rows:
        lines.append(f"{r['model']:6s} {r['cluster']:9s} {r['gpus']:4d} {r['buckets']:7d} {r['adamw']['total']:11.4f} "
                     f"{r['vanilla']['total']:9.4f} {r['dmuon']['total']:8.4f} {r['dmuon_over_adamw']:15.4f} "
                     f"{r['dmuon_opt_over_vanilla_opt']:17.4f}")
    return "\n".join(lines)


#: Global batch of the fixed-batch (strong scaling) variant: Qwen2.5-7B at 4M tokens per
#: optimizer step at every scale, reached by gradient accumulation of 16,384-token micro-batches.
GLOBAL_TOKENS = 4 * 1024 * 1024


def predict(models: tuple[str, ...], clusters: tuple[str, ...], gpus: tuple[int, ...], *,
            method: str = "auto", global_tokens: int | None = None) -> list[dict]:
    """Runs :func:`predict_one` over the grid; returns one row per (model, cluster, GPUs).

    With ``global_tokens`` (Qwen only) each row accumulates ``global_tokens / (GPUs x 16,384)``
    micro-batches per optimizer step instead of one (weak scaling, the default).
    """
    works = workloads()
    rows = []
    for m in models:
        for c in clusters:
            for p in gpus:
                work = works[m]
                if global_tokens is not None:
                    if m == "pi0":
                        raise ValueError(f"simulate: global_tokens applies to the token models (qwen2.5-7b and the "
                                         f"MoE models), not {m!r}")
                    work = workloads(accumulation=max(1, global_tokens // (p * 16384)))[m]
                row = predict_one(work, CLUSTERS[c], p, method=method)
                rows.append({"model": m, "cluster": CLUSTERS[c].name,
                             "micro_batches": work.micro_batches, **row})
    return rows


def format_table(rows: list[dict]) -> str:
    """The simulated table: step seconds, dmuon/AdamW (NS after backward, as built), the same
    with NS overlapped with the next forward (``overlap/AdamW``, nan where not simulated),
    speedups over vanilla, exposed phase."""
    head = (f"{'model':11s} {'cluster':9s} {'GPUs':>4s} {'AdamW s':>8s} {'vanilla s':>9s} {'dmuon s':>8s} "
            f"{'dmuon/AdamW':>11s} {'overlap/AdamW':>13s} {'e2e x':>6s} {'opt x':>7s} {'per-matrix/AdamW':>16s}  "
            f"dmuon extra over AdamW (ms): exp.comm, opt")
    lines = [head]
    for r in rows:
        a, v, d = r["adamw"], r["vanilla"], r["dmuon"]
        extra_comm = (d["exposed_comm_forward"] + d["exposed_comm_backward"]
                      - a["exposed_comm_forward"] - a["exposed_comm_backward"])
        lines.append(f"{r['model']:11s} {r['cluster']:9s} {r['gpus']:4d} {a['total']:8.3f} {v['total']:9.3f} "
                     f"{d['total']:8.3f} {r['dmuon_over_adamw']:11.4f} "
                     f"{r['dmuon_overlap_over_adamw'] if 'dmuon_overlap' in r else float('nan'):13.4f} "
                     f"{r['speedup_end_to_end']:6.2f} "
                     f"{r['speedup_optimizer']:7.1f} {r['dmuon_per_matrix_over_adamw']:16.4f}  {extra_comm * 1e3:7.1f}, {(d['optimizer'] - a['optimizer']) * 1e3:6.1f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Step time vs GPUs per (model, cluster), and the optimizer-step speedup, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["model"], r["cluster"]) for r in rows})
    fig, axes = plt.subplots(2, len(keys), figsize=(3.6 * len(keys), 6.2), squeeze=False)
    for j, key in enumerate(keys):
        sel = [r for r in rows if (r["model"], r["cluster"]) == key]
        g = [r["gpus"] for r in sel]
        ax = axes[0][j]
        for v, style in zip(VARIANTS + ("dmuon_per_matrix", "dmuon_overlap"), ("-o", "-s", "-^", ":v", "--D")):
            if all(v in r for r in sel):
                ax.plot(g, [r[v]["total"] for r in sel], style, label=v, ms=4)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{key[0]}, {key[1]}", fontsize=9)
        ax.set_ylabel("simulated step (s)")
        ax.legend(fontsize=7)
        ax = axes[1][j]
        ax.plot(g, [r["speedup_optimizer"] for r in sel], "-o", label="optimizer step", ms=4)
        ax.plot(g, [r["speedup_end_to_end"] for r in sel], "-s", label="end to end", ms=4)
        ax.axhspan(*PAPER["optimizer_step_speedup"], alpha=0.1, color="C0", label="paper opt. range")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("dmuon speedup over vanilla")
        ax.legend(fontsize=7)
    fig.suptitle("Simulated (alpha-beta model, bench/simulate.py); not measured", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Command line: predictions (table, JSON, PNG) and, with ``--validate``, the CPU check."""
    from sim_validate import validate

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--validate", nargs="*", default=[], help="bench_step.py JSON(s) to validate against")
    p.add_argument("--out", default=None, help="JSON path (the PNG goes beside it)")
    p.add_argument("--tiny", action="store_true", help="CI smoke mode: Qwen on H100 at 8 and 16 GPUs, greedy plans")
    p.add_argument("--moe", action="store_true",
                   help="only the MoE models (Qwen3-30B-A3B, Moonlight-16B-A3B, Kimi K2) on H100 at 8-256 "
                        "GPUs, against the anchors (NVIDIA: Muon +3.9%% over AdamW at 8 GPUs on "
                        "Qwen3-30B-A3B, +2.1%% at 256 GPUs on Kimi K2)")
    p.add_argument("--replicated", action="store_true",
                   help="only the replicated (DDP-style) path: Pi0 at 8-64 GPUs, dmuon vs DDP + AdamW")
    p.add_argument("--measured", nargs="*", default=[],
                   help="rank-view JSON(s) (bench/rank_view.py): their measured per-phase times as the "
                        "compute side, NCCL from the alpha-beta model")
    a = p.parse_args(argv)
    if a.measured:
        views = [json.loads(pathlib.Path(f).read_text()) for f in a.measured]
        rows = [{"cluster": CLUSTERS[c].name, "file": f, **predict_measured(v, CLUSTERS[c])}
                for c in ("a800", "h100") for f, v in zip(a.measured, views)]
        rows.sort(key=lambda r: (r["cluster"], r["gpus"]))
        device = views[0]["device"].split(" (")[0] if views else "?"
        label = f"measured compute ({device}) + modelled NCCL"
        print(format_measured_table(rows).replace("measured compute (CPU)", f"measured compute ({device})"))
        if a.out:
            out = pathlib.Path(a.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"what": label + ": per-phase compute and hook times measured by "
                                       "bench/rank_view.py for one rank of an N-GPU job, communication "
                                       "from the alpha-beta model (bench/sim_model.py)",
                                       "clusters": {k: dataclasses.asdict(c) for k, c in CLUSTERS.items()},
                                       "rows": rows}, indent=1))
        return
    if a.replicated:
        rows = [{"model": "pi0", "cluster": CLUSTERS[c].name,
                 **predict_replicated(workloads()["pi0"], CLUSTERS[c], g)}
                for c in ("a800", "h100") for g in (8, 16, 32, 64)]
        print("SIMULATED (not measured), replicated path:")
        print(format_replicated_table(rows))
        if a.out:
            out = pathlib.Path(a.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"what": "simulated replicated-path step times (s); see "
                                               "bench/simulate.py docstring", "bucket_cap_mb": 25,
                                       "clusters": {k: dataclasses.asdict(c) for k, c in CLUSTERS.items()},
                                       "workload": dataclasses.asdict(workloads()["pi0"]), "rows": rows},
                                      indent=1))
        return
    if a.moe:
        # greedy (LPT/MULTIFIT + local search, deterministic): within 0.1-1.6% of the bound on
        # these inventories (python -m dmuon.profile); 18 MILPs of up to 46k items would add
        # minutes to the run for under 1.6% of an optimizer step
        rows = predict(tuple(MOE), ("h100",), GPU_COUNTS, method="greedy")
        print("SIMULATED (not measured), MoE models, 16,384 tokens per GPU per step:")
        print(format_table(rows))
        fixed = predict(tuple(MOE), ("h100",), GPU_COUNTS, method="greedy", global_tokens=GLOBAL_TOKENS)
        print(f"SIMULATED, MoE models, fixed global batch of {GLOBAL_TOKENS} tokens (accumulation):")
        print(format_table(fixed))
        for model, gpus, anchor in (("qwen3-30b-a3b", 8, 1.039), ("kimi-k2", 256, 1.021)):
            weak = next(r for r in rows if r["model"] == model and r["gpus"] == gpus)
            big = next(r for r in fixed if r["model"] == model and r["gpus"] == gpus)
            print(f"{model} at {gpus} GPUs: dmuon/AdamW {weak['dmuon_over_adamw']:.4f} (16k tokens/GPU), "
                  f"{big['dmuon_over_adamw']:.4f} (4M-token batch) against the anchor {anchor:.3f} "
                  f"(Muon over AdamW as NVIDIA reported it)")
        if a.out:
            out = pathlib.Path(a.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"what": "simulated MoE step times (s); see bench/simulate.py",
                                       "anchors": {"qwen3-30b-a3b@8": 1.039, "kimi-k2@256": 1.021},
                                       "workloads": {k: dataclasses.asdict(workloads()[k]) for k in MOE},
                                       "cluster": dataclasses.asdict(CLUSTERS["h100"]), "rows": rows,
                                       "rows_fixed_global_batch": {"global_tokens": GLOBAL_TOKENS,
                                                                   "rows": fixed}},
                                      indent=1))
        return
    if a.tiny:
        rows = predict(("qwen2.5-7b",), ("h100",), (8, 16), method="greedy")
    else:
        rows = predict(("pi0", "qwen2.5-7b"), ("a800", "h100"), GPU_COUNTS)
    print("SIMULATED (not measured):")
    print(format_table(rows))
    fixed = predict(("qwen2.5-7b",), ("h100",) if a.tiny else ("a800", "h100"),
                    (8, 16) if a.tiny else GPU_COUNTS, method="greedy" if a.tiny else "auto",
                    global_tokens=GLOBAL_TOKENS)
    print(f"SIMULATED, fixed global batch of {GLOBAL_TOKENS} tokens (gradient accumulation):")
    print(format_table(fixed))
    result = {"what": "simulated step times (s) per optimizer; see bench/simulate.py docstring "
                      "(dmuon_overlap: NS overlapped with the next forward, bench/sim_overlap.py)",
              "ns_overlap_rate": NS_OVERLAP_RATE,
              "clusters": {k: dataclasses.asdict(c) for k, c in CLUSTERS.items()},
              "workloads": {k: dataclasses.asdict(w) for k, w in workloads().items()},
              "paper_claims": PAPER, "rows": rows,
              "rows_fixed_global_batch": {"global_tokens": GLOBAL_TOKENS, "rows": fixed}}
    result["cpu_validation"] = []
    for path in a.validate:
        val = validate(json.loads(pathlib.Path(path).read_text()))
        result["cpu_validation"].append({"file": path, **val})
        print(f"{path}:\n{val['table']}")
    if a.out:
        out = pathlib.Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
