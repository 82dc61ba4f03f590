"""Rank functions for the checkpoint, fault and fuzz tests (run through ``tests/_pool.py``).

Batches: every step has one *global* batch of ``GLOBAL_RANKS * LOCAL_BATCH`` sequences
(:func:`tests.models.global_batch` of a 4-rank world) split evenly over however many
data-parallel ranks run, so a job restored on 2 ranks (or on a 2x2 FSDP x TP mesh, whose two TP
ranks share a slice) trains on exactly the data the 4-rank job would have seen.

Checkpoint jobs run in one of the ``MODES``: ``"fsdp"`` and ``"replicated"`` on a 1-D mesh
(:func:`tests.dist_cases.build`), ``"hsdp"`` and ``"fsdp-tp"`` on a 2x2 mesh
(:func:`tests.mesh_cases.build`; run those in a fresh pool world), and ``"hsdp-2x1"`` /
``"hsdp-1x2"``, HSDP on 2 ranks (2 replicas of 1 rank, or 1 replica of 2 ranks).

``mixed_auto=True`` runs ``replicate_mode="auto"`` with a plan-level cost model
(:class:`dmuon.balance.cost.ReplicaCost`) under which the test model's matrices split
(:func:`tests.mesh_cases.mixed_auto_kwargs`); with the shipped constants every matrix of this tiny model
picks ``"compute"`` and ``"auto"`` is ``"compute"`` under another name.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch import nn

import dmuon
from dmuon import checkpoint
from tests import mesh_cases, models
from tests.dist_cases import build, full_params

GLOBAL_RANKS = 4
MODES = ("fsdp", "replicated", "hsdp", "fsdp-tp", "hsdp-2x1", "hsdp-1x2")
HSDP_2RANK = {"hsdp-2x1": (2, 1), "hsdp-1x2": (1, 2)}  # mode: (replicate, shard)
EXACT = dict(lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
             ns_dtype=torch.float32, ns_coefficients="muon")


def batch(step: int, dp_index: int, dp_count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel replica ``dp_index``'s slice (of ``dp_count``) of step ``step``'s global
    batch: ``[GLOBAL_RANKS * LOCAL_BATCH / dp_count, SEQ]`` token ids and targets."""
    idx, y = models.global_batch(step, GLOBAL_RANKS)
    n = idx.shape[0] // dp_count
    return idx[dp_index * n:(dp_index + 1) * n], y[dp_index * n:(dp_index + 1) * n]


def run_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, dp_index: int,
              dp_count: int, sched=None) -> None:
    for step in steps:
        idx, y = batch(step, dp_index, dp_count)
        models.loss_fn(model, idx, y).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def rotated_plan(world_size: int, shift: int) -> dmuon.OwnerPlan:
    """The default plan of the test model with every owner moved ``shift`` ranks on."""
    model = models.make_model()
    shapes = dict(model.named_parameters())
    plan = dmuon.build_plan([(n, tuple(shapes[n].shape)) for n in models.matrix_names(model)],
                            world_size)
    return dmuon.OwnerPlan(world_size=world_size, matrices=tuple(
        dmuon.MatrixSpec(fqn=m.fqn, shape=m.shape, owner=(m.owner + shift) % world_size)
        for m in plan.matrices))


def _hsdp_2rank(mode: str, **dedicate_kwargs):
    """:func:`tests.mesh_cases.build`'s HSDP on a 2-rank ``("replicate", "shard")`` mesh."""
    mesh = init_device_mesh("cpu", HSDP_2RANK[mode], mesh_dim_names=("replicate", "shard"))
    model = models.make_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dmuon.dedicate_params(model, mesh, group_cost=0.0, **dedicate_kwargs)
    return model, mesh, ("replicate", "shard")


