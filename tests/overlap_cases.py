"""Functions that run on every rank of the test pool for ``Muon(overlap=...)`` (tests/test_overlap.py).

Every run slows each overlapped job down (:func:`slow_jobs`: 20 ms before it starts), so a
reader that did not wait for a pending update would see the old weights and the comparison
with the single-process reference would fail.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

import dmuon
from dmuon.owners.overlap import PendingSteps
from tests import models
from tests.dist_cases import build, full_params

OPT = dict(lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32,
           ns_coefficients="muon")


@contextlib.contextmanager
def slow_jobs(delay_s: float = 0.02, fail: bool = False, only: str | None = None,
              ended: dict | None = None) -> Iterator[None]:
    """Every overlapped job (``only``: those whose description contains it) sleeps ``delay_s``
    first (or raises, with ``fail``); with ``ended``, a slowed job's end time goes to
    ``ended[only]``. Restored on exit (the pool's workers are reused)."""
    submit = PendingSteps.submit

    def slowed(self, fn, device, what, keep=(), **kw):
        def run() -> None:
            if only is not None and only not in what:
                return fn()
            time.sleep(delay_s)
            if fail:
                raise FloatingPointError("injected failure")
            fn()
            if ended is not None:
                ended[only] = time.monotonic()
        return submit(self, run, device, what, keep, **kw)

    PendingSteps.submit = slowed
    try:
        yield
    finally:
        PendingSteps.submit = submit


@contextlib.contextmanager
def counted_jobs(counts: dict) -> Iterator[None]:
    """Counts the jobs overlapped steps schedule in ``counts["scheduled"]`` (0: nothing
    overlapped). Restored on exit (the pool's workers are reused)."""
    schedule = PendingSteps.schedule
    counts["scheduled"] = 0

    def counted(self, *args, **kwargs):
        counts["scheduled"] += 1
        return schedule(self, *args, **kwargs)

    PendingSteps.schedule = counted
    try:
        yield
    finally:
        PendingSteps.schedule = schedule


@contextlib.contextmanager
def coalesced_on_gloo() -> Iterator[None]:
    """Gloo cannot coalesce (``startCoalescing`` is NCCL's); this makes the flat buckets'
    ``issued_together`` hand every :class:`Pending` of a bucket one
    ``torch.distributed._coalescing_manager``'s manager holding the bucket's works, the object
    NCCL's coalesced group call leaves there, so a CPU run goes through the code that polls it."""
    from torch.distributed.distributed_c10d import _CoalescingManager

    from dmuon.comm import collectives

    original = collectives.issued_together

    @contextlib.contextmanager
    def together(group, device, pendings):
        first = len(pendings)
        yield
        manager = _CoalescingManager()
        for pend in pendings[first:]:
            manager.append(pend.work)
        for pend in pendings[first:]:
            pend.work = manager

    collectives.issued_together = together
    try:
        yield
    finally:
        collectives.issued_together = original


def train(rank: int, world_size: int, *, overlap: str, mode: str = "fsdp", steps: int = 4,
          micro_batches: int = 1, lr_gamma: float | None = None, clip: float | None = None,
          readers: bool = False, sched_after_step: bool = False, grad_scale: float | None = None,
          ema_decay: float | None = None, scaler: bool = False, delay_s: float = 0.02,
          per_head: bool = False, pause_s: float = 0.0, coalesce: bool = False) -> dict[str, Any]:
    """Train the test model with ``Muon(overlap=overlap)`` and slowed jobs.

    ``lr_gamma``: a StepLR stepped between ``backward()`` and ``step()`` (from step 1 on: the
    same lr sequence as stepping it after ``step()``), or with ``sched_after_step`` right after
    ``opt.step()``, the order most training loops use. ``readers``: between each ``step()`` and
    the next forward, an eval forward on the next batch, and another once nothing is pending
    (both losses are returned) and, after the last step, torch's full model state dict (returned as
    ``sd_params``, rank 0). ``grad_scale``: between ``backward()`` and ``step()`` every gradient
    the rank holds (``model.parameters()``) is multiplied by it through ``.data`` (which does not
    bump the version counter), as older training code does, after ``pause_s`` seconds (logging:
    the speculative jobs have run by then). ``ema_decay``: after each step and
    ``opt.wait_pending()``, an EMA of the owned masters read directly (``ema``, per rank) and of
    torch's full state dict (``sd_ema``, rank 0). ``scaler``: FSDP2's ``ShardedGradScaler`` (scale
    2^10, never grows) scales the loss, unscales the gradients and steps. ``coalesce``: the
    buckets' collectives as NCCL's coalesced group calls leave them (:func:`coalesced_on_gloo`).
    """
    model, _ = build(world_size, mode)
    opt = dmuon.Muon(model, **OPT, overlap=overlap, per_head=per_head)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=lr_gamma) if lr_gamma else None
    grad_scaler = None
    if scaler:  # FSDP2's scaler (it all-reduces found_inf over the ranks)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        grad_scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 10, growth_interval=10 ** 6)
    state = model._dmuon_state
    losses, eval_losses, norms = [], [], []
    ema: dict[str, torch.Tensor] = {}
    sd_ema: dict[str, torch.Tensor] = {}
    if ema_decay is not None:
        ema = {rec.fqn: rec.master.detach().clone() for rec in state.records if rec.is_owner}
        sd_ema = _full_sd(model, rank)
    with slow_jobs(delay_s), coalesced_on_gloo() if coalesce else contextlib.nullcontext():
        for step in range(steps):
            idx, y = models.local_batch(step, rank, world_size)
            if readers and step > 0:  # right after step(), then once nothing is pending
                with torch.no_grad():
                    first = models.loss_fn(model, idx, y).item()
                    model._dmuon_state.pending.wait_all()
                    eval_losses.append((first, models.loss_fn(model, idx, y).item()))
            chunks = list(zip(idx.chunk(micro_batches), y.chunk(micro_batches)))
            for i, (ci, cy) in enumerate(chunks):
                with contextlib.nullcontext() if i == len(chunks) - 1 else dmuon.no_sync(model):
                    loss = models.loss_fn(model, ci, cy) / micro_batches
                    (loss if grad_scaler is None else grad_scaler.scale(loss)).backward()
            losses.append(loss.item())
            if grad_scale is not None:
                time.sleep(pause_s)
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.data.mul_(grad_scale)
            if grad_scaler is not None:
                grad_scaler.unscale_(opt)
            if clip is not None:
                norms.append(float(dmuon.clip_grad_norm_(model, clip)))
            if sched is not None and step > 0 and not sched_after_step:
                sched.step()
            if grad_scaler is not None:
                grad_scaler.step(opt)
                grad_scaler.update()
            else:
                opt.step()
            if sched is not None and sched_after_step:
                sched.step()
            if ema_decay is not None:
                opt.wait_pending()
                for rec in state.records:
                    if rec.is_owner:
                        ema[rec.fqn].lerp_(rec.master.detach(), 1 - ema_decay)
                for name, value in _full_sd(model, rank).items():
                    sd_ema[name].lerp_(value, 1 - ema_decay)
            opt.zero_grad()
        sd_params = None
        if readers:  # right after the last step, with its updates still pending
            sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            sd_params = {k: v.detach().numpy().copy() for k, v in sd.items()} if rank == 0 else None
    return dict(params=full_params(model, rank), losses=losses, eval_losses=eval_losses, norms=norms,
                stats=opt.overlap_stats(), sd_params=sd_params,
                started_early=model._dmuon_state.pending.started_early,
                ema={k: v.numpy() for k, v in ema.items()}, sd_ema={k: v.numpy() for k, v in sd_ema.items()})


