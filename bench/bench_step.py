"""Step-time benchmark: AdamW vs vanilla (gather-then-compute) Muon vs dmuon, interleaved.

One process group, three copies of the same ``dmuon.train`` model (same seed, each sharded by
FSDP2 ``fully_shard`` per block and root, built with :func:`dmuon.train.loop.build_optimizer`;
with ``--mesh replicate`` not sharded: ``adamw`` and ``vanilla`` under torch
``DistributedDataParallel``, dmuon on the plain module with its DDP-style ``replicas="keep"``),
stepped in *blocks*: each round runs every variant for ``warmup_steps + block_steps + 1`` steps,
in an order that changes every round (:func:`step_stats.round_order`: a Williams design, so over
a cycle of rounds, ``step_stats.design_rounds(n)``, every variant holds every position and follows
every other variant equally often; pick ``--rounds`` as a multiple of it). The first ``warmup_steps`` (default 1) of a block are discarded (dmuon's
publications issued at the end of its previous block completed during the other variants'
blocks, which would flatter it), the next ``block_steps`` are measured, the last is profiled.

**A/A control** (default on, ``--no-control`` drops it): the baseline runs twice, as
``adamw`` and ``adamw_b`` (built the same way: FSDP2 + AdamW, or DDP + AdamW with ``--mesh
replicate``), interleaved like the others. ``round_ratios`` in the JSON gives every ratio as
the median of per-round ratios with its quartiles, and the A/A ratio ``adamw_b / adamw``'s
distance from 1 as the noise floor: a ratio within it is "not distinguishable" (method:
:mod:`step_stats`). ``ratios`` keeps the ratios of the medians over all steps, as recorded
before the control existed. Every variant sees the same global batches (batch ``j`` at its
``j``-th step).

Timing (wall clock, ``time.perf_counter``), per step and rank:

* fences: one ``dist.barrier()`` before each step, none between phases (a barrier between
  forward and backward would serialize the overlap that dmuon relies on);
* ``forward``: ``loss = model(batch)``; ``backward``: ``loss.backward()`` (this includes
  dmuon's end-of-backward callback that waits for the reduces); ``step``: ``opt.step()`` +
  ``opt.zero_grad()`` (for dmuon this includes issuing the next publications); ``total``: sum.
* the breakdown comes from dmuon's own ``torch.profiler.record_function`` labels (no wrapping of
  dmuon's code): the last step of every block runs each phase under torch's CPU profiler
  (``torch.autograd.profiler.profile(use_kineto=False)``: Kineto crashed once here) and
  records ``label_<name>_<phase>``, the CPU time inside label ``dmuon::<name>`` during that
  phase (``pre_forward``: waiting for the publications; ``finish_backward``: waiting for the
  reduces; ``vanilla_all_gather``: vanilla's per-matrix all-gather, ...; see :data:`step_timing.LABELS`).
  That step carries the profiler's overhead, and waits for dmuon's in-flight publications
  before each profiler stops (:func:`step_timing.drain`), so it is not among the measured steps.
* ``ns``: the Newton-Schulz labels in the profiled step (dmuon: ``dmuon::newton_schulz``,
  momentum included; vanilla: ``dmuon::vanilla_newton_schulz``).

A step's phase time is the maximum over ranks (the slowest rank gates the step); the JSON
reports medians and quartiles of that over the measured steps. It also records calibration
data for ``bench/simulate.py``: gloo broadcast/reduce/all-gather times per message size and
per-shape NS times, both measured with all ranks busy at once (the contention of the run).

Usage::

    python bench/bench_step.py --nproc 4 --out bench/results/step_cpu_4r.json
    python bench/bench_step.py --tiny --nproc 2 --out /tmp/step_tiny.json   # CI smoke mode
    python bench/bench_step.py --nproc 4 --extra dmuon_keep dmuon_allreduce ...   # diagnostic variants
    python bench/bench_step.py --nproc 4 --mesh replicate --out /tmp/step_replicate.json
    python bench/bench_step.py --nproc 4 --rounds 16 --block-steps 3 --no-labels --out ...  # A/A runs (docs/performance.md)
    python bench/bench_step.py --tiny --nproc 2 --trace-dir /tmp/traces   # + one chrome trace per variant

GPU mode: ``--device cuda`` runs NCCL ranks, one GPU each; the phases are timed by CUDA events
recorded on the current stream at the phase boundaries (so a phase's time is its kernels' time
on the device, with no host synchronisation between phases); before every block the device is
synchronised, the allocator's cache emptied and its peak statistics reset (:func:`switch_variant`). NS in float16 as ``dmuon.train``
picks on CUDA, and no gloo calibration. The profiled labels then only see host-side time (NCCL
waits are stream waits), so only the phase times mean something there. ``--extra
torch_muon`` (one rank only) adds single-process ``torch.optim.Muon`` on the same matrices plus
``AdamW`` on the rest, unsharded: the reference a single GPU can run. The GPU mode has not run on a
GPU yet (none was lent to the session that wrote it); on CPU it is tested at world size 1.

GPU-sized runs (``bench/gpu_suite.py`` uses them): ``--model gpu`` is a ~194 M-parameter Pi0-style
policy (:data:`GPU_MODEL`), ``--synthetic`` draws random batches of the policy's input format
instead of PushT demonstrations (no simulator needed), ``--bf16`` gives every ``fully_shard`` a
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``. On CUDA every step also
records its transient peak memory (``torch.cuda.max_memory_allocated`` minus the allocation at
the step's start) and every variant its resident bytes (allocation added by building it and
running one step); ``peak_bytes = resident + transient`` is that variant's peak as if alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import platform
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from dmuon.train.ranks import launch  # noqa: E402
from dmuon.train.data import DataConfig, PushTDemos, ensure_run_data  # noqa: E402
from dmuon.train.loop import TrainConfig, build_optimizer  # noqa: E402
from dmuon.train.model import Pi0Policy, PolicyConfig  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import step_stats  # noqa: E402
from step_timing import switch_variant, timed_step, write_traces  # noqa: E402

logger = logging.getLogger(__name__)

VARIANTS = ("adamw", "vanilla", "dmuon")
#: Extra dmuon variants and their ``dedicate_params`` arguments: ``dmuon_keep`` keeps full
#: weights from forward to backward (no second broadcast); ``dmuon_allreduce`` reduces each
#: gradient bucket with one all-reduce instead of one reduce per owner (the default);
#: ``dmuon_prefetch2`` issues publications two units ahead; ``dmuon_spread`` balances owners
#: by Newton-Schulz makespan alone (``group_cost=0``, NCCL's default) where gloo's default
#: also counts one publication per (block, owner); ``dmuon_placeholder`` (``--mesh replicate``
#: only) is the replicated path's memory-saving mode. ``torch_muon`` is not dmuon: single-process
#: ``torch.optim.Muon`` + ``AdamW`` on the unsharded model (world size 1 only).
#: ``dmuon_nocheck`` is dmuon with the step check (:mod:`dmuon.hooks.step_check`) switched off, to
#: measure what the check costs (its own time is the ``step_check`` label).
EXTRA_VARIANTS = {"dmuon_nocheck": dict(step_check=False),
                  "dmuon_keep": dict(reshard_after_forward=False),
                  "dmuon_allreduce": dict(reduce_mode="all_reduce"),
                  "dmuon_prefetch2": dict(prefetch=2),
                  "dmuon_spread": dict(group_cost=0.0),
                  "dmuon_placeholder": dict(replicas="placeholder"),  # --mesh replicate only
                  "dmuon_overlap": dict(),  # Muon(overlap="forward"), issue 39 (MUON_OPTIONS)
                  "torch_muon": None}
#: ``dmuon.Muon`` arguments of an extra variant (the others take the defaults).
MUON_OPTIONS = {"dmuon_overlap": dict(overlap="forward")}
PHASES = ("forward", "backward", "step", "total")
#: Message sizes (bytes, float32 payload) of the gloo calibration; 1 KiB .. 4 MiB.
CALIB_BYTES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)
TINY_MODEL = PolicyConfig(image_size=16, d_vis=32, vision_depth=1, d_model=64, depth=2, d_act=30,
                          act_heads=1, head_dim=32)
TINY_DATA = DataConfig(episodes=2, max_steps=12, image_size=16, keep_failed=True)  # 12 steps: no success
#: ~194 M parameters (193.7 M in 148 Muon matrices): SigLIP-like 768-wide vision tower (6 blocks,
#: 14-pixel patches of 224-pixel images), 1024-wide backbone and 512-wide action expert of 12
#: blocks each, Pi0's 50-step chunks of 32-dimensional actions.
GPU_MODEL = PolicyConfig(image_size=224, patch=14, d_vis=768, vision_depth=6, d_model=1024, depth=12,
                         d_act=512, act_heads=8, head_dim=64, mlp_ratio_vis=4, mlp_ratio=4,
                         mlp_ratio_act=4, max_tokens=16, horizon=50, action_dim=32, state_dim=32)
#: The benchmarks' "default" model: the main job's policy at 48-pixel images, the size every
#: recorded CPU step figure (bench/results/step_cpu_*.json) was measured at; the main job itself
#: moved to 96 pixels (issue 27), which would make new figures incomparable with the old ones.
DEFAULT_MODEL = dataclasses.replace(PolicyConfig(), image_size=48)
MODELS = {"tiny": TINY_MODEL, "default": DEFAULT_MODEL, "gpu": GPU_MODEL}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What one benchmark run does.

    Args:
        nproc: Ranks (gloo on CPU).
        rounds: Rounds; each runs every variant once, in rotating order.
        block_steps: Measured steps per variant per round (after one discarded step).
        batch_size: Global batch in samples.
        tiny: Tiny model and dataset (CI smoke mode).
        calibrate: Record gloo and NS calibration for the simulator.
        seed: Model and data seed.
        out: JSON path (written by rank 0), or ``None``.
        extra_variants: Diagnostic variants from :data:`EXTRA_VARIANTS` run beside the three.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per rank).
        mesh: ``"fsdp"`` (every variant under FSDP2) or ``"replicate"`` (the DDP setting:
            ``adamw`` and ``vanilla`` under torch ``DistributedDataParallel``, dmuon on the
            plain module with ``replicas="keep"``).
        model: ``"tiny"``, ``"default"`` or ``"gpu"`` (:data:`MODELS`); ``tiny=True`` means ``"tiny"``.
        synthetic: random batches of the model's input format instead of PushT demonstrations.
        bf16: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on every
            ``fully_shard`` (``torch_muon`` stays unsharded in float32).
        control: run the A/A control: the baseline a second time as ``adamw_b``
            (:mod:`step_stats`), interleaved like the others.
        warmup_steps: steps discarded at the start of every block (after each switch of variant).
        trace_dir: folder for one ``torch.profiler`` chrome trace per variant (rank 0,
            ``trace_<variant>.json.gz``, ``trace_steps`` steps after one untraced step), taken
            after the measured rounds; ``None``: no traces.
        trace_steps: steps per trace.
        labels: end every block with one profiled step (the ``label_*`` breakdown). The GPU
            suite turns it off on CUDA, where the labels see host time only and the profiled
            step of the ~194 M model cost seconds; the chrome traces show the device there.
            The A/A runs of issue 34 went without (``--no-labels``): a 16-round 4-rank run
            with it (64 profiled steps a rank) died in round 12 with "malloc(): unsorted double
            linked list corrupted", the profiler-under-gloo crash class of :func:`step_timing.drain`.
    """

    nproc: int = 4
    rounds: int = 4
    block_steps: int = 2
    batch_size: int = 64
    tiny: bool = False
    calibrate: bool = True
    seed: int = 0
    out: str | None = None
    extra_variants: tuple[str, ...] = ()
    device: str = "cpu"
    mesh: str = "fsdp"
    model: str = "default"
    synthetic: bool = False
    bf16: bool = False
    control: bool = True
    warmup_steps: int = 1
    trace_dir: str | None = None
    trace_steps: int = 2
    labels: bool = True

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"bench_step: model={self.model!r}; choose one of {sorted(MODELS)}.")
        if self.mesh not in ("fsdp", "replicate"):
            raise ValueError(f"bench_step: mesh={self.mesh!r}; choose 'fsdp' or 'replicate'.")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"bench_step: device={self.device!r}; choose 'cpu' or 'cuda'.")
        if self.device == "cuda" and torch.cuda.device_count() < self.nproc:
            raise ValueError(
                f"bench_step: device='cuda' with nproc={self.nproc} needs {self.nproc} GPU(s); "
                f"this machine has {torch.cuda.device_count()}."
            )
        if "torch_muon" in self.extra_variants and self.nproc != 1:
            raise ValueError(
                f"bench_step: torch_muon is single-process torch.optim.Muon; run it with nproc=1, "
                f"not {self.nproc}."
            )
        if set(self.extra_variants) - set(EXTRA_VARIANTS):
            raise ValueError(
                f"bench_step: extra_variants={self.extra_variants}; choose from {sorted(EXTRA_VARIANTS)}."
            )
        if self.nproc < 1 or self.rounds < 1 or self.block_steps < 1 or self.warmup_steps < 1 or self.trace_steps < 1:
            raise ValueError(
                f"bench_step: nproc={self.nproc}, rounds={self.rounds}, block_steps="
                f"{self.block_steps}, warmup_steps={self.warmup_steps}, trace_steps={self.trace_steps}; "
                f"all must be >= 1."
            )
        if self.batch_size % self.nproc:
            raise ValueError(
                f"bench_step: batch_size={self.batch_size} is not divisible by nproc={self.nproc}."
            )


