"""Rank functions for the failure-contract tests (``tests/test_failure.py``, issue 15)."""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Iterator
from unittest import mock

import torch
import torch.distributed as dist

import dmuon
from tests import models
from tests.dist_cases import build

_EXACT = dict(lr=0.02, adamw_lr=0.01, ns_method="standard", ns_dtype=torch.float32,
              ns_coefficients="muon")


def desync(rank: int, world_size: int, *, fault: str, victim: int, mode: str = "fsdp",
           steps: int = 3, at: int = 1, step_check: bool = True) -> dict:
    """Train ``steps`` steps; in step ``at`` the victim skips ``opt.step()`` (``"skip_step"``)
    or ``backward()`` (``"skip_backward"``), or it runs one step more than the others
    (``"extra_step"``: the others then wait on the store until the victim has failed, so
    they stay alive and the victim's wait ends by the timeout, not by a closed connection).

    ``step_check=False``: without the step check, so the wait that times out is a publication's
    or a reduce's (:class:`dmuon.comm.collectives.Pending`).

    Returns:
        ``{"error": first line or None, "type": exception type, "after_s": seconds from the
        faulty step's start to the error, "step": the step that raised}``.
    """
    model, _ = build(world_size, mode, step_check=step_check)
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


@contextlib.contextmanager
def count_step_checks() -> Iterator[list[int]]:
    """Count the step check's all-reduces (each runs under the ``dmuon::step_check`` label)
    while the block runs: ``[count]``."""
    from dmuon.hooks import step_check

    count = [0]
    original = step_check.label

    def label(name: str):
        count[0] += name == "dmuon::step_check"
        return original(name)

    with mock.patch.object(step_check, "label", label):
        yield count


def no_desync_counts(rank: int, world_size: int, *, mode: str = "fsdp", steps: int = 3,
                     step_check: bool = True) -> dict:
    """A clean run: the step check issues one collective per forward and one per backward
    (none with ``dedicate_params(step_check=False)``)."""
    model, _ = build(world_size, mode, step_check=step_check)
    opt = dmuon.Muon(model, **_EXACT)
    with count_step_checks() as checks:
        for step in range(steps):
            idx, y = models.local_batch(step, rank, world_size)
            models.loss_fn(model, idx, y).backward()
            opt.step()
            opt.zero_grad()
    check = model._dmuon_state.step_check
    return dict(checks=checks[0], steps=check.steps, backwards=check.backwards,
                gloo_group=model._dmuon_state.roles.steps is not None)


def check_order(rank: int, world_size: int, *, mode: str = "fsdp") -> list[str]:
    """The order in which the second forward (after a step) settles dmuon's step check and
    runs FSDP2's root pre-forward (its all-gather), read from a profile of that forward.

    Returns:
        The first ``dmuon::step_check_wait`` and ``FSDP::root_pre_forward`` ranges in start
        order (each once).
    """
    from torch.profiler import ProfilerActivity, profile

    model, _ = build(world_size, mode)
    opt = dmuon.Muon(model, **_EXACT)
    names = ("dmuon::step_check_wait", "FSDP::root_pre_forward")
    order: list[str] = []
    for step in range(2):
        idx, y = models.local_batch(step, rank, world_size)
        if step == 1:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = model(idx)
            for event in sorted(prof.events(), key=lambda e: e.time_range.start):
                if event.name in names and event.name not in order:
                    order.append(event.name)
            loss = ((out - y) ** 2).mean()
        else:
            loss = models.loss_fn(model, idx, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return order


def group_timeouts(rank: int, world_size: int, *, mesh_shape: tuple = (2,), names=None) -> dict:
    """The timeout of every group dmuon created, and of the default group, in seconds."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.comm.mesh_roles import group_timeout

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = models.make_model()
    dmuon.dedicate_params(model, mesh, group_cost=0.0)
    roles = model._dmuon_state.roles
    groups = dict(shard=roles.shard, world=roles.world, replicate=roles.replicate, tp=roles.tp,
                  steps=roles.steps)
    return dict(default=group_timeout().total_seconds(),
                dmuon={k: group_timeout(g).total_seconds() for k, g in groups.items() if g is not None})


# ----------------------------------------------------------------------------- all-or-nothing loads
def _job(world_size: int, variant: str = "", reshape: bool = False):
    """The test model on 1-D FSDP2 with dmuon (fp32 exact mode) and a StepLR. ``reshape``:
    ``blocks.0`` gets a hidden width of 9 instead of 7 (a checkpoint of the plain model does not
    fit it)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = models.make_model(variant=variant)
    if reshape:
        model.blocks[0].fc1 = nn.Linear(models.WIDTH, 9)
        model.blocks[0].fc2 = nn.Linear(9, models.WIDTH, bias=False)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dmuon.dedicate_params(model, mesh, group_cost=0.0)
    opt = dmuon.Muon(model, **_EXACT)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)


