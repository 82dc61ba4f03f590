"""Rank functions for the failure-contract tests (``tests/test_failure.py``, issue 15)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import dmuon
from tests import models
from tests.dist_cases import build

_EXACT = dict(lr=0.02, adamw_lr=0.01, ns_method="standard", ns_dtype=torch.float32,
              ns_coefficients="muon")


def desync(rank: int, world_size: int, *, fault: str, victim: int, mode: str = "fsdp",
           steps: int = 3, at: int = 1) -> dict:
    """Train ``steps`` steps; in step ``at`` the victim skips ``opt.step()`` (``"skip_step"``)
    or ``backward()`` (``"skip_backward"``), or it runs one step more than the others
    (``"extra_step"``: the others then wait on the store until the victim has failed, so
    they stay alive and the victim's wait ends by the timeout, not by a closed connection).

    Returns:
        ``{"error": first line or None, "type": exception type, "after_s": seconds from the
        faulty step's start to the error, "step": the step that raised}``.
    """
    model, _ = build(world_size, mode)
    opt = dmuon.Muon(model, **_EXACT)
    store = dist.distributed_c10d._get_default_store()
    error, kind, after, failed_in = None, None, None, None
    my_steps = steps + (1 if fault == "extra_step" and rank == victim else 0)
    start = time.monotonic()
    step = 0
    try:
        for step in range(my_steps):
            if step == (steps if fault == "extra_step" else at):
                start = time.monotonic()
            faulty = rank == victim and step == at
            idx, y = models.local_batch(step, rank, world_size)
            loss = models.loss_fn(model, idx, y)
            if not (faulty and fault == "skip_backward"):
                loss.backward()
            if not (faulty and fault == "skip_step"):
                opt.step()
            opt.zero_grad()
    except Exception as err:  # noqa: BLE001 - the test reads the type and message
        error, kind, after, failed_in = str(err).splitlines()[0], type(err).__name__, time.monotonic() - start, step
    if fault == "extra_step":
        if rank == victim:
            store.set("victim_done", "1")
        else:
            store.wait(["victim_done"], timedelta(seconds=120))
    return dict(error=error, type=kind, after_s=after, step=failed_in)


def no_desync_counts(rank: int, world_size: int, *, mode: str = "fsdp", steps: int = 3) -> dict:
    """A clean run: the step check issues one collective per forward and one per backward."""
    model, _ = build(world_size, mode)
    opt = dmuon.Muon(model, **_EXACT)
    for step in range(steps):
        idx, y = models.local_batch(step, rank, world_size)
        models.loss_fn(model, idx, y).backward()
        opt.step()
        opt.zero_grad()
    check = model._dmuon_state.step_check
    return dict(checks=check.checks, steps=check.steps, backwards=check.backwards)


def group_timeouts(rank: int, world_size: int, *, mesh_shape: tuple = (2,), names=None) -> dict:
    """The timeout of every group dmuon created, and of the default group, in seconds."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.hooks.mesh import group_timeout

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = models.make_model()
    dmuon.dedicate_params(model, mesh, group_cost=0.0)
    roles = model._dmuon_state.roles
    groups = dict(shard=roles.shard, world=roles.world, replicate=roles.replicate, tp=roles.tp,
                  steps=roles.steps)
    return dict(default=group_timeout().total_seconds(),
                dmuon={k: group_timeout(g).total_seconds() for k, g in groups.items() if g is not None})