def synthetic_batch(cfg: PolicyConfig, step: int, global_batch: int, rank: int, world: int,
                    seed: int) -> dict[str, torch.Tensor]:
    """Random batch in :meth:`dmuon.train.data.PushTDemos.batch`'s format (this rank's rows).

    Depends only on ``(seed, step, global_batch)``, like the demonstrations, so every variant
    and world size sees the same data. Shapes: ``images`` float32 [b, 3, S, S] in [0, 1],
    ``state`` [b, state_dim], ``tokens`` int64 [b, max_tokens], ``actions``/``noise`` [b, H,
    action_dim], ``time`` [b] in (0, 1], with ``b = global_batch / world``.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    n, s, h = global_batch, cfg.image_size, cfg.horizon
    full = {"images": torch.rand(n, 3, s, s, generator=gen),
            "state": torch.rand(n, cfg.state_dim, generator=gen) * 2 - 1,
            "tokens": torch.randint(2, cfg.vocab_size, (n, cfg.max_tokens), generator=gen),
            "actions": torch.rand(n, h, cfg.action_dim, generator=gen) * 2 - 1,
            "noise": torch.randn(n, h, cfg.action_dim, generator=gen),
            "time": torch.rand(n, generator=gen).pow(1.0 / 1.5) * 0.999 + 0.001}
    b = global_batch // world
    return {k: v[rank * b:(rank + 1) * b] for k, v in full.items()}


def _calibrate_comm(world: int, sizes: tuple[int, ...] = CALIB_BYTES) -> dict:
    """Median seconds of gloo broadcast / reduce / all-reduce / all-gather per payload size."""
    out: dict[str, list[list[float]]] = {"broadcast": [], "reduce": [], "all_reduce": [], "all_gather": []}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        gathered = torch.empty(world * x.numel())
        for name, fn in (("broadcast", lambda: dist.broadcast(x, src=0)),
                         ("reduce", lambda: dist.reduce(x, dst=0)),
                         ("all_reduce", lambda: dist.all_reduce(x)),
                         ("all_gather", lambda: dist.all_gather_into_tensor(gathered, x))):
            times = []
            for it in range(6):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[name].append([float(nbytes), statistics.median(times[1:])])
    return out


def _calibrate_ns(shapes: list[tuple[int, int]], ns_dtype: torch.dtype) -> list[dict]:
    """Median seconds of one NS (5 steps, dmuon defaults) per distinct shape, all ranks at once."""
    from dmuon.kernels import newton_schulz, ns_flops

    out = []
    gen = torch.Generator().manual_seed(0)
    for shape in sorted(set(shapes)):
        x = torch.randn(*shape, generator=gen)
        times = []
        for it in range(4):
            dist.barrier()
            t0 = time.perf_counter()
            newton_schulz(x, steps=5, dtype=ns_dtype)
            times.append(time.perf_counter() - t0)
        out.append({"shape": list(shape), "s": statistics.median(times[1:]),
                    "flops_gram": ns_flops(*shape, steps=5, method="gram")})
    return out


def _rank_main(cfg: BenchConfig) -> None:
    """One rank of :func:`run`, started by :func:`dmuon.train.ranks.launch` (process group initialized)."""
    import warnings

    # FSDP2's view-output warning and gloo's all_gather_into_tensor deprecation, once per rank
    # and step, would bury the table; they do not affect timing.
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    rank = dist.get_rank()
    result = _run_rank(rank, cfg)
    if rank == 0 and cfg.out:
        path = pathlib.Path(cfg.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))


def _run_rank(rank: int, cfg: BenchConfig) -> dict | None:
    """Benchmark body on one rank of an initialized gloo world; the result dict on rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from torch.distributed.fsdp import MixedPrecisionPolicy

    from dmuon.hooks.dedicate import get_state

    world = dist.get_world_size()
    model_cfg = MODELS["tiny" if cfg.tiny else cfg.model]
    # the data at the model's image size: DataConfig() renders 96 px since issue 27, the
    # default benchmark model stays at 48 (DEFAULT_MODEL)
    data_cfg = TINY_DATA if cfg.tiny else DataConfig(image_size=model_cfg.image_size)
    if cfg.synthetic:
        demos = None
    else:
        if rank == 0:  # the demonstrations and the frames of the rows the run draws
            steps = cfg.rounds * (cfg.warmup_steps + cfg.block_steps + 1) + 1 + cfg.trace_steps
            ensure_run_data(data_cfg, steps=steps, global_batch=cfg.batch_size, seed=cfg.seed,
                            progress=False)
        dist.barrier()
        demos = PushTDemos(data_cfg)
    device = torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")
    shard_kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                      reduce_dtype=torch.float32)} if cfg.bf16 else {}
    mesh = init_device_mesh(cfg.device, (world,))
    ns_dtype = torch.float16 if device.type == "cuda" else torch.float32  # dmuon.train's "auto"
    variants = VARIANTS + cfg.extra_variants + ((step_stats.CONTROL,) if cfg.control else ())
    models, opts = {}, {}
    build_bytes: dict[str, float] = {}
    for variant in variants:
        alloc0 = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        family = "dmuon" if variant == "torch_muon" else variant.split("_")[0]  # same lr, wd
        tcfg = TrainConfig(optimizer=family, batch_size=cfg.batch_size, seed=cfg.seed,
                           model=model_cfg, data=data_cfg, plot=False)
        torch.manual_seed(cfg.seed)
        model = Pi0Policy(model_cfg).to(device)
        if variant == "torch_muon":
            models[variant], opts[variant] = model, _MuonAndAdamW(model, tcfg)
            build_bytes[variant] = float(torch.cuda.memory_allocated(device) - alloc0) if device.type == "cuda" else 0.0
            continue
        if cfg.mesh == "fsdp":
            for block in model.shardable_blocks():
                fully_shard(block, mesh=mesh, **shard_kwargs)
            fully_shard(model, mesh=mesh, **shard_kwargs)
        elif family != "dmuon":  # --mesh replicate: the baselines under torch DDP, as users run them
            model = DistributedDataParallel(model, device_ids=[rank] if device.type == "cuda" else None)
        if variant in EXTRA_VARIANTS:  # dmuon.train's optimizer, other dedicate_params arguments
            import dmuon

            dmuon.dedicate_params(model, mesh, **EXTRA_VARIANTS[variant])
            opts[variant] = dmuon.Muon(model, lr=tcfg.resolved_lr(), weight_decay=tcfg.weight_decay,
                                       adamw_lr=tcfg.adamw_lr, ns_dtype=ns_dtype,
                                       **MUON_OPTIONS.get(variant, {}))
        else:
            opts[variant] = build_optimizer(tcfg, model, mesh, device)
        models[variant] = model
        build_bytes[variant] = float(torch.cuda.memory_allocated(device) - alloc0) if device.type == "cuda" else 0.0
    state = get_state(models["dmuon"])
    state.ensure_bound()
    inventory = [{"fqn": r.fqn, "shape": list(r.shape), "owner": r.owner} for r in state.records]
    # What the measured dmuon build issues per step (sim_validate models exactly this).
    collectives = {"publish": ("one broadcast per (FSDP2 block, owner)" if not state.keep else
                               "replicas='keep': one broadcast per bucket after the step"),
                   "reduce_mode": state.reduce_mode, "buckets": len(state.buckets),
                   "publish_groups": len(state.groups),
                   "group_cost": state.plan.extra.get("group_cost", 0.0)}
    if state.replicated is not None:  # the other parameters' all-reduce buckets (DDP-style)
        collectives["all_reduce_buckets"] = len(state.replicated.buckets)
    if state.shared_bucket is not None:  # keep mode: they ride in one gradient bucket (all-reduced)
        collectives["other_params"] = "in the last gradient bucket (one all_reduce, no reduce)"
    if "dmuon_spread" in models:
        collectives["spread_publish_groups"] = len(get_state(models["dmuon_spread"]).groups)
    n_params = sum(p.numel() for p in Pi0Policy(model_cfg).parameters())

    calibration = None
    if cfg.calibrate and device.type == "cpu":  # the CPU simulator's constants
        sizes = CALIB_BYTES[::2] if cfg.tiny else CALIB_BYTES  # tiny: CI time budget
        calibration = {"comm_s": _calibrate_comm(world, sizes),
                       "ns_s": _calibrate_ns([tuple(r["shape"]) for r in inventory], torch.float32)}

    def get_batch(index: int) -> dict[str, torch.Tensor]:
        if demos is None:
            batch = synthetic_batch(model_cfg, index, cfg.batch_size, rank, world, cfg.seed)
        else:
            batch = demos.batch(index, cfg.batch_size, rank, world, cfg.seed)
        return {k: v.to(device) for k, v in batch.items()}

    records: dict[str, list[dict]] = {v: [] for v in variants}
    next_batch = {v: 0 for v in variants}
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    orders = []
    t_start = time.perf_counter()
    for rnd in range(cfg.rounds):
        order = step_stats.round_order(variants, rnd)
        orders.append(list(order))
        for variant in order:
            switch_variant(device)
            # warmup_steps discarded + block_steps measured + 1 profiled (label breakdown)
            for k in range(cfg.warmup_steps + cfg.block_steps + int(cfg.labels)):
                batch = get_batch(next_batch[variant])
                next_batch[variant] += 1
                profiled = k == cfg.warmup_steps + cfg.block_steps
                rec = timed_step(models[variant], opts[variant], batch, device, profile=profiled)
                rec.update(round=rnd, measured=cfg.warmup_steps <= k and not profiled, profiled=profiled,
                           batch_index=next_batch[variant] - 1)
                records[variant].append(rec)
            pending = getattr(getattr(models[variant], "_dmuon_state", None), "pending", None)
            if pending is not None:  # an overlapped variant's last update, not beside the next block
                pending.wait_all()
        if rank == 0:
            print(f"[bench_step] round {rnd + 1}/{cfg.rounds}: {time.perf_counter() - t_start:.1f} s",
                  file=sys.stderr, flush=True)
    wall_s = time.perf_counter() - t_start
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None
    traces = None
    if cfg.trace_dir:
        traces = write_traces(models, opts, variants, get_batch, next_batch, device, cfg.trace_dir,
                              cfg.trace_steps, rank)

    gathered: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, records)
    if rank != 0:
        return None
    summary = {v: _summarize([g[v] for g in gathered]) for v in variants}
    round_ratios = step_stats.round_ratios({v: [g[v] for g in gathered] for v in variants}) if cfg.control else None
    if device.type == "cuda":  # rank 0's bytes: params + optimizer state (first step) + transient
        for v in variants:
            resident = build_bytes[v] + records[v][0]["alloc_delta_bytes"]
            summary[v]["resident_bytes"] = resident
            summary[v]["peak_bytes"] = resident + summary[v]["transient_peak_bytes"]
    result = {
        "what": "per-phase step times, max over ranks per step, medians over measured steps",
        "device": (torch.cuda.get_device_name(device) + f" x {world}" if device.type == "cuda" else
                   f"cpu ({platform.machine()}, {os.cpu_count()} cores shared by {world} ranks, "
                   f"{torch.get_num_threads()} thread(s) each)"),
        "backend": dist.get_backend(),
        "world_size": world,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": "dmuon.train Pi0Policy " + ("TINY" if cfg.tiny else cfg.model) + " config"
                 + (", bf16 MixedPrecisionPolicy" if cfg.bf16 else "") + (", synthetic data" if cfg.synthetic else ""),
        "model_config": dataclasses.asdict(model_cfg),
        "params": n_params,
        "dedicated_matrices": inventory,
        "dmuon_collectives": collectives,
        "config": dataclasses.asdict(cfg),
        "ns_dtype": f"{str(ns_dtype).removeprefix('torch.')} (dmuon.train 'auto' on {device.type})",
        "fences": "dist.barrier() before every step; none between forward/backward/step"
                  + ("; phases timed by CUDA events on the current stream (no host synchronisation "
                     "between phases), the host waits for the last one after the step"
                     if device.type == "cuda" else "; phases timed by the host clock (time.perf_counter)"),
        "discarded": f"first {cfg.warmup_steps} step(s) of every block (warm-up after a switch of variant; "
                     "previous block's publications)"
                     + ("; before every block: torch.cuda.synchronize, empty_cache, reset_peak_memory_stats"
                        if device.type == "cuda" else ""),
        "round_orders": orders,
        "labels": "label_<name>_<phase>: inclusive CPU time inside dmuon's record_function <name> "
                  "during <phase>, from torch.profiler on the last step of every block (not "
                  "counted in the phase medians); ns: Newton-Schulz labels during the step",
        "mesh": cfg.mesh,
        "wall_s": wall_s,
        # 1/5/15-minute load averages at the start and the end of the measured rounds: on the
        # shared machine other jobs' load is what makes runs differ
        "load_average": {"before": load_before, "after": load_after},
        "variants": summary,
        # ratios of the medians over all measured steps (the figures recorded before the A/A
        # control); round_ratios: the median of per-round ratios with quartiles and verdicts
        "ratios": _ratios(summary),
        "round_ratios": round_ratios,
        "traces": traces,
        "calibration": calibration,
    }
    return result


