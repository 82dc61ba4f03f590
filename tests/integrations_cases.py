"""dmuon from the trainers people use (issue 32): 🤗 Accelerate and the transformers ``Trainer``.

Each ``*_run`` function runs on every rank of the test pool (``tests/_pool.py``): a tiny
Hugging Face Llama built from a config (``tests/thirdparty_cases.py``, no download), 4
optimizer steps with gradient accumulation 2 and clipping at ``MAX_NORM`` (well below the true
norm, so every step clips), a checkpoint after step ``SAVE_AFTER`` through the trainer's own
save, a fresh trainer resumed from it through the trainer's own load, and the trainer's own
full-weight export. :func:`reference` is single-process ``torch.optim.Muon`` + ``AdamW`` on
the same micro-batches: it shares no code with dmuon.

**Forcing FSDP2 on CPU.** Accelerate and the ``Trainer`` pick FSDP only on accelerators (on
CPU they choose DDP / no FSDP, whatever the plugin says). These tests set the Accelerate
state's ``distributed_type`` to FSDP by hand right after the ``Accelerator`` (or the
``Trainer``) is created; a user on GPUs never needs to. Everything after that is stock.
Accelerate's state is a process-wide singleton and the pool's workers are reused, so every run
resets it (and the environment variables Accelerate sets) on exit.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import numpy as np
import torch

from tests import models
from tests import thirdparty_cases as tp

CASE = "hf-llama-untied"
STEPS, GA, SAVE_AFTER = 4, 2, 2
MAX_NORM = 0.05  # the true norms are ~1-3: every step clips
LR_GAMMA = 0.8   # StepLR, one scheduler step per optimizer step
MUON_KWARGS = dict(tp.OPT_KWARGS)
MICRO = tp.LOCAL_BATCH  # samples per rank per micro-batch


def micro_batch(step: int, micro: int, rank: int, world_size: int) -> torch.Tensor:
    """Token ids ``[MICRO, SEQ]`` of rank ``rank``'s micro-batch ``micro`` of optimizer step
    ``step`` (the global batch of a step: ``GA * world_size * MICRO`` sequences)."""
    (ids,) = tp.CASES[CASE].batch(step, GA * world_size * MICRO)
    start = (micro * world_size + rank) * MICRO
    return ids[start:start + MICRO]


def reference(world_size: int, schedule: str = "step", scheduler_steps_per_step: int = 1,
              case: str = CASE) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """Single-process ``torch.optim.Muon`` (fp32 iteration) + ``AdamW``, the same micro-batches
    summed as ``mean over ranks and micro-batches``, ``clip_grad_norm_(MAX_NORM)``, and the
    learning-rate schedule: ``"step"`` (StepLR(1, LR_GAMMA) stepped
    ``scheduler_steps_per_step`` times per step) or ``"linear"`` (the Trainer's linear decay
    to 0 over ``STEPS``, no warmup).

    Returns:
        Final parameters by name, per-step mean micro-batch losses, per-step total norms.
    """
    model = tp.build(case)
    names = set(tp.matrix_names(case, model))
    mats = [p for n, p in model.named_parameters() if n in names]
    rest = [p for n, p in model.named_parameters() if n not in names and p.requires_grad]
    muon = torch.optim.Muon(mats, lr=MUON_KWARGS["lr"], weight_decay=MUON_KWARGS["weight_decay"],
                            ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW(rest, lr=MUON_KWARGS["adamw_lr"], weight_decay=MUON_KWARGS["weight_decay"])
    if schedule == "step":
        factor = lambda k: LR_GAMMA ** (k * scheduler_steps_per_step)  # noqa: E731
    else:
        factor = lambda k: max(0.0, (STEPS - k) / STEPS)  # noqa: E731
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in (muon, adamw)]
    losses, norms = [], []
    with models.reference_ns(torch.float32):
        for step in range(STEPS):
            total = 0.0
            for micro in range(GA):
                for rank in range(world_size):
                    ids = micro_batch(step, micro, rank, world_size)
                    loss = model(input_ids=ids, labels=ids).loss
                    (loss / (GA * world_size)).backward()
                    total += loss.item() / (GA * world_size)
            losses.append(total)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
            for sched in scheds:
                sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses, norms


def _mean_over_ranks(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


@contextlib.contextmanager
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate's singletons and environment variables reset on exit (the pool reuses
    processes; the next test must not inherit a forced FSDP2 state)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        os.environ.clear()
        os.environ.update(saved)


def _force_fsdp2(accelerator: Any, plugin: Any) -> None:
    """CPU only: make ``accelerator`` FSDP2 with ``plugin`` (Accelerate chose MULTI_CPU, i.e.
    DDP, whatever the plugin said; on GPUs the plugin alone gives FSDP2). Both of Accelerate's
    state singletons: every ``AcceleratorState()`` (each ``AcceleratedOptimizer`` makes one)
    copies ``PartialState``'s ``distributed_type`` over its own."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


