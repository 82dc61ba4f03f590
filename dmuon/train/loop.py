"""One rank of the training job: process group, FSDP2 model, optimizer, loop, summary.

Every rank builds the same model from the same seed, shards each transformer block and then
the root with FSDP2 ``fully_shard`` on a 1-D mesh, and trains on its slice of a global batch
that depends only on ``(seed, step)``. Rank 0 prints one line per step and writes the summary.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from dmuon.train import ckpt
from dmuon.train.parallel import Layout, shard_model, wrap_data_parallel
from dmuon.train.data import DataConfig, PushTDemos, ensure_run_data
from dmuon.train.eval import EvalConfig, evaluate, format_summary
from dmuon.train.model import Pi0Policy, PolicyConfig

logger = logging.getLogger(__name__)

OPTIMIZERS = ("dmuon", "adamw", "vanilla")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """Run configuration (what ``python -m dmuon.train`` parses).

    Args:
        optimizer: ``"dmuon"``, ``"adamw"`` or ``"vanilla"``.
        steps: Optimizer steps.
        batch_size: Global batch (samples per step over all ranks).
        lr: Matrix lr for Muon variants, the single lr for ``adamw``; ``None`` picks 0.02 / 1e-3.
        adamw_lr: lr of the non-matrix parameters under the Muon variants.
        weight_decay: Decoupled weight decay (all optimizers).
        warmup: Linear lr warm-up in steps (a ``LambdaLR`` over ``param_groups``).
        schedule: After warm-up, ``"constant"`` lr or ``"cosine"`` decay to 0 at ``steps``.
        ns_dtype: Newton-Schulz dtype name; ``"auto"`` is float16 on CUDA, float32 on CPU
            (CPU half-precision matmuls are emulated and slower than float32).
        per_head: per-head Muon on the attention projections (``dmuon.Muon(per_head=True)``).
        qk_clip: QK-clip threshold (``dmuon.Muon(qk_clip_threshold=...)``), ``None``: off.
        overlap: ``dmuon.Muon(overlap=...)``: ``"off"``, ``"forward"`` or ``"backward"``
            (dmuon only; the summary counts the speculative results kept and recomputed).
        clip: clip the gradients to this global norm between backward and step
            (``dmuon.clip_grad_norm_`` / ``torch.nn.utils.clip_grad_norm_``), ``None``: off.
        seed: Seed of model init, batches and flow noise.
        out: Path of ``summary.json`` (rank 0), or ``None``.
        plot: Write ``<out stem>_loss.png`` beside the summary when matplotlib is present.
        timing_warmup: Leading steps left out of the timing medians (when steps allow).
        mesh: ``"fsdp"`` (1-D), ``"replicate"`` (no FSDP2; DDP for the baselines), ``"hsdp:RxS"`` or ``"fsdp-tp:DxT"`` (:mod:`dmuon.train.parallel`).
        data: Dataset generation parameters.
        model: Policy sizes.
        save: Directory of DCP checkpoints (:mod:`dmuon.train.ckpt`), or ``None``.
        save_every: Also checkpoint every this many steps (0: only after the last step).
        eval: Closed-loop evaluation after training (:mod:`dmuon.train.eval`), or ``None``.
    """

    optimizer: str = "dmuon"
    steps: int = 150
    batch_size: int = 64
    lr: float | None = None
    adamw_lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 10
    schedule: str = "constant"
    ns_dtype: str = "auto"
    per_head: bool = False
    qk_clip: float | None = None
    overlap: str = "off"
    clip: float | None = None
    seed: int = 0
    out: str | None = None
    plot: bool = True
    timing_warmup: int = 3
    mesh: str = "fsdp"
    data: DataConfig = DataConfig()
    model: PolicyConfig = PolicyConfig()
    save: str | None = None
    save_every: int = 0
    eval: EvalConfig | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"dmuon.train: --optimizer {self.optimizer!r}; choose one of {OPTIMIZERS}.")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(
                f"dmuon.train: --steps {self.steps} and --batch-size {self.batch_size} must be >= 1."
            )
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"dmuon.train: --schedule {self.schedule!r}; choose constant or cosine.")
        if self.overlap != "off" and self.optimizer != "dmuon":
            raise ValueError(f"dmuon.train: --overlap {self.overlap} needs --optimizer dmuon.")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"dmuon.train: --clip-grad-norm {self.clip} must be > 0.")
        if (self.data.obs, self.data.history) != (self.model.obs, self.model.history) or (
                self.data.obs == "image" and self.data.image_size != self.model.image_size):
            raise ValueError(
                f"dmuon.train: the data (obs={self.data.obs!r}, history={self.data.history}, image_size="
                f"{self.data.image_size}) and the model (obs={self.model.obs!r}, history={self.model.history}, "
                f"image_size={self.model.image_size}) disagree; build both from the same options.")
        if self.data.horizon != self.model.horizon:
            raise ValueError(f"dmuon.train: data horizon {self.data.horizon} != model horizon {self.model.horizon}.")
        if (self.per_head or self.qk_clip is not None) and self.optimizer != "dmuon":
            raise ValueError(f"dmuon.train: --per-head and --qk-clip need --optimizer dmuon, got "
                             f"{self.optimizer!r}.")
        if self.ns_dtype not in ("auto", "float16", "bfloat16", "float32"):
            raise ValueError(
                f"dmuon.train: --ns-dtype {self.ns_dtype!r}; choose auto, float16, bfloat16 or float32."
            )
        if self.save_every < 0 or (self.save_every and self.save is None):
            raise ValueError(f"dmuon.train: --save-every {self.save_every} must be >= 0 and needs --save DIR.")
        if self.eval is not None:
            self.eval.seeds(self.data)  # held-out seeds: fail before training
            if self.eval.exec_horizon > self.model.horizon:
                raise ValueError(f"dmuon.train: --exec-horizon {self.eval.exec_horizon} exceeds the action "
                                 f"chunk H={self.model.horizon}; pass a value in 1..{self.model.horizon}.")

    def resolved_lr(self) -> float:
        """The lr actually used: ``lr``, else 1e-3 for AdamW and 0.02 for the Muon variants."""
        if self.lr is not None:
            return self.lr
        return 1e-3 if self.optimizer == "adamw" else 0.02


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Counts elements: all, 2-D non-embedding matrices (Muon/dedicated), the rest (AdamW)."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    total = matrix = 0
    n_matrices = 0
    for p in model.parameters():
        total += p.numel()
        if p.ndim == 2 and id(p) not in embedding_ids:
            matrix += p.numel()
            n_matrices += 1
    return {"total": total, "matrix": matrix, "other": total - matrix, "n_matrices": n_matrices}


def build_optimizer(cfg: TrainConfig, model: nn.Module, mesh, device: torch.device) -> torch.optim.Optimizer:
    """Creates the optimizer named by ``cfg.optimizer`` for the sharded ``model``.

    Raises:
        RuntimeError: If ``dmuon`` is requested but ``dmuon.dedicate_params``/``dmuon.Muon``
            are not available in this checkout.
    """
    lr = cfg.resolved_lr()
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    if cfg.ns_dtype == "auto":
        ns_dtype = torch.float16 if device.type == "cuda" else torch.float32
    else:
        ns_dtype = getattr(torch, cfg.ns_dtype)
    common = dict(lr=lr, weight_decay=cfg.weight_decay, adamw_lr=cfg.adamw_lr, ns_dtype=ns_dtype)
    if cfg.optimizer == "vanilla":
        from dmuon.train.baselines import VanillaMuon

        return VanillaMuon(model, **common)
    import dmuon

    if not (hasattr(dmuon, "dedicate_params") and hasattr(dmuon, "Muon")):
        raise RuntimeError(
            "dmuon.train: --optimizer dmuon needs dmuon.dedicate_params and dmuon.Muon, which this "
            "checkout does not export yet; use --optimizer vanilla or adamw."
        )
    dmuon.dedicate_params(model, mesh)
    return dmuon.Muon(model, per_head=cfg.per_head, qk_clip_threshold=cfg.qk_clip, overlap=cfg.overlap, **common)


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Multiplier of the base lr at ``step``: linear warm-up, then constant or cosine to 0."""
    warm = max(1, cfg.warmup)
    if step < warm:
        return (step + 1) / warm
    if cfg.schedule == "constant":
        return 1.0
    frac = (step - warm) / max(1, cfg.steps - warm)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(xs: list[float], skip: int) -> float:
    return statistics.median(xs[skip:] if len(xs) > skip else xs)