class _MuonAndAdamW:
    """``torch.optim.Muon`` on the 2-D non-embedding matrices (dmuon's default predicate) and
    ``torch.optim.AdamW`` on the rest, stepped together: the single-process reference."""

    def __init__(self, model: torch.nn.Module, tcfg: TrainConfig) -> None:
        from dmuon.hooks.dedicate import default_predicate

        pick = default_predicate(model)
        mats = [p for n, p in model.named_parameters() if pick(n, p)]
        rest = [p for n, p in model.named_parameters() if p.requires_grad and not pick(n, p)]
        self.opts = [torch.optim.Muon(mats, lr=tcfg.resolved_lr(), weight_decay=tcfg.weight_decay),
                     torch.optim.AdamW(rest, lr=tcfg.adamw_lr, weight_decay=tcfg.weight_decay)]

    def step(self) -> None:
        for opt in self.opts:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.opts:
            opt.zero_grad(set_to_none=set_to_none)


def _summarize(per_rank: list[list[dict]]) -> dict:
    """Per-step max over ranks, then median and quartiles over the measured steps (phases) or
    the profiled steps (labels, ns), in seconds; ``transient_peak_bytes``: the largest over
    measured steps and ranks."""
    steps = [i for i, rec in enumerate(per_rank[0]) if rec["measured"]]
    profiled = [i for i, rec in enumerate(per_rank[0]) if rec.get("profiled")]
    keys = sorted({k for recs in per_rank for rec in recs for k in rec
                   if k not in ("loss", "round", "measured", "profiled", "batch_index")
                   and not k.endswith("_bytes")})
    out: dict = {"measured_steps": len(steps), "profiled_steps": len(profiled)}
    for key in keys:
        which = steps if key in PHASES else profiled
        series = [max(recs[i].get(key, 0.0) for recs in per_rank) for i in which]
        q = statistics.quantiles(series, n=4) if len(series) > 1 else [series[0]] * 3
        out[key] = {"median_s": statistics.median(series), "q1_s": q[0], "q3_s": q[2]}
    out["losses"] = [statistics.fmean(recs[i]["loss"] for recs in per_rank) for i in range(len(per_rank[0]))]
    if "transient_peak_bytes" in per_rank[0][0]:
        out["transient_peak_bytes"] = max(recs[i]["transient_peak_bytes"] for recs in per_rank for i in steps)
    return out