# ---------------------------------------------------------------------------- Accelerate
def _accelerator(plugin_kwargs: dict[str, Any]) -> Any:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **plugin_kwargs)
    accelerator = Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=GA, cpu=True)
    _force_fsdp2(accelerator, plugin)
    return accelerator


def accelerate_run(rank: int, world_size: int, *, ckpt_dir: str, case: str = CASE,
                   activation_checkpointing: bool = False) -> dict[str, Any]:
    """The stock Accelerate loop over :func:`dmuon.integrations.accelerate.prepare`:
    4 steps (GA 2, clipping, StepLR), ``save_state`` after step ``SAVE_AFTER``; a fresh
    accelerator + model ``load_state``-ed from it re-runs the last steps; ``get_state_dict``."""
    import dmuon.integrations.accelerate as dmuon_accelerate

    plugin_kwargs = dict(auto_wrap_policy="transformer_based_wrap",
                         transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                         activation_checkpointing=activation_checkpointing)

    def setup() -> tuple[Any, Any, Any, Any]:
        accelerator = _accelerator(plugin_kwargs)
        model, optimizer = dmuon_accelerate.prepare(accelerator, tp.build(case), **MUON_KWARGS)
        sched = accelerator.prepare(torch.optim.lr_scheduler.StepLR(optimizer.optimizer, 1, LR_GAMMA))
        return accelerator, model, optimizer, sched

    def run(accelerator, model, optimizer, sched, steps, save_after=None):
        assert accelerator.is_fsdp2, accelerator.distributed_type  # still forced (see _force_fsdp2)
        losses, norms = [], []
        for step in steps:
            total = 0.0
            for micro in range(GA):
                with accelerator.accumulate(model):
                    ids = micro_batch(step, micro, rank, world_size)
                    loss = model(input_ids=ids, labels=ids).loss
                    accelerator.backward(loss)
                    total += loss.item() / GA
                    if accelerator.sync_gradients:
                        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                    optimizer.step()
                    sched.step()
                    optimizer.zero_grad()
            losses.append(_mean_over_ranks(total))
            if save_after is not None and step + 1 == save_after:
                accelerator.save_state(ckpt_dir)
        return losses, norms

    with _fresh_accelerate_state():
        accelerator, model, optimizer, sched = setup()
        losses, norms = run(accelerator, model, optimizer, sched, range(STEPS), SAVE_AFTER)
        exported = accelerator.get_state_dict(model)
        exported = {k: v.numpy().copy() for k, v in exported.items()}
        accelerator.save_model(model, os.path.join(ckpt_dir, "export"))  # safetensors, rank 0
        lrs = [g["lr"] for g in optimizer.param_groups]
    with _fresh_accelerate_state():
        accelerator2, model2, optimizer2, sched2 = setup()
        accelerator2.load_state(ckpt_dir)
        resumed_losses, _ = run(accelerator2, model2, optimizer2, sched2, range(SAVE_AFTER, STEPS))
        resumed = accelerator2.get_state_dict(model2)
        resumed = {k: v.numpy().copy() for k, v in resumed.items()}
        resumed_lrs = [g["lr"] for g in optimizer2.param_groups]
    return dict(losses=losses, norms=norms, exported=exported, resumed=resumed,
                resumed_losses=resumed_losses, lrs=lrs, resumed_lrs=resumed_lrs,
                num_processes=world_size)


# ------------------------------------------------------------------ the transformers Trainer
def reference_eval_loss(weights: dict[str, torch.Tensor], world_size: int, case: str = CASE) -> float:
    """The ``Trainer.evaluate`` loss of a model holding ``weights`` on :class:`_Tokens`: the
    mean over its ``MICRO``-sequence batches of each batch's mean loss (single process)."""
    model = tp.build(case)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
        ids = torch.stack(_Tokens(world_size).rows)
        losses = [model(input_ids=ids[i:i + MICRO], labels=ids[i:i + MICRO]).loss.item()
                  for i in range(0, len(ids), MICRO)]
    return sum(losses) / len(losses)


