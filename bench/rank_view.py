"""Rank view: one process plays rank R of an N-rank FSDP2 job and measures that rank's cost.

torch's fake process group (``torch.testing._internal.distributed.fake_pg``, backend
``"fake"``) returns every collective at once without data, so FSDP2 and dmuon run one rank's
real compute and hook work at the shard sizes, bucket sizes and Newton-Schulz share of the
N-rank job, on one CPU or GPU. Communication time is *not* in the figures (it is zero here;
``bench/simulate.py --measured`` adds the alpha-beta model of it).

Variants, stepped in interleaved blocks (the order rotates every round), all on the same model,
seed and synthetic batches (this rank's rows of the global batch):

* ``adamw``: FSDP2 + ``torch.optim.AdamW`` (the baseline);
* ``dmuon``: FSDP2 + ``dmuon.dedicate_params`` + ``dmuon.Muon``;
* ``vanilla``: FSDP2 + gather-then-compute Muon (:class:`dmuon.train.baselines.VanillaMuon`);
* ``torch_muon``: unsharded ``torch.optim.Muon`` + ``AdamW`` (single device; world size 1 by
  default, where it is what the job runs; ``--variants`` adds it elsewhere if it fits);
* ``dmuon-overlap-forward`` / ``dmuon-overlap-backward``: ``dmuon`` with ``Muon(overlap=...)``
  (Newton-Schulz behind the next forward; the step's "whole step" then includes what the next
  forward waits for); ``dmuon-a2`` / ``adamw-a2``: a second identical ``dmuon`` / ``adamw``,
  for the A/A spread; ``dmuon-no-ns``: ``dmuon`` whose Newton-Schulz is replaced by a cheap
  stand-in (each update divided by its Frobenius norm; timing only, its weights are not
  Muon's), so that ``whole step - dmuon-no-ns whole step`` is the Newton-Schulz a variant
  leaves exposed (issue 46). After each block of steps the pending work of an overlapped variant is
  waited for outside the timed steps, so it never runs beside another variant's. On CUDA the
  overlapped variants' figures mean what they say only with ``--stream-waits``
  (:class:`ViewConfig`).

The owner plan is the one the real N-rank job would use: solved in this process by the same
solver and inputs rank 0 would use (``group_cost`` of the real job's backend: NCCL on CUDA,
gloo on CPU), and the measured rank is by default the busiest owner (largest Newton-Schulz
load). What needs a live peer is switched off by dmuon on the fake backend (the JSON's
``offline`` lists it: the step check's gloo group, the plan broadcast, the plan digest check).

Buffers a fake collective leaves uninitialised (FSDP2's all-gather outputs, dmuon's
publications on non-owners) hold whatever the allocator returns; on CPU subnormal floats take a
slow path in the FPU, so the rank view runs with ``torch.set_flush_denormal(True)`` (flush to
zero, denormals-are-zero). The losses are therefore meaningless (often NaN) and are not reported
as results; the timing is that of the same ops on normal numbers.

Per phase (forward, backward, step) the JSON gives: wall time (median and quartiles over the
measured steps; ``torch.cuda.synchronize`` before each timestamp on CUDA); from one profiled step
per variant and round (``torch.profiler``; not among the measured steps; medians over the
rounds): CPU time inside
dmuon's hooks (outermost ``dmuon::*`` labels other than the optimizer's math) and inside FSDP2's
own hooks (outermost ``FSDP::*`` labels), the number of top-level aten ops each dispatches (on
CUDA also kernel launches), per step and per unit; and peak memory (CUDA: allocator peak; CPU:
the profiler's allocation trace, transient peak above the step's start).

Usage::

    python bench/rank_view.py --world 8 --device cpu --model gpu --layers 2 --out bench/results/rank_view_cpu_n8.json
    python bench/rank_view.py --world 64 --rank 5 --device cuda --model gpu --sync-debug --trace /tmp/t.json
    python bench/rank_view.py --world 8 --model blocks4 ...   # inventory-shaped models, see MODELS
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from dmuon.train.model import Pi0Policy, PolicyConfig  # noqa: E402
from inventory_model import InventoryModel, blocks_inventory  # noqa: E402
from rank_view_profile import cpu_peak_bytes, analyze  # noqa: E402
from stream_recorder import publication_events  # noqa: E402

VARIANTS = ("adamw", "dmuon", "vanilla", "torch_muon", "dmuon-overlap-forward", "dmuon-overlap-backward",
            "dmuon-a2", "adamw-a2", "dmuon-no-ns")
#: ``Muon(overlap=...)`` of each dmuon variant (issue 39); ``*-a2``: a second, identical instance
#: of ``dmuon`` / ``adamw`` (its A/A spread: how far two runs of the same thing differ here)
OVERLAP_OF = {"dmuon-overlap-forward": "forward", "dmuon-overlap-backward": "backward"}
PHASES = ("forward", "backward", "step")

#: Pi0-3B-shaped policy: PaliGemma's Gemma-2B backbone (2048 wide, 18 layers, MLP 16384, 8
#: heads of 256) + a 300 M action expert (1024 wide, 18 layers) + a SigLIP So400m-like tower
#: (1152 wide, 27 layers). Only where memory allows (a GPU with ~80 GB at world size >= 8).
PI0_3B = PolicyConfig(image_size=224, patch=14, d_vis=1152, vision_depth=27, d_model=2048, depth=18,
                      d_act=1024, act_heads=8, head_dim=256, mlp_ratio_vis=4, mlp_ratio=8,
                      mlp_ratio_act=4, max_tokens=48, horizon=50, action_dim=32, state_dim=32)


def policy_configs() -> dict[str, PolicyConfig]:
    from bench_step import MODELS

    return {**MODELS, "pi0_3b": PI0_3B}



@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ViewConfig:
    """What one rank view measures.

    Args:
        world: N, the size of the job this process plays one rank of.
        rank: the rank played; ``None``: the busiest owner of the plan.
        device: ``"cpu"`` or ``"cuda"``.
        model: a policy config (``tiny``, ``default``, ``gpu``, ``pi0_3b``), an inventory
            (``pi0``, ``qwen2.5-7b``: :mod:`bench.inventories`, scaled by ``scale``), or
            ``blocks<K>`` (``blocks`` units of K square ``width`` matrices).
        layers: keep this many blocks per stack (policies: vision, backbone and expert depth;
            inventories: layers); ``None``: all. Widths are unchanged.
        image_size: policies only: input image side (``None``: the config's).
        batch_per_rank: samples per rank (the global batch is ``world`` times that).
        rounds, block_steps: interleaved rounds; measured steps per variant per round (after
            one discarded step).
        variants: which of :data:`VARIANTS` (``None``: all but ``torch_muon`` unless world 1).
        bf16: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``.
        sync_debug: CUDA only: ``torch.cuda.set_sync_debug_mode("warn")`` during one dmuon step
            (each implicit host synchronisation warns, counted in the JSON).
        trace: CUDA-timeline (or CPU) profile of one dmuon step written as a Chrome trace here.
        scale, width, blocks: inventory models' shrink factor; ``blocks<K>``'s width and units.
        stream_waits: CUDA only (issue 46: the exposed Newton-Schulz of the overlapped
            variants). Without it, a phase ends with ``torch.cuda.synchronize()``, which also
            waits for the overlapped jobs on dmuon's side stream, so ``step`` holds all of their
            Newton-Schulz; and a fake broadcast puts nothing on any stream, so no forward ever
            waits for a job. With it, a phase ends when the compute stream is done
            (``current_stream().synchronize()``), and each publication records an event on
            the stream it is issued on, which the unit's wait puts on the compute stream, as
            NCCL's ``work.wait()`` does: unit k's forward waits for unit k's Newton-Schulz as
            in a real job, with a broadcast that takes no time. On CPU it changes nothing (the
            host already blocks on the worker thread's job, as in a real job).
    """

    world: int = 8
    rank: int | None = None
    device: str = "cpu"
    model: str = "gpu"
    layers: int | None = None
    image_size: int | None = None
    batch_per_rank: int = 2
    rounds: int = 3
    block_steps: int = 2
    variants: tuple[str, ...] | None = None
    bf16: bool = False
    sync_debug: bool = False
    trace: str | None = None
    scale: int = 1
    width: int = 256
    blocks: int = 8
    seed: int = 0
    stream_waits: bool = False

    def __post_init__(self) -> None:
        if self.world < 1 or (self.rank is not None and not 0 <= self.rank < self.world):
            raise ValueError(f"rank_view: world={self.world}, rank={self.rank}; need 0 <= rank < world.")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"rank_view: device={self.device!r}; choose 'cpu' or 'cuda'.")
        if set(self.variants or ()) - set(VARIANTS):
            raise ValueError(f"rank_view: variants={self.variants}; choose from {VARIANTS}.")

    def chosen_variants(self) -> tuple[str, ...]:
        if self.variants:
            return self.variants
        return VARIANTS if self.world == 1 else VARIANTS[:3]


# ------------------------------------------------------------------ models and batches
def make_model(cfg: ViewConfig) -> tuple[Callable[[], nn.Module], Callable[[int], dict], dict]:
    """``(build, batch(step), description)`` for ``cfg.model``."""
    from bench_step import synthetic_batch

    policies = policy_configs()
    if cfg.model in policies:
        pc = policies[cfg.model]
        if cfg.layers is not None:
            pc = dataclasses.replace(pc, vision_depth=min(pc.vision_depth, cfg.layers),
                                     depth=min(pc.depth, cfg.layers))
        if cfg.image_size is not None:
            pc = dataclasses.replace(pc, image_size=cfg.image_size)
        batch = lambda step: synthetic_batch(pc, step, cfg.batch_per_rank * cfg.world, cfg.rank or 0,
                                             cfg.world, cfg.seed)
        return (lambda: Pi0Policy(pc)), batch, {"kind": "Pi0Policy", "config": dataclasses.asdict(pc)}
    if cfg.model.startswith("blocks"):
        per_block = int(cfg.model.removeprefix("blocks"))
        inv = blocks_inventory(cfg.blocks, per_block, cfg.width)
    else:
        from inventories import inventory

        inv = inventory(cfg.model, scale=cfg.scale, max_layers=cfg.layers)
    width = max(max(r, c) for _, (r, c) in inv)
    tokens = 16

    def batch(step: int) -> dict:
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        return {"x": torch.randn(cfg.batch_per_rank, tokens, width, generator=gen)}

    return (lambda: InventoryModel(inv)), batch, {"kind": "InventoryModel", "matrices": len(inv),
                                                  "tokens_per_sample": tokens, "width": width}


# ------------------------------------------------------------------ process group and plan
def init_fake(rank: int, world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _shard(model: nn.Module, mesh, bf16: bool) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
    for block in model.shardable_blocks():
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def real_group_cost(device: str) -> float:
    """``group_cost`` the real job's default plan uses: NCCL on CUDA, gloo on CPU."""
    from dmuon.balance.cost import default_group_cost

    return default_group_cost("nccl" if device == "cuda" else "gloo", "flops")


def solve_plan(cfg: ViewConfig, build: Callable[[], nn.Module]):
    """The plan the real N-rank job's rank 0 would solve (same solver, shapes, FSDP2 blocks and
    backend ``group_cost``), solved here on a meta-device copy of the model. Its deadlines
    (issue 46's runtime plan) count the tokens this rank's forward really sees: ``batch_per_rank
    x tokens per sample`` for inventory models (``dedicate_params(forward_tokens=...)``; the
    library's default, 4096, for policies)."""
    import dmuon
    from torch.distributed.device_mesh import init_device_mesh

    init_fake(0, cfg.world)
    mesh = init_device_mesh(cfg.device, (cfg.world,))
    with torch.device("meta"):
        model = build()
    _shard(model, mesh, cfg.bf16)
    described = make_model(cfg)[2]
    tokens = (cfg.batch_per_rank * described["tokens_per_sample"]
              if described["kind"] == "InventoryModel" else None)
    kw = {} if tokens is None else {"forward_tokens": tokens}
    plan = dmuon.dedicate_params(model, mesh, group_cost=real_group_cost(cfg.device), **kw)
    return plan


# ------------------------------------------------------------------ the run
class _MuonAndAdamW:
    def __init__(self, model: nn.Module) -> None:
        from dmuon.hooks.dedicate import default_predicate

        pick = default_predicate(model)
        mats = [p for n, p in model.named_parameters() if pick(n, p)]
        rest = [p for n, p in model.named_parameters() if p.requires_grad and not pick(n, p)]
        self.opts = [torch.optim.Muon(mats, lr=0.02, weight_decay=0.01),
                     torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.01)]

    def step(self) -> None:
        for opt in self.opts:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.opts:
            opt.zero_grad(set_to_none=set_to_none)


def build_variant(variant: str, build: Callable[[], nn.Module], mesh, device: torch.device,
                  cfg: ViewConfig, plan) -> tuple[nn.Module, Any]:
    torch.manual_seed(cfg.seed)
    model = build().to(device)
    if variant == "torch_muon":
        return model, _MuonAndAdamW(model)
    _shard(model, mesh, cfg.bf16)
    if variant in ("adamw", "adamw-a2"):
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    ns_dtype = torch.float16 if device.type == "cuda" else torch.float32  # dmuon.train's "auto"
    common = dict(lr=0.02, weight_decay=0.01, adamw_lr=3e-4, ns_dtype=ns_dtype)
    if variant == "vanilla":
        from dmuon.train.baselines import VanillaMuon

        return model, VanillaMuon(model, **common)
    import dmuon

    dmuon.dedicate_params(model, mesh, plan=plan)
    opt = dmuon.Muon(model, **common, overlap=OVERLAP_OF.get(variant, "off"))
    if variant == "dmuon-no-ns":
        _without_newton_schulz(opt)
    return model, opt


def _without_newton_schulz(opt) -> None:
    """Timing only: ``opt``'s Newton-Schulz becomes one division per matrix by its Frobenius
    norm (the rest of the step: momentum, master update, publication, unchanged)."""
    import types

    from dmuon.owners.update import MuonHyper

    class StandIn(MuonHyper):
        __slots__ = ()

        def orthogonalizer(self):
            return lambda mats: [m / (torch.linalg.vector_norm(m) + 1e-7) for m in mats]

    strategy = opt.strategy
    real = type(strategy).hyper

    def hyper(self, group):
        hp = real(self, group)
        return StandIn(**{f.name: getattr(hp, f.name) for f in dataclasses.fields(MuonHyper)})

    strategy.hyper = types.MethodType(hyper, strategy)


def flop_budget(cfg: ViewConfig, build: Callable[[], nn.Module], plan, rank: int) -> dict:
    """FLOPs of ``rank``'s step: its Newton-Schulz (the plan's matrices it owns, the kernels'
    own count, :func:`dmuon.balance.cost.ns_flops`, Gram method) and its forward + backward
    (``6 x tokens x sum(rows x cols)`` over every matrix of the model, the matmuls' count;
    attention scores, norms and element-wise work not counted)."""
    from dmuon.balance.cost import ns_flops

    with torch.device("meta"):
        model = build()
    from dmuon.hooks.dedicate import default_predicate

    pick = default_predicate(model)
    mats = {n: tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 2 and pick(n, p)}
    owner = getattr(plan, "owner_by_fqn", {})
    mine = [shape for n, shape in mats.items() if owner.get(n) == rank]
    ns = sum(ns_flops(r, c) for r, c in mine)
    described = make_model(cfg)[2]
    if described["kind"] == "InventoryModel":
        tokens = cfg.batch_per_rank * described["tokens_per_sample"]
        fwd_bwd = 6.0 * tokens * sum(r * c for r, c in mats.values())
    else:
        fwd_bwd = None  # a policy: its tokens per matrix differ by stack; not counted here
    return {"ns_flops": ns, "fwd_bwd_matmul_flops": fwd_bwd,
            "ns_over_fwd_bwd": None if fwd_bwd is None else ns / fwd_bwd, "matrices_owned": len(mine)}


def _step(model, opt, batch, device, profile: bool = False, memory: bool = False,
          stream_waits: bool = False) -> dict:
    def now() -> float:
        if device.type == "cuda" and stream_waits:  # not the side stream's jobs (ViewConfig)
            torch.cuda.current_stream(device).synchronize()
        elif device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    rec: dict[str, Any] = {}

    def phase(name: str, fn):
        if device.type == "cuda" and profile:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = now()
        if profile:
            from torch.profiler import ProfilerActivity, profile as tprofile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with tprofile(activities=acts, profile_memory=memory and device.type == "cpu") as prof:
                out = fn()
            rec[name] = analyze(prof.events(), name)
            if device.type == "cpu" and memory:
                rec[name]["transient_peak_bytes"] = cpu_peak_bytes(prof.events())
        else:
            out = fn()
        rec[f"{name}_s"] = now() - t0
        if device.type == "cuda" and profile:
            rec[name]["transient_peak_bytes"] = float(torch.cuda.max_memory_allocated(device) - base)
        return out

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    loss = phase("forward", lambda: model(batch))
    phase("backward", loss.backward)
    phase("step", step)
    rec["total_s"] = sum(rec[f"{p}_s"] for p in PHASES)
    return rec


def _resident_bytes(model: nn.Module, opt) -> float:
    """Bytes of the distinct storages of parameters, gradients, optimizer state and dmuon's
    records (masters, compute buffers) this rank holds after a step."""
    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())

    for p in model.parameters():
        add(p)
        add(p.grad)
    for o in getattr(opt, "opts", [opt]):
        for st in o.state.values():
            for v in st.values():
                add(v)
    state = getattr(model, "_dmuon_state", None)
    for rec in getattr(state, "records", ()):
        add(rec.master)
        add(rec.buffer)
    seen.pop(0, None)
    return float(sum(seen.values()))