def _ratios(summary: dict) -> dict:
    med = {v: {p: summary[v][p]["median_s"] for p in PHASES} for v in summary}
    extra = {f"{v}_total_over_adamw_total": med[v]["total"] / med["adamw"]["total"]
             for v in summary if v not in VARIANTS}
    if "torch_muon" in med:  # the single-process reference on one device
        extra["dmuon_total_over_torch_muon_total"] = med["dmuon"]["total"] / med["torch_muon"]["total"]
        extra["dmuon_step_over_torch_muon_step"] = med["dmuon"]["step"] / med["torch_muon"]["step"]
    return {**extra,
        "dmuon_step_over_vanilla_step": med["dmuon"]["step"] / med["vanilla"]["step"],
        "dmuon_total_over_adamw_total": med["dmuon"]["total"] / med["adamw"]["total"],
        "vanilla_total_over_adamw_total": med["vanilla"]["total"] / med["adamw"]["total"],
        "vanilla_total_over_dmuon_total": med["vanilla"]["total"] / med["dmuon"]["total"],
        "targets": {"dmuon_step_over_vanilla_step": 0.35, "dmuon_total_over_adamw_total": 1.15},
    }


def run(cfg: BenchConfig, threads: int | None = None) -> dict:
    """Spawns ``cfg.nproc`` ranks (gloo, or NCCL with ``device="cuda"``), runs the benchmark, returns (and writes) the result.

    ``threads``: intra-op threads per rank (default ``cpus // nproc``, at least 1). One rank
    runs in this process (:func:`dmuon.train.ranks.launch`).

    Raises:
        torch.multiprocessing.ProcessRaisedException: If a spawned rank raised (its traceback
            is in the message); with one rank, the exception itself.
    """
    threads = threads or max(1, (os.cpu_count() or 1) // cfg.nproc)
    out = cfg.out or str(pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_step_{os.getpid()}.json")
    cfg = dataclasses.replace(cfg, out=out)
    launch(_rank_main, cfg, cfg.nproc, backend="nccl" if cfg.device == "cuda" else "gloo",
           threads=threads, timeout=timedelta(minutes=10), torchrun=False)
    return json.loads(pathlib.Path(out).read_text())


def format_table(result: dict) -> str:
    """Human-readable table of the medians (milliseconds) and the target ratios."""
    cols = ("forward", "backward", "step", "total", "ns")
    lines = [f"{result['model']}, {result['world_size']} {result['backend']} ranks, {result['device']}, "
             f"--mesh {result.get('mesh', 'fsdp')}",
             f"{'variant':10s} " + " ".join(f"{c:>10s}" for c in cols) + "   profiled labels (ms)"]
    for v in result["variants"]:
        s = result["variants"][v]
        waits = ", ".join(f"{k[6:]}={s[k]['median_s'] * 1e3:.1f}" for k in s if k.startswith("label_"))
        lines.append(f"{v:10s} " + " ".join(f"{s[c]['median_s'] * 1e3:10.1f}" if c in s else f"{'-':>10s}"
                                           for c in cols) + f"   {waits or '-'}")
    r = result["ratios"]
    lines.append(f"ratios of medians: dmuon step / vanilla step = {r['dmuon_step_over_vanilla_step']:.3f} "
                 f"(target <= 0.35); dmuon total / AdamW total = {r['dmuon_total_over_adamw_total']:.3f} "
                 f"(target <= 1.15)")
    if result.get("round_ratios"):
        lines.append(step_stats.format_ratios(result["round_ratios"]))
    load = result.get("load_average") or {}
    if load.get("before"):
        lines.append(f"load average (1, 5, 15 min): before {', '.join(f'{x:.2f}' for x in load['before'])}; "
                     f"after {', '.join(f'{x:.2f}' for x in load['after'])}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    """Command-line arguments -> :class:`BenchConfig` (defaults from the dataclass)."""
    defaults = BenchConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=defaults.nproc)
    p.add_argument("--rounds", type=int, default=defaults.rounds)
    p.add_argument("--block-steps", type=int, default=defaults.block_steps)
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default 64; tiny 8)")
    p.add_argument("--tiny", action="store_true", help="tiny model and data (CI smoke mode)")
    p.add_argument("--no-calibrate", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--extra", nargs="*", default=[], choices=sorted(EXTRA_VARIANTS),
                   help="diagnostic variants run interleaved with the three")
    p.add_argument("--device", choices=("cpu", "cuda"), default=defaults.device,
                   help="cpu: gloo ranks; cuda: NCCL, one GPU per rank")
    p.add_argument("--mesh", choices=("fsdp", "replicate"), default=defaults.mesh,
                   help="fsdp: all under FSDP2; replicate: baselines under DDP, dmuon replicas='keep'")
    p.add_argument("--model", choices=sorted(MODELS), default=defaults.model, help="model size")
    p.add_argument("--synthetic", action="store_true", help="random batches, no PushT simulator")
    p.add_argument("--bf16", action="store_true", help="bf16 MixedPrecisionPolicy on every fully_shard")
    p.add_argument("--no-control", action="store_true", help="no A/A control (adamw_b, the baseline run twice)")
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps,
                   help="steps discarded after every switch of variant")
    p.add_argument("--trace-dir", default=None, help="one gzipped torch.profiler chrome trace per variant here")
    p.add_argument("--trace-steps", type=int, default=defaults.trace_steps)
    p.add_argument("--no-labels", action="store_true",
                   help="no profiled step at the end of each block (no label_* breakdown, no torch profiler)")
    a = p.parse_args(argv)
    return BenchConfig(nproc=a.nproc, rounds=a.rounds, block_steps=a.block_steps,
                       batch_size=a.batch_size or (8 if a.tiny else defaults.batch_size), tiny=a.tiny,
                       calibrate=not a.no_calibrate, out=a.out, extra_variants=tuple(a.extra),
                       device=a.device, mesh=a.mesh, model=a.model, synthetic=a.synthetic, bf16=a.bf16,
                       control=not a.no_control, warmup_steps=a.warmup_steps, trace_dir=a.trace_dir,
                       trace_steps=a.trace_steps, labels=not a.no_labels)


def main(argv: list[str] | None = None) -> None:
    """Command line: ``python bench/bench_step.py --nproc 4 --out ...``."""
    print(format_table(run(parse_args(argv))))


if __name__ == "__main__":
    main()