class _Tokens(torch.utils.data.Dataset):
    """Every micro-batch of every step in the order the Trainer's sequential sampler and
    Accelerate's batch sharding hand them out: global micro-batch ``m = step * GA + micro``
    is ``world_size`` consecutive per-rank batches of ``MICRO`` sequences."""

    def __init__(self, world_size: int) -> None:
        self.rows = [row for step in range(STEPS) for row in tp.CASES[CASE].batch(step, GA * world_size * MICRO)[0]]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _cpu_fsdp2_trainer_class() -> type:
    """``DmuonTrainer`` whose Accelerate state is forced to FSDP2 (CPU only: on CPU the Trainer's
    accelerator picks DDP whatever ``fsdp_config`` says; on GPUs the arguments alone do it)."""
    from accelerate import FullyShardedDataParallelPlugin

    from dmuon.integrations.transformers import DmuonTrainer

    class CpuFsdp2Trainer(DmuonTrainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            _force_fsdp2(self.accelerator, FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
            self.is_fsdp_enabled = True

    return CpuFsdp2Trainer


def trainer_run(rank: int, world_size: int, *, out_dir: str, case: str = CASE,
                activation_checkpointing: bool = False) -> dict[str, Any]:
    """``DmuonTrainer.train()`` for ``STEPS`` steps (GA 2, ``max_grad_norm``, linear schedule,
    a checkpoint every ``SAVE_AFTER`` steps), ``save_model()``; then a fresh trainer resumed
    from checkpoint-``SAVE_AFTER`` to the end, ``save_model()`` again. Returns the logged
    losses and grad norms and both exports (read back from the files ``save_pretrained`` wrote)."""
    from safetensors.torch import load_file
    from transformers import TrainingArguments
    import torch.distributed as dist

    trainer_class = _cpu_fsdp2_trainer_class()

    def trainer(run_dir: str) -> Any:
        args = TrainingArguments(
            output_dir=run_dir, per_device_train_batch_size=MICRO, gradient_accumulation_steps=GA,
            max_steps=STEPS, max_grad_norm=MAX_NORM, lr_scheduler_type="linear", warmup_steps=0,
            save_strategy="steps", save_steps=SAVE_AFTER, logging_steps=1, report_to=[],
            train_sampling_strategy="sequential", dataloader_drop_last=True, seed=0,
            fsdp=True, fsdp_config={"fsdp_version": 2, "activation_checkpointing": activation_checkpointing,
                                    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
            disable_tqdm=True, use_cpu=True)
        return trainer_class(model=tp.build(case), args=args, train_dataset=_Tokens(world_size),
                             muon_kwargs=MUON_KWARGS)

    def logged(t: Any, after: int = 0) -> tuple[list[float], list[float]]:
        # a resumed trainer's history starts with the checkpoint's entries: keep its own
        logs = [h for h in t.state.log_history if "grad_norm" in h and h["step"] > after]
        return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]

    def exported(path: str) -> dict[str, Any]:
        dist.barrier()  # rank 0 wrote it
        return {k: v.numpy().copy() for k, v in load_file(os.path.join(path, "model.safetensors")).items()}

    with _fresh_accelerate_state():
        t = trainer(out_dir)
        t.train()
        assert t.accelerator.is_fsdp2, t.accelerator.distributed_type  # still forced
        eval_loss = t.evaluate(_Tokens(world_size))["eval_loss"]  # forward only, sharded loader
        t.save_model(os.path.join(out_dir, "final"))
        losses, norms = logged(t)
        lrs = [g["lr"] for g in t.optimizer.param_groups]
        kinds = [g.get("kind") for g in t.optimizer.param_groups]
    with _fresh_accelerate_state():
        t2 = trainer(os.path.join(out_dir, "resume"))
        t2.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{SAVE_AFTER}"))
        t2.save_model(os.path.join(out_dir, "resumed"))
        resumed_losses, resumed_norms = logged(t2, after=SAVE_AFTER)
        resumed_lrs = [g["lr"] for g in t2.optimizer.param_groups]
    return dict(losses=losses, norms=norms, lrs=lrs, kinds=kinds, eval_loss=eval_loss,
                exported=exported(os.path.join(out_dir, "final")),
                checkpoint=exported(os.path.join(out_dir, f"checkpoint-{STEPS}")),
                resumed=exported(os.path.join(out_dir, "resumed")),
                resumed_losses=resumed_losses, resumed_norms=resumed_norms, resumed_lrs=resumed_lrs)