def _train(model, opt, sched, steps, rank: int, world_size: int) -> None:
    for step in steps:
        idx, y = models.local_batch(step, rank, world_size)
        models.loss_fn(model, idx, y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def snapshot(model, opt, sched=None) -> dict:
    """Bytes of every tensor this rank holds for training (parameters as the model lists them,
    dedicated masters, owners' compute copies, optimizer state) and the hyper-parameters."""
    def raw(t: torch.Tensor) -> bytes:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.detach().contiguous().numpy().tobytes()

    out = {f"param {n}": raw(p) for n, p in model.named_parameters()}
    for rec in model._dmuon_state.records:
        out[f"master {rec.fqn}"] = raw(rec.master)
        if rec.is_owner:
            out[f"compute {rec.fqn}"] = raw(rec.buffer)
    names = {id(p): n for n, p in model.named_parameters()}
    names.update({id(rec.master): rec.fqn for rec in model._dmuon_state.records})
    for p, state in opt.state.items():
        for key, value in state.items():
            out[f"opt {names[id(p)]}/{key}"] = raw(value)
    out["groups"] = repr([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    if sched is not None:
        out["sched"] = repr(sched.state_dict())
    return out


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0]}"


def failed_load(rank: int, world_size: int, *, path: str, fault: str) -> dict:
    """Train 2 steps, save, train 1 more; break the checkpoint (``fault``), call
    :func:`dmuon.load` (or ``load_state_dict`` for the in-memory cases), and report the error
    and which tensors changed (bitwise) on this rank.

    ``fault``: ``"missing_file"`` (a ``.distcp`` data file deleted), ``"corrupt_metadata"``
    (``.metadata`` overwritten), ``"missing_key"`` (loaded into a model with one more matrix),
    ``"wrong_shape"`` (into a model whose ``blocks.0`` is wider), ``"sd_wrong_shape"``
    (``load_state_dict`` with one tensor of the wrong shape on the last rank only),
    ``"sd_wrong_dtype"`` (one float64 tensor on rank 0 only; both: an owned master), ``"none"`` (no fault: the load
    must restore the saved state).
    """
    import torch.distributed.checkpoint as dcp

    model, opt, sched = _job(world_size)
    _train(model, opt, sched, range(2), rank, world_size)
    saved = snapshot(model, opt, sched)
    dcp.save({**dmuon.state_dict(model, opt), "sched": sched.state_dict()}, checkpoint_id=path)
    dist.barrier()
    if rank == 0 and fault == "missing_file":
        import os
        os.remove(os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[-1]))
    if rank == 0 and fault == "corrupt_metadata":
        with open(f"{path}/.metadata", "wb") as f:
            f.write(b"\x80\x04not a pickle")
    dist.barrier()
    if fault in ("missing_key", "wrong_shape"):
        model, opt, sched = _job(world_size, variant="unused" if fault == "missing_key" else "",
                                 reshape=fault == "wrong_shape")
    _train(model, opt, sched, range(2, 3), rank, world_size)
    before = snapshot(model, opt, sched)
    error = None
    try:
        if fault.startswith("sd_"):
            sd = dmuon.state_dict(model, opt)
            sd = {"model": {k: v.detach().clone() + 1 for k, v in sd["model"].items()},
                  "optim": {"state": {k: {n: v.clone() + 1 for n, v in e.items()}
                                      for k, e in sd["optim"]["state"].items()},
                            "param_groups": sd["optim"]["param_groups"]}}
            owned = [k for k in sd["model"] if k in model._dmuon_state.plan.owner_by_fqn]
            name = owned[0]  # a master this rank owns (plain fp32 [rows, cols])
            if fault == "sd_wrong_shape" and rank == world_size - 1:
                sd["model"][name] = torch.zeros(3, 3)
            if fault == "sd_wrong_dtype" and rank == 0:
                sd["model"][name] = sd["model"][name].to(torch.float64)
            dmuon.load_state_dict(model, opt, sd)
        else:
            extra = dmuon.load(model, opt, path, extra={"sched": sched.state_dict()})
            sched.load_state_dict(extra["sched"])
    except Exception as err:  # noqa: BLE001 - the test reads type and message
        error = _error(err)
    after = snapshot(model, opt, sched)
    return dict(error=error, changed=sorted(k for k in before if before[k] != after[k]),
                differs_from_saved=sorted(k for k in saved if saved.get(k) != after.get(k)),
                tensors=len(before))


# ----------------------------------------------------------------------------- clear errors
def bad_call(rank: int, world_size: int, *, case: str) -> str:
    """Run a misuse of ``dedicate_params``; return ``"<ExceptionType>: <message>"``."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    model = models.make_model()
    try:
        if case == "process-group-mesh":
            dmuon.dedicate_params(model, dist.group.WORLD)
        elif case == "list-model":
            dmuon.dedicate_params(list(model.parameters()), init_device_mesh("cpu", (world_size,)))
        elif case == "partial-mesh":
            dmuon.dedicate_params(model, DeviceMesh("cpu", list(range(world_size - 1))))
        else:
            raise KeyError(case)
    except Exception as err:  # noqa: BLE001 - the test reads type and message
        return f"{type(err).__name__}: {err}"
    return "no error"


def desync_all(rank: int, world_size: int, *, scenarios: list[tuple[str, str]]) -> list[dict]:
    """:func:`desync` for each ``(fault, mode)`` in turn, in one world (each builds its own
    model and dmuon groups; the check fails before a collective could pair with a different
    one, so the default group stays usable)."""
    return [desync(rank, world_size, fault=fault, victim=1, mode=mode) for fault, mode in scenarios]
