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


def reference(world_size: int, scheduler_steps_per_step: int = 1
              ) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """Single-process ``torch.optim.Muon`` (fp32 iteration) + ``AdamW``, the same micro-batches
    summed as ``mean over ranks and micro-batches``, ``clip_grad_norm_(MAX_NORM)``, StepLR.

    Returns:
        Final parameters by name, per-step mean micro-batch losses, per-step total norms.
    """
    model = tp.build(CASE)
    names = set(tp.matrix_names(CASE, model))
    mats = [p for n, p in model.named_parameters() if n in names]
    rest = [p for n, p in model.named_parameters() if n not in names and p.requires_grad]
    muon = torch.optim.Muon(mats, lr=MUON_KWARGS["lr"], weight_decay=MUON_KWARGS["weight_decay"],
                            ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW(rest, lr=MUON_KWARGS["adamw_lr"], weight_decay=MUON_KWARGS["weight_decay"])
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=LR_GAMMA) for o in (muon, adamw)]
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
            for _ in range(scheduler_steps_per_step):
                for s in scheds:
                    s.step()
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


# ---------------------------------------------------------------------------- Accelerate
def _accelerator(plugin_kwargs: dict[str, Any]) -> Any:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **plugin_kwargs)
    accelerator = Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=GA, cpu=True)
    # CPU only: Accelerate chose MULTI_CPU (DDP) above. A GPU user gets FSDP from the plugin.
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def accelerate_run(rank: int, world_size: int, *, ckpt_dir: str) -> dict[str, Any]:
    """The stock Accelerate loop over :func:`dmuon.integrations.accelerate.prepare`:
    4 steps (GA 2, clipping, StepLR), ``save_state`` after step ``SAVE_AFTER``; a fresh
    accelerator + model ``load_state``-ed from it re-runs the last steps; ``get_state_dict``."""
    import dmuon.integrations.accelerate as dmuon_accelerate

    plugin_kwargs = dict(auto_wrap_policy="transformer_based_wrap",
                         transformer_cls_names_to_wrap=["LlamaDecoderLayer"])

    def setup() -> tuple[Any, Any, Any, Any]:
        accelerator = _accelerator(plugin_kwargs)
        model, optimizer = dmuon_accelerate.prepare(accelerator, tp.build(CASE), **MUON_KWARGS)
        sched = accelerator.prepare(torch.optim.lr_scheduler.StepLR(optimizer.optimizer, 1, LR_GAMMA))
        return accelerator, model, optimizer, sched

    def run(accelerator, model, optimizer, sched, steps, save_after=None):
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