def _full_sd(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """torch's full model state dict on rank 0 (``{}`` elsewhere), as a logger reads it."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in sd.items()} if rank == 0 else {}


def resume(rank: int, world_size: int, *, overlap: str, path: str, first: int = 2, then: int = 2) -> dict:
    """Train ``first`` steps and ``dcp.save`` torch's state dict right after the last of them
    (its updates pending), train ``then`` more; then a fresh model and optimizer load the
    checkpoint and train the same ``then`` steps. Returns both final weights (rank 0)."""

    def run(model, opt, steps) -> None:
        for step in steps:
            idx, y = models.local_batch(step, rank, world_size)
            models.loss_fn(model, idx, y).backward()
            opt.step()
            opt.zero_grad()

    with slow_jobs():
        model, _ = build(world_size, "fsdp")
        opt = dmuon.Muon(model, **OPT, overlap=overlap)
        run(model, opt, range(first))
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        run(model, opt, range(first, first + then))
        straight = full_params(model, rank)
        model2, _ = build(world_size, "fsdp")
        opt2 = dmuon.Muon(model2, **OPT, overlap=overlap)
        msd2, osd2 = get_state_dict(model2, opt2)
        sd2 = {"model": msd2, "optim": osd2}
        dcp.load(sd2, checkpoint_id=path)
        set_state_dict(model2, opt2, model_state_dict=sd2["model"], optim_state_dict=sd2["optim"])
        run(model2, opt2, range(first, first + then))
    return dict(straight=straight, resumed=full_params(model2, rank))


def failing_job(rank: int, world_size: int) -> str:
    """A job that raises on the worker thread: the error the main thread sees (``""``: none)."""
    model, _ = build(world_size, "fsdp")
    opt = dmuon.Muon(model, **OPT, overlap="forward")
    idx, y = models.local_batch(0, rank, world_size)
    models.loss_fn(model, idx, y).backward()
    try:
        with slow_jobs(fail=True):
            opt.step()
            models.loss_fn(model, idx, y)
            opt.step()
    except RuntimeError as exc:
        return str(exc)
    return ""


def direct_read(rank: int, world_size: int) -> dict[str, bool]:
    """Read this rank's masters (``model.parameters()`` outside forward) right after
    ``step()``: once as is (the control: the slowed updates are pending, so the tensors must
    still differ from their final values), once after ``opt.wait_pending()`` (they must equal
    them). Returns, per rank, whether updates were pending and what each read matched."""
    model, _ = build(world_size, "fsdp")
    opt = dmuon.Muon(model, **OPT, overlap="forward")
    state = model._dmuon_state
    owned = [rec for rec in state.records if rec.is_owner]
    with slow_jobs(delay_s=0.2):
        for step in range(2):
            idx, y = models.local_batch(step, rank, world_size)
            models.loss_fn(model, idx, y).backward()
            opt.step()
            pending = bool(state.pending.jobs)
            raw = [rec.master.detach().clone() for rec in owned]  # no wait: mid-update
            opt.wait_pending()
            waited = [rec.master.detach().clone() for rec in owned]
            left = bool(state.pending.jobs)
            state.pending.wait_all()
            final = [rec.master.detach().clone() for rec in owned]
            opt.zero_grad()
    return dict(owns=bool(owned), pending=pending, left=left,
                raw_equal=all(torch.equal(a, b) for a, b in zip(raw, final)),
                waited_equal=all(torch.equal(a, b) for a, b in zip(waited, final)))


def failing_rank(rank: int, world_size: int, *, victim: int = 1, at: int = 1, steps: int = 3,
                 mode: str = "fsdp") -> dict[str, Any]:
    """Train ``steps`` steps with ``overlap="forward"``; from step ``at`` on, every job of rank
    ``victim`` raises on its worker thread. Returns the error each rank raised (first line),
    in which step, and the seconds from the start of that step to the error."""
    model, _ = build(world_size, mode)
    opt = dmuon.Muon(model, **OPT, overlap="forward")
    error, after, failed_in = None, None, None
    start = time.monotonic()
    step = 0
    try:
        for step in range(steps):
            start = time.monotonic()
            idx, y = models.local_batch(step, rank, world_size)
            models.loss_fn(model, idx, y).backward()
            with slow_jobs(delay_s=0.01, fail=rank == victim and step >= at):
                opt.step()
            opt.zero_grad()
    except RuntimeError as err:
        error, after, failed_in = str(err).splitlines()[0], time.monotonic() - start, step
    return dict(error=error, after_s=after, step=failed_in)


def unit_timeline(rank: int, world_size: int, *, slow_s: float = 0.4, steps: int = 3) -> dict[str, Any]:
    """``overlap="forward"`` on the FSDP2 test model, with the jobs of ``blocks.1``'s matrices
    (unit 1) slowed by ``slow_s`` and every other job not slowed. Per step after the first:
    how long ``opt.step()`` took, when block 0's forward ended and when this rank's unit-1 job
    ended (``None`` on a rank that owns nothing in block 1), in seconds from the step's start."""
    model, _ = build(world_size, "fsdp")
    opt = dmuon.Muon(model, **OPT, overlap="forward")
    marks: dict[str, float] = {}
    model.blocks[0].register_forward_hook(lambda *a: marks.__setitem__("block0_end", time.monotonic()))
    rows = []
    with slow_jobs(slow_s, only="blocks.1.", ended=marks):
        for step in range(steps):
            idx, y = models.local_batch(step, rank, world_size)
            models.loss_fn(model, idx, y).backward()
            marks.clear()
            start = time.monotonic()
            opt.step()
            step_s = time.monotonic() - start
            opt.zero_grad()
            models.loss_fn(model, idx, y)  # the next forward (its graph is dropped)
            model._dmuon_state.pending.wait_all()
            if step > 0:
                rows.append(dict(step_s=step_s, block0_end=marks["block0_end"] - start,
                                 job1_end=marks["blocks.1."] - start if "blocks.1." in marks else None))
    return dict(rows=rows)


def forward_order(rank: int, world_size: int, *, overlap: str = "forward", steps: int = 3) -> dict[str, Any]:
    """Train the "reversed" test model (its blocks run last to first) with FSDP2: the units'
    module names before the first step and after it, the order the forward ran the blocks
    in (forward pre-hooks of the test's own), and the final weights."""
    model, _ = build(world_size, "fsdp", variant="reversed")
    opt = dmuon.Muon(model, **OPT, overlap=overlap)
    state = model._dmuon_state
    names = {m: n for n, m in model.named_modules()}
    ran: list[str] = []
    handles = [block.register_forward_pre_hook(lambda m, a: ran.append(names[m])) for block in model.blocks]
    before = [names[u.module] for u in state.units]
    with slow_jobs():
        for step in range(steps):
            idx, y = models.local_batch(step, rank, world_size)
            models.loss_fn(model, idx, y).backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                for h in handles:
                    h.remove()
    return dict(before=before, after=[names[u.module] for u in state.units], ran=ran,
                params=full_params(model, rank))


def clip_then_step(rank: int, world_size: int, *, slow_s: float = 0.5, steps: int = 3,
                   clip: float = 0.05) -> dict[str, Any]:
    """``overlap="backward"``, every speculative job slowed by ``slow_s`` and a clip that binds
    every step: the seconds ``dmuon.clip_grad_norm_`` + ``opt.step()`` take after backward
    (neither may wait for the speculations the clip makes useless), and the final weights."""
    model, _ = build(world_size, "fsdp")
    opt = dmuon.Muon(model, **OPT, overlap="backward")
    took = []
    with slow_jobs(slow_s, only="the speculative"):
        for step in range(steps):
            idx, y = models.local_batch(step, rank, world_size)
            models.loss_fn(model, idx, y).backward()
            start = time.monotonic()
            dmuon.clip_grad_norm_(model, clip)
            opt.step()
            took.append(time.monotonic() - start)
            opt.zero_grad()
    return dict(took=took, stats=opt.overlap_stats(), params=full_params(model, rank))