def _quartiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median_s": statistics.median(xs), "q1_s": q[0], "q3_s": q[2], "n": len(xs)}


def run(cfg: ViewConfig) -> dict:
    """Plays ``cfg.rank`` (or the busiest owner) of a ``cfg.world``-rank job; returns the JSON."""
    import warnings

    import dmuon  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from dmuon.hooks.dedicate import get_state

    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    if cfg.device == "cpu":
        # uninitialised buffers of fake collectives: subnormals must not hit the FPU's slow path
        torch.set_flush_denormal(True)
    build, batch_fn, described = make_model(cfg)
    t_plan = time.perf_counter()
    plan = solve_plan(cfg, build)
    plan_s = time.perf_counter() - t_plan
    loads = plan.loads()
    busiest = max(range(cfg.world), key=lambda r: (loads[r], -r))
    rank = busiest if cfg.rank is None else cfg.rank
    cfg = dataclasses.replace(cfg, rank=rank)
    build, batch_fn, described = make_model(cfg)  # this rank's batch rows
    init_fake(rank, cfg.world)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(cfg.device, (cfg.world,))
    variants = cfg.chosen_variants()
    models, opts = {}, {}
    for v in variants:
        models[v], opts[v] = build_variant(v, build, mesh, device, cfg, plan)
    state = get_state(models["dmuon"]) if "dmuon" in models else None
    if state is not None:
        state.ensure_bound()
    batches = [{k: t.to(device) for k, t in batch_fn(i).items()} for i in range(2 + cfg.block_steps)]

    steps: dict[str, list[dict]] = {v: [] for v in variants}
    profiles: dict[str, list[dict]] = {v: [] for v in variants}
    t0 = time.perf_counter()
    stream_waits = cfg.stream_waits and device.type == "cuda"
    with publication_events(stream_waits):
        for rnd in range(cfg.rounds):
            order = variants[rnd % len(variants):] + variants[: rnd % len(variants)]
            for v in order:
                # 1 discarded + block_steps measured (wall clock) + 1 profiled (hooks, ops, memory)
                for k in range(2 + cfg.block_steps):
                    profiled_step = k == 1 + cfg.block_steps
                    rec = _step(models[v], opts[v], batches[k % len(batches)], device, profile=profiled_step,
                                memory=profiled_step, stream_waits=stream_waits)
                    if profiled_step:
                        profiles[v].append(rec)
                    elif k > 0:
                        steps[v].append(rec)
                pending = getattr(getattr(models[v], "_dmuon_state", None), "pending", None)
                if pending is not None:  # an overlapped variant's last update: not beside the next
                    pending.wait_all()
                    if stream_waits:  # wait_all only orders the compute stream on CUDA
                        torch.cuda.synchronize(device)
            print(f"[rank_view] round {rnd + 1}/{cfg.rounds}: {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    wall_s = time.perf_counter() - t0

    summary: dict[str, dict] = {}
    for v in variants:
        s: dict[str, Any] = {p: _quartiles([r[f"{p}_s"] for r in steps[v]]) for p in (*PHASES, "total")}
        s["profiled"] = {p: profiles[v][-1][p] for p in PHASES}  # the last round's, in full
        s["resident_bytes"] = _resident_bytes(models[v], opts[v])
        per_round = [{f"{fam}_{what}": sum(prof[p][f"{fam}_{what}"] for p in PHASES)
                      for fam in ("dmuon", "fsdp") for what in ("hooks_cpu_s", "aten_ops")}
                     for prof in profiles[v]]
        # medians over the rounds' profiled steps (one per round, interleaved like the rest)
        s["per_step"] = {key: (statistics.median_low if key.endswith("_ops") else statistics.median)(
            [r[key] for r in per_round]) for key in per_round[0]}
        s["per_step"]["dmuon_hooks_cpu_s_by_round"] = [r["dmuon_hooks_cpu_s"] for r in per_round]
        s["per_step"]["fsdp_hooks_cpu_s_by_round"] = [r["fsdp_hooks_cpu_s"] for r in per_round]
        s["per_step"]["dmuon_hook_labels_cpu_s"] = {
            label: statistics.median(sum(prof[p]["dmuon_hook_labels_cpu_s"].get(label, 0.0) for p in PHASES)
                                     for prof in profiles[v])
            for label in {k for prof in profiles[v] for p in PHASES for k in prof[p]["dmuon_hook_labels_cpu_s"]}}
        if device.type == "cuda":
            s["per_step"]["dmuon_kernel_launches"] = sum(s["profiled"][p]["dmuon_kernel_launches"] for p in PHASES)
        peaks = [prof[p].get("transient_peak_bytes") for prof in profiles[v] for p in PHASES]
        s["transient_peak_bytes"] = max((x for x in peaks if x is not None), default=None)
        summary[v] = s
    units = len(state.units) if state is not None else None
    if state is not None:
        d = summary["dmuon"]["per_step"]
        d["units"] = units
        d["dmuon_aten_ops_per_unit"] = d["dmuon_aten_ops"] / max(1, units)
        # the issue's earlier figure (0.23x) predates the gradient hook's label: without the
        # packing of the gradients into the reduce buckets (a copy FSDP2 makes too, for its
        # reduce-scatter input, inside its own labels)
        d["dmuon_hooks_cpu_s_without_grad_hook"] = d["dmuon_hooks_cpu_s"] - d["dmuon_hook_labels_cpu_s"].get(
            "dmuon::grad_hook", 0.0)
    ratios = {}
    for v in summary:  # the whole step of every variant against FSDP2 + AdamW and dmuon (overlap off)
        for base in ("adamw", "dmuon", "dmuon-no-ns"):
            if base in summary and v != base:
                ratios[f"{v}_total_over_{base}_total"] = summary[v]["total"]["median_s"] / summary[base]["total"]["median_s"]
    if "dmuon-no-ns" in summary:  # issue 46: the Newton-Schulz each dmuon variant leaves exposed
        base = summary["dmuon-no-ns"]["total"]["median_s"]
        exposed = {v: summary[v]["total"]["median_s"] - base for v in summary if v.startswith("dmuon") and v != "dmuon-no-ns"}
        ratios["exposed_ns_s"] = exposed
        if exposed.get("dmuon", 0) > 0:
            ratios["exposed_ns_over_off"] = {v: e / exposed["dmuon"] for v, e in exposed.items()}
        if "adamw" in summary:
            ratios["exposed_ns_over_adamw_total"] = {v: e / summary["adamw"]["total"]["median_s"]
                                                     for v, e in exposed.items()}
    if "adamw" in summary and "dmuon" in summary:
        med = {v: {p: summary[v][p]["median_s"] for p in (*PHASES, "total")} for v in summary}
        ratios.update({f"dmuon_{p}_over_adamw_{p}": med["dmuon"][p] / med["adamw"][p] for p in (*PHASES, "total")})
        fsdp_in_adamw = summary["adamw"]["per_step"]["fsdp_hooks_cpu_s"]
        ratios["dmuon_hooks_over_fsdp_hooks_in_adamw"] = summary["dmuon"]["per_step"]["dmuon_hooks_cpu_s"] / fsdp_in_adamw
        ratios["dmuon_hooks_over_fsdp_hooks_in_dmuon"] = (summary["dmuon"]["per_step"]["dmuon_hooks_cpu_s"]
                                                          / summary["dmuon"]["per_step"]["fsdp_hooks_cpu_s"])
        ratios["dmuon_hooks_without_grad_hook_over_fsdp_hooks_in_adamw"] = (
            summary["dmuon"]["per_step"]["dmuon_hooks_cpu_s_without_grad_hook"] / fsdp_in_adamw)
        ratios["all_hooks_in_dmuon_over_fsdp_hooks_in_adamw"] = (
            (summary["dmuon"]["per_step"]["dmuon_hooks_cpu_s"] + summary["dmuon"]["per_step"]["fsdp_hooks_cpu_s"])
            / fsdp_in_adamw)
        ratios["targets"] = {"dmuon_hooks_over_fsdp_hooks (CPU, N=8)": 0.5,
                             "dmuon_total_over_adamw_total (GPU, N=8)": 1.05}
    sync = sync_debug_step(models["dmuon"], opts["dmuon"], batches[0], device, cfg) if (
        (cfg.sync_debug or cfg.trace) and "dmuon" in models) else None

    owned = [r.fqn for r in state.records if r.is_owner] if state is not None else []
    result = {
        "what": ("one rank of an N-rank FSDP2 job played in one process on torch's fake process "
                 "group: this rank's compute and hook work, communication time zero"),
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda" else
                   f"cpu ({platform.machine()}, {os.cpu_count()} cores, shared; "
                   f"{torch.get_num_threads()} thread(s))"),
        "torch": torch.__version__, "python": platform.python_version(),
        "world": cfg.world, "rank": rank, "busiest_rank": busiest,
        "rank_choice": "busiest owner (largest NS load)" if rank == busiest else "given",
        "model": cfg.model, "model_description": described,
        "layers_note": (None if cfg.layers is None else
                        f"{cfg.layers} block(s) per stack instead of the config's depth; widths unchanged"),
        "config": dataclasses.asdict(cfg),
        "global_batch": cfg.batch_per_rank * cfg.world,
        "flops": flop_budget(cfg, build, plan, rank),
        "plan": {"method": plan.method, "makespan": plan.makespan, "lower_bound": plan.lower_bound,
                 "cost_unit": plan.cost_unit, "loads": loads, "group_cost": real_group_cost(cfg.device),
                 "solve_s": plan_s, "owned_by_rank": len(owned),
                 "matrices": len(plan.owner_by_fqn) if hasattr(plan, "owner_by_fqn") else None},
        "dmuon_units": units, "dmuon_publish_groups": len(state.groups) if state is not None else None,
        "dmuon_buckets": len(state.buckets) if state is not None else None,
        "offline": (["plan broadcast (plan solved in process by solve_plan, as rank 0 of the "
                     "real job would, and passed to dedicate_params)"]
                    + (list(state.offline) if state is not None else [])),
        "faked": ["every collective (fake process group: returns at once, moves no data)",
                  "no heartbeat (dmuon.Heartbeat is started by the user's loop; the rank view does not)"],
        "uninitialised_buffers": ("torch.set_flush_denormal(True) on CPU (flush-to-zero and "
                                  "denormals-are-zero); buffers are not zero-filled, so losses "
                                  "are meaningless" if device.type == "cpu" else
                                  "none: GPUs have no subnormal slow path; losses meaningless"),
        "timing": ("wall clock per phase, medians over measured steps; variants interleaved in "
                   "rotating blocks of 1 discarded + block_steps measured + 1 profiled step; "
                   "the profiled steps (one per round) give hook CPU times and op counts "
                   "(per_step: medians over rounds) and peak memory (max)"),
        "wall_s": wall_s,
        "variants": summary,
        "ratios": ratios,
        "sync_debug": sync,
    }
    dist.destroy_process_group()
    return result