def _job(rank: int, world_size: int, mode: str, shift: int = 0, replicate_mode: str = "auto",
         mixed_auto: bool = False):
    """The test model, a dmuon.Muon (fp32 exact mode) and a StepLR over it, in ``mode``.

    ``mixed_auto``: resolve ``replicate_mode="auto"`` with :func:`tests.mesh_cases.mixed_auto_kwargs`
    (the plan records each matrix's mode).

    Returns:
        ``(model, opt, sched, dp_index, dp_count)``: this rank's data-parallel replica and the
        number of them (the batch is split over replicas; TP ranks of one replica share it).
    """
    if mode not in MODES:
        raise ValueError(f"unknown checkpoint test mode {mode!r}; one of {MODES}")
    plan = rotated_plan(world_size, shift) if shift else None
    if mode in mesh_cases.LAYOUTS or mode in HSDP_2RANK:
        builder = (mesh_cases.build if mode in mesh_cases.LAYOUTS
                   else _hsdp_2rank)
        model, mesh, dp_names = builder(mode, plan=plan, replicate_mode=replicate_mode,
                                        **mesh_cases.mixed_auto_kwargs(mixed_auto))
        dp_index, dp_count = mesh_cases.dp_coordinate(mesh, dp_names)
    else:
        model, _ = build(world_size, mode, plan=plan)
        dp_index, dp_count = rank, world_size
    opt = dmuon.Muon(model, **EXACT)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return model, opt, sched, dp_index, dp_count