def train_rank(cfg: TrainConfig) -> dict | None:
    """Runs the job on this rank; the process group must already be initialized.

    Returns:
        The summary dict on rank 0 (also written to ``cfg.out``), ``None`` on other ranks.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if cfg.batch_size % world:
        raise ValueError(
            f"dmuon.train: --batch-size {cfg.batch_size} is not divisible by the world size {world}."
        )
    Layout.parse(cfg.mesh, world)  # fail before generating data
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:  # one writer per node (per local disk)
        where = ensure_run_data(cfg.data, steps=cfg.steps, global_batch=cfg.batch_size, seed=cfg.seed)
        if rank == 0:
            print(where, flush=True)
    dist.barrier()  # the others wait for their node's cache files
    demos = PushTDemos(cfg.data)

    torch.manual_seed(cfg.seed)
    model = Pi0Policy(cfg.model).to(device)
    counts = parameter_counts(model)
    layout = Layout.parse(cfg.mesh, world)
    mesh, dp_index, dp_count = shard_model(model, model.shardable_blocks(), layout, device)
    model = wrap_data_parallel(model, layout, cfg.optimizer, device)
    opt = build_optimizer(cfg, model, mesh, device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
    if rank == 0:
        print(
            f"dmuon.train: {cfg.optimizer} on {world} rank(s) ({device.type}), {len(demos)} samples, "
            f"{counts['total']:,} params ({counts['n_matrices']} matrices, {counts['matrix']:,} elements)",
            flush=True,
        )

    from tqdm import tqdm

    losses: list[float] = []
    step_s: list[float] = []
    train_t0 = time.perf_counter()
    opt_s: list[float] = []
    quiet = cfg.steps > 400  # long runs: a tqdm bar and a line every 5% instead of every step
    bar = tqdm(total=cfg.steps, desc=f"dmuon.train {cfg.optimizer}", disable=not (quiet and rank == 0),
               mininterval=5.0)
    for step in range(cfg.steps):
        batch = {k: v.to(device, non_blocking=True)
                 for k, v in demos.batch(step, cfg.batch_size, dp_index, dp_count, cfg.seed).items()}
        _sync(device)
        t0 = time.perf_counter()
        with record_function("dmuon::forward_backward"):
            loss = model(batch)
            loss.backward()
        if cfg.clip is not None:
            if cfg.optimizer == "dmuon":
                import dmuon

                dmuon.clip_grad_norm_(model, cfg.clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        _sync(device)
        t1 = time.perf_counter()
        with record_function("dmuon::optimizer_step"):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        _sync(device)
        t2 = time.perf_counter()
        step_s.append(t2 - t0)
        opt_s.append(t2 - t1)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # equal slices: the mean of rank means is the global mean
        losses.append(mean_loss.item() / world)
        bar.update(1)
        if rank == 0 and (not quiet or (step + 1) % max(1, cfg.steps // 20) == 0):
            line = (f"step {step + 1:4d}/{cfg.steps}  loss {losses[-1]:.4f}  step {step_s[-1]:.3f}s  "
                    f"opt {opt_s[-1]:.3f}s")
            clip = getattr(getattr(opt, "strategy", None), "qk_clip", None)
            if clip is not None:  # --qk-clip: how many heads the step clipped, and the max logit
                line += f"  qk-clip {clip.clipped_heads} heads (max logit {clip.max_logit:.3f})"
            (bar.write if quiet else print)(line)
        if cfg.save and ((cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps):
            path = ckpt.save_checkpoint(cfg.save, step + 1, model, opt, cfg.optimizer, dataclasses.asdict(cfg))
            if rank == 0:
                print(f"dmuon.train: checkpoint {path}", flush=True)

    bar.close()
    train_s = time.perf_counter() - train_t0
    evaluation = _evaluate_trained(cfg, model, opt, rank) if cfg.eval is not None else None
    if rank != 0:
        return None
    summary = {
        "optimizer": cfg.optimizer,
        "world_size": world,
        "mesh": cfg.mesh,
        "device": device.type,
        "losses": losses,
        "step_s": _median(step_s, cfg.timing_warmup),
        "optimizer_step_s": _median(opt_s, cfg.timing_warmup),
        "step_s_all": step_s,
        "optimizer_step_s_all": opt_s,
        "timing_skipped_steps": cfg.timing_warmup if len(step_s) > cfg.timing_warmup else 0,
        "params": counts,
        "lr": cfg.resolved_lr(),
        "config": dataclasses.asdict(cfg),
        "dataset": {"samples": len(demos), "digest": cfg.data.digest(),
                    "episodes_kept": int(demos.success.sum()) if not cfg.data.keep_failed else cfg.data.episodes,
                    "expert_success": float(demos.success.float().mean()),
                    "expert_final_coverage": float(demos.final_coverage.mean())},
        "train_s": train_s,
        "torch": torch.__version__,
    }
    if cfg.optimizer == "dmuon":  # Muon(overlap="backward"): speculative results kept / recomputed
        summary["overlap_stats"] = opt.overlap_stats()
    if evaluation is not None:
        summary["eval"] = evaluation
    print(f"dmuon.train: first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}, median step "
          f"{summary['step_s']:.3f}s, median optimizer step {summary['optimizer_step_s']:.3f}s", flush=True)
    if cfg.out:
        out = pathlib.Path(cfg.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1))
        if cfg.plot:
            _plot(losses, out.with_name(out.stem + "_loss.png"), f"{cfg.optimizer}, {world} ranks")
    return summary


def _evaluate_trained(cfg: TrainConfig, model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> dict:
    """Rolls the trained policy out: every rank loads the final weights into a plain policy.

    The weights come from the last ``--save`` checkpoint, or from one written to a temporary
    directory (removed afterwards); DCP assembles the FSDP2 shards and owners' masters.
    """
    tmp = None
    if cfg.save:
        path = ckpt.step_dir(cfg.save, cfg.steps)
    else:
        holder = [tempfile.mkdtemp(prefix="dmuon_eval_") if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        tmp = holder[0]
        path = ckpt.save_checkpoint(tmp, cfg.steps, model, opt, cfg.optimizer, dataclasses.asdict(cfg))
    policy, _ = ckpt.load_policy(path, cfg.model)
    result = evaluate(policy, cfg.eval, cfg.data)
    dist.barrier()
    if tmp is not None and rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if rank == 0:
        print(format_summary(result), flush=True)
    return result


def _plot(losses: list[float], path: pathlib.Path, title: str) -> None:
    """Saves the loss curve as PNG; skipped with a log line if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("dmuon.train: matplotlib not installed; no loss plot")
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching loss")
    ax.set_yscale("log")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