def sync_debug_step(model, opt, batch, device: torch.device, cfg: ViewConfig) -> dict:
    """One dmuon step under ``torch.cuda.set_sync_debug_mode("warn")`` (CUDA) and a profiler
    whose Chrome trace is written to ``cfg.trace`` (the CUDA timeline on CUDA)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile as tprofile

    out: dict[str, Any] = {}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda" and cfg.sync_debug:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with tprofile(activities=acts) as prof:
                loss = model(batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        finally:
            if device.type == "cuda" and cfg.sync_debug:
                torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    out["sync_warnings"] = len(syncs)
    out["sync_warning_texts"] = dict(Counter(syncs).most_common(10))
    out["mode"] = "torch.cuda.set_sync_debug_mode('warn')" if device.type == "cuda" else "CPU: no sync debug mode"
    if cfg.trace:
        pathlib.Path(cfg.trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(cfg.trace)
        out["trace"] = cfg.trace
    return out


def format_table(result: dict) -> str:
    lines = [f"rank view: rank {result['rank']} of {result['world']} ({result['rank_choice']}), "
             f"{result['model']}, {result['device']}",
             f"{'variant':10s} {'forward':>9s} {'backward':>9s} {'step':>9s} {'total':>9s} "
             f"{'dmuon hk':>9s} {'FSDP hk':>9s} {'dm ops':>7s} {'FSDP ops':>8s}  (ms, ops per step)"]
    for v, s in result["variants"].items():
        ps = s["per_step"]
        lines.append(f"{v:10s} " + " ".join(f"{s[p]['median_s'] * 1e3:9.1f}" for p in (*PHASES, "total"))
                     + f" {ps['dmuon_hooks_cpu_s'] * 1e3:9.2f} {ps['fsdp_hooks_cpu_s'] * 1e3:9.2f}"
                     f" {ps['dmuon_aten_ops']:7.0f} {ps['fsdp_aten_ops']:8.0f}")
    r = result["ratios"]
    if r:
        lines.append(f"dmuon hooks / FSDP2 hooks (AdamW run) = {r['dmuon_hooks_over_fsdp_hooks_in_adamw']:.3f} "
                     f"(target <= 0.5 on CPU at N=8); dmuon total / AdamW total = "
                     f"{r['dmuon_total_over_adamw_total']:.3f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> ViewConfig:
    d = ViewConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=d.world)
    p.add_argument("--rank", type=int, default=None, help="default: the busiest owner of the plan")
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device)
    p.add_argument("--model", default=d.model,
                   help="tiny|default|gpu|pi0_3b (policies), pi0|qwen2.5-7b (inventories), blocks<K>")
    p.add_argument("--layers", type=int, default=None, help="blocks per stack (widths unchanged)")
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--batch-per-rank", type=int, default=d.batch_per_rank)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--block-steps", type=int, default=d.block_steps)
    p.add_argument("--variants", nargs="*", default=None, choices=VARIANTS)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--sync-debug", action="store_true",
                   help="CUDA: one dmuon step under torch.cuda.set_sync_debug_mode('warn')")
    p.add_argument("--trace", default=None, help="Chrome trace of one dmuon step (CUDA timeline on CUDA)")
    p.add_argument("--scale", type=int, default=d.scale)
    p.add_argument("--width", type=int, default=d.width)
    p.add_argument("--blocks", type=int, default=d.blocks)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--stream-waits", action="store_true",
                   help="CUDA: phases end on the compute stream and fake publications make it wait "
                        "(the overlapped variants' exposed Newton-Schulz; see ViewConfig.stream_waits)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = ViewConfig(world=a.world, rank=a.rank, device=a.device, model=a.model, layers=a.layers,
                     image_size=a.image_size, batch_per_rank=a.batch_per_rank, rounds=a.rounds,
                     block_steps=a.block_steps, variants=tuple(a.variants) if a.variants else None,
                     bf16=a.bf16, sync_debug=a.sync_debug, trace=a.trace, scale=a.scale, width=a.width,
                     blocks=a.blocks, stream_waits=a.stream_waits)
    return cfg, a.out


def main(argv: list[str] | None = None) -> None:
    cfg, out = parse_args(argv)
    result = run(cfg)
    if out:
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    print(format_table(result))


if __name__ == "__main__":
    main()