class GatedWriter(dcp.FileSystemWriter):
    """A ``FileSystemWriter`` whose ``write_data`` waits (up to 60 s) for ``gate`` to be set."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.gate = threading.Event()

    def write_data(self, plan, planner):
        if not self.gate.wait(timeout=60):
            raise RuntimeError("GatedWriter: the gate was not opened within 60 s")
        return super().write_data(plan, planner)


def train_save_continue(rank: int, world_size: int, *, path: str, first: int, then: int,
                        mode: str = "fsdp", replicate_mode: str = "auto",
                        async_save: bool = False, mixed_auto: bool = False) -> dict:
    """Train ``first`` steps, ``dcp.save`` to ``path``, train ``then`` more.

    With ``async_save``, ``dcp.async_save`` on a gloo group of its own (its background thread
    must not interleave collectives with FSDP2's on the default group); its writes are held
    back (:class:`GatedWriter`) until the ``then`` steps have updated every parameter in
    place, so the checkpoint is right only if ``async_save`` staged a copy.

    Returns:
        On rank 0: ``saved`` (full params at save time) and ``final`` (after all steps); on
        every rank ``modes`` (:func:`replicate_modes`).
    """
    model, opt, sched, dp_index, dp_count = _job(rank, world_size, mode, replicate_mode=replicate_mode,
                                                 mixed_auto=mixed_auto)
    ckpt_group = dist.new_group(backend="gloo") if async_save else None
    run_steps(model, opt, range(first), dp_index, dp_count, sched)
    saved = full_params(model, rank)
    sd = checkpoint.state_dict(model, opt)
    sd["sched"] = sched.state_dict()
    if async_save:
        writer = GatedWriter(path)
        future = dcp.async_save(sd, storage_writer=writer, process_group=ckpt_group)
    else:
        dcp.save(sd, checkpoint_id=path)
    run_steps(model, opt, range(first, first + then), dp_index, dp_count, sched)
    if async_save:
        writer.gate.set()
        future.result(timeout=60)
    return dict(saved=saved, final=full_params(model, rank), modes=replicate_modes(model))


def default_ns_dtype_round_trip(rank: int, world_size: int) -> dict:
    """dmuon.Muon with its default ``ns_dtype=None`` (by device): 2 steps,
    ``opt.load_state_dict(opt.state_dict())``, 2 more; and the same 4 steps without the round
    trip (a fresh model). On main the step after the load raised ``KeyError: 'ns_dtype'``.

    Returns:
        ``ns_dtype`` of each group after the load (``"absent"`` where the key is gone), the
        error of the step after it (``""`` if none), and on rank 0 both runs' final weights.
    """
    kwargs = dict(lr=0.02, adamw_lr=0.01)
    finals, error, after = [], "", []
    for round_trip in (True, False):
        model, _ = build(world_size, "fsdp")
        opt = dmuon.Muon(model, **kwargs)
        run_steps(model, opt, range(2), rank, world_size)
        if round_trip:
            opt.load_state_dict(opt.state_dict())
            after = [repr(g.get("ns_dtype", "absent")) for g in opt.param_groups
                     if g.get("kind") == "muon"]
        try:
            run_steps(model, opt, range(2, 4), rank, world_size)
        except KeyError as e:
            error = f"KeyError: {e}"
            return dict(ns_dtype_after_load=after, error=error, final=[])
        finals.append(full_params(model, rank))
    return dict(ns_dtype_after_load=after, error=error, final=finals)


def replicate_modes(model: nn.Module) -> dict[str, str]:
    """``{fqn: "compute" | "broadcast"}``: the HSDP mode each dedicated matrix runs in."""
    return {rec.fqn: rec.replicate_mode for rec in model._dmuon_state.records}


def load_continue(rank: int, world_size: int, *, path: str, first: int, then: int,
                  mode: str = "fsdp", shift: int = 0, replicate_mode: str = "auto",
                  mixed_auto: bool = False) -> dict:
    """A fresh job on ``world_size`` ranks: load ``path``, train steps ``first..first+then``.

    ``shift`` moves every owner of the default plan that many ranks on (another owner plan on
    the same world size).

    Returns:
        On rank 0: ``loaded`` (full params right after loading) and ``final``; on every rank
        ``owned`` (the dedicated FQNs this rank owns in the new plan), ``modes``
        (:func:`replicate_modes`) and ``replica_loaded`` / ``replica_final``
        (:func:`replica_state` right after loading / at the end).
    """
    model, opt, sched, dp_index, dp_count = _job(rank, world_size, mode, shift, replicate_mode,
                                                 mixed_auto)
    sd = checkpoint.state_dict(model, opt)
    sd["sched"] = sched.state_dict()
    dcp.load(sd, checkpoint_id=path)
    checkpoint.load_state_dict(model, opt, sd)
    sched.load_state_dict(sd["sched"])
    loaded = full_params(model, rank)
    replica_loaded = replica_state(model, opt)
    run_steps(model, opt, range(first, first + then), dp_index, dp_count, sched)
    owned = sorted(r.fqn for r in model._dmuon_state.records if r.is_owner)
    return dict(loaded=loaded, final=full_params(model, rank), owned=owned,
                modes=replicate_modes(model), replica_loaded=replica_loaded, replica_final=replica_state(model, opt))


def replica_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """This rank's own copy of the state every HSDP replica holds (``full_params`` reads
    replica 0's only). Collective: every rank must call it.

    Returns:
        ``replicate_rank``, ``tp_rank``; ``masters`` ``{fqn: [rows, cols] or TP slice}`` fp32
        of the matrices this rank owns; ``momentum`` of those it owns in ``"compute"`` mode
        (in ``"broadcast"`` mode only replica 0 steps; the others' buffers stay zero);
        ``dense`` ``{fqn: full value}`` of every other parameter as this rank's replica sees it.
    """
    state = model._dmuon_state
    owned = [rec for rec in state.records if rec.is_owner]
    masters = {rec.fqn: rec.master.detach().numpy().copy() for rec in owned}
    momentum = {rec.fqn: opt.state[rec.master]["momentum_buffer"].numpy().copy()
                for rec in owned if rec.replicate_mode == "compute"
                and "momentum_buffer" in opt.state.get(rec.master, {})}
    dense = {}
    for name, p in model.named_parameters():
        if name not in state.plan.owner_by_fqn:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            dense[name] = t.detach().numpy().copy()
    return dict(replicate_rank=state.replicate_rank, tp_rank=state.tp_rank, masters=masters,
                momentum=momentum, dense=dense)


def load_incomplete(rank: int, world_size: int) -> str:
    """``load_state_dict`` with the optimizer state removed; returns the error text."""
    model, opt, *_ = _job(rank, world_size, "fsdp")
    sd = checkpoint.state_dict(model, opt)
    sd["optim"]["state"] = {}
    try:
        checkpoint.load_state_dict(model, opt, sd)
    except Exception as e:  # noqa: BLE001 - the test inspects type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


# ----------------------------------------------------------------------------- faults
def _install_kill(model: nn.Module, opt: torch.optim.Optimizer, phase: str, clock: dict,
                  stamp_path: str) -> None:
    """On this rank, ``os._exit(9)`` at step ``clock['kill']`` inside ``phase``."""

    def die() -> None:
        if clock["step"] == clock["kill"]:
            with open(stamp_path, "w") as f:
                f.write(repr(time.time()))
            os._exit(9)

    if phase == "forward":
        model.blocks[1].register_forward_pre_hook(lambda module, args: die())
    elif phase == "backward":
        model.blocks[1].register_full_backward_pre_hook(lambda module, grad: die())
    elif phase == "step":  # after the Muon group's update, before AdamW's
        step_adamw = opt.strategy.step_adamw
        opt.strategy.step_adamw = lambda group: (die(), step_adamw(group))
    else:
        raise KeyError(phase)


def killed_mid_step(rank: int, world_size: int, *, phase: str, victim: int, path: str,
                    save_after: int = 2, steps: int = 5, interval_s: float = 0.2,
                    timeout_s: float = 2.0, exit_grace_s: float = 3.0) -> dict:
    """Train with a :class:`dmuon.faults.Heartbeat`; checkpoint after ``save_after`` steps;
    rank ``victim`` dies in ``phase`` of the next step.

    Returns:
        Survivors: ``error`` (the text of the error they stopped with, or ``None``) and ``t``
        (``time.time()`` when it was caught). The victim's kill time is in ``path + '.killed'``;
        the full parameters at save time are in ``path + '.npz'``.
    """
    from dmuon.faults import Heartbeat

    model, opt, sched, *_ = _job(rank, world_size, "fsdp")
    hb = Heartbeat(interval_s=interval_s, timeout_s=timeout_s, exit_grace_s=exit_grace_s).start()
    clock = {"step": 0, "kill": save_after}
    if rank == victim:
        _install_kill(model, opt, phase, clock, path + ".killed")
    try:
        for step in range(steps):
            clock["step"] = step
            if step == save_after:
                sd = checkpoint.state_dict(model, opt)
                sd["sched"] = sched.state_dict()
                dcp.save(sd, checkpoint_id=path)
                saved = full_params(model, rank)
                if rank == 0:
                    np.savez(path + ".npz", **saved)
            with hb.guard(f"step {step}"):
                run_steps(model, opt, range(step, step + 1), rank, world_size, sched)
    except RuntimeError as e:
        return dict(error=str(e), t=time.time())
    finally:
        hb.stop()
    return dict(error=None, t=time.time())


def blocked_on_live_peer(rank: int, world_size: int, *, interval_s: float, timeout_s: float,
                         exit_grace_s: float) -> dict:
    """Three ranks: rank 1 dies, rank 2 stays alive outside any collective, rank 0 waits in a
    broadcast from rank 2 that no transport error interrupts. Rank 0 must exit (watchdog);
    rank 2 must raise at its next ``guard``."""
    from dmuon.faults import Heartbeat

    hb = Heartbeat(interval_s=interval_s, timeout_s=timeout_s, exit_grace_s=exit_grace_s).start()
    t0 = time.time()
    if rank == 1:
        os._exit(9)
    if rank == 0:
        dist.broadcast(torch.zeros(4), src=2)  # never completes
        return dict(error="broadcast returned", t=time.time() - t0)
    deadline = t0 + timeout_s + 2 * interval_s + exit_grace_s + 2.0
    while time.time() < deadline:
        try:
            with hb.guard("idle loop"):
                time.sleep(interval_s)
        except RuntimeError as e:
            caught = time.time() - t0
            time.sleep(max(0.0, deadline - time.time()))  # stay alive: rank 0 must not be freed
            return dict(error=str(e), t=caught)
    return dict(error=None, t=time.time() - t0)


def heartbeat_no_fault(rank: int, world_size: int, *, steps: int = 3) -> dict:
    """Train a few steps under a guard with a short timeout; nobody may be named lost."""
    from dmuon.faults import Heartbeat

    model, opt, sched, *_ = _job(rank, world_size, "fsdp")
    with Heartbeat(interval_s=0.1, timeout_s=1.0, exit_grace_s=None) as hb:
        if steps == 0:
            return dict(lost=[], params={})
        for step in range(steps):
            with hb.guard(f"step {step}"):
                run_steps(model, opt, range(step, step + 1), rank, world_size, sched)
        time.sleep(0.5)
        lost = hb.lost
        try:  # an error that is not a lost peer passes through unchanged
            with hb.guard("a failing block"):
                raise RuntimeError("not a fault")
        except RuntimeError as e:
            passed_through = str(e)
    return dict(lost=lost, params=full_params(model, rank), passed_through=passed_through)


def heartbeat_bad_args(rank: int, world_size: int) -> str:
    from dmuon.faults import Heartbeat

    try:
        Heartbeat(interval_s=1.0, timeout_s=0.5)
    except Exception as e:  # noqa: BLE001 - the test inspects type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


# ----------------------------------------------------------------------------- fuzz
class FuzzNet(nn.Module):
    """LayerNorm, then Linear layers ``widths[0] -> widths[1] -> ...`` with tanh between.

    A width of 1 makes ``[1, N]`` and ``[N, 1]`` matrices; the LayerNorm and the biases go to
    AdamW. Each Linear is its own FSDP2 unit in ``"fsdp"`` mode.
    """

    def __init__(self, widths: list[int], biases: list[bool]) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(widths[0])
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias)
                                    for a, b, bias in zip(widths[:-1], widths[1:], biases))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln(x)
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(torch.tanh(x))
        return x.sum(dim=-1)


def fuzz_model(widths: list[int], biases: list[bool], seed: int) -> FuzzNet:
    torch.manual_seed(seed)
    return FuzzNet(widths, biases)


def fuzz_batch(step: int, seed: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``rows`` inputs ``[rows, width]`` and targets ``[rows]``."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(rows, width, generator=g), torch.randn(rows, generator=g)


def fuzz_reference(widths: list[int], biases: list[bool], seed: int, steps: int,
                   rows: int) -> dict[str, torch.Tensor]:
    """Single-process ``torch.optim.Muon`` (fp32 iteration) + ``AdamW`` on the global batch."""
    model = fuzz_model(widths, biases, seed)
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    muon = torch.optim.Muon(mats, lr=0.02, weight_decay=0.1, ns_coefficients=models.MUON_COEFFICIENTS)
    adamw = torch.optim.AdamW(rest, lr=0.01, weight_decay=0.1)
    with models.reference_ns(torch.float32):
        for step in range(steps):
            x, y = fuzz_batch(step, seed, rows, widths[0])
            ((model(x) - y) ** 2).mean().backward()
            for opt in (muon, adamw):
                opt.step()
                opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def fuzz_train(rank: int, world_size: int, *, widths: list[int], biases: list[bool],
               owners: list[int], seed: int, steps: int, rows: int, mode: str) -> dict:
    """dmuon on this world with the owners given per Linear layer; full params on rank 0."""
    model = fuzz_model(widths, biases, seed)
    mesh = init_device_mesh("cpu", (world_size,))
    if mode == "fsdp":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    specs = tuple(dmuon.MatrixSpec(fqn=f"layers.{i}.weight", shape=(b, a), owner=o)
                  for i, (a, b, o) in enumerate(zip(widths[:-1], widths[1:], owners)))
    dmuon.dedicate_params(model, mesh, plan=dmuon.OwnerPlan(world_size=world_size, matrices=specs))
    opt = dmuon.Muon(model, **EXACT)
    n = rows // world_size
    for step in range(steps):
        x, y = fuzz_batch(step, seed, rows, widths[0])
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return full_params(model, rank)
