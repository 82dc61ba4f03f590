"""Sharded checkpoints of a dmuon model and optimizer with ``torch.distributed.checkpoint``.

:func:`state_dict` returns a nested dict that ``dcp.save`` writes and ``dcp.load`` fills *in
place*; :func:`load_state_dict` then applies what was loaded (optimizer hyper-parameters, the
owners' compute copies). Nothing is gathered on one rank:

* **FSDP2 parameters** and their AdamW state (``exp_avg``, ``exp_avg_sq``) are DTensors; DCP
  writes each rank's shard and reshards them natively on load (another world size, another
  mesh).
* **Dedicated matrices** (fp32 master) and their Muon ``momentum_buffer`` are plain full
  ``[rows, cols]`` fp32 tensors that appear in the state dict **only on their owner**. DCP plans
  per rank and merges the plans on the coordinator, so a key offered by one rank is written
  once, by that rank. On load, the key is requested only by the matrix's *new* owner (from the
  plan of the loading job), which reads the full tensor straight into its master. Non-owners'
  zero-size placeholders never reach DCP (their ``[0]`` shape would contradict the owner's).
  Presenting the master as a DTensor over the dmuon mesh does not work: DCP computes a shard's
  offset from its placements (even chunks), which cannot describe "all rows on the owner, none
  elsewhere".
* **Expert stacks** (``[E, rows, cols]``, one Muon matrix per expert) enter per expert:
  ``"fqn[e]"`` -> the ``[rows, cols]`` master (and ``momentum_buffer``) of expert ``e``, offered
  by the owner of the range that holds it. The keys do not depend on how the plan cut the stack
  into expert ranges, so a checkpoint loads into any other plan, world size or mesh.
* **Tensor parallelism:** a dedicated matrix split over TP ranks has one master slice per TP
  rank of its owner (``[rows / T, cols]`` or ``[rows, cols / T]``, ``torch.chunk`` sizes). Its
  master and ``momentum_buffer`` enter the state dict as DTensors on the TP mesh with the TP
  placement (``Shard(0)`` / ``Shard(1)``), so DCP records each slice at its offset in the full
  ``[rows, cols]`` matrix and reshards on load (another TP degree, or none). As plain tensors
  the slices would share one key with different shapes: DCP keeps one and the load fails.
* **HSDP:** every replica's owner holds the master; DCP writes one copy. In the ``"broadcast"``
  replicate mode only replica 0 keeps a ``momentum_buffer`` (the others never step the matrix),
  so the buffer is offered by replica 0 only; DCP otherwise picks the least-loaded rank's copy,
  which may be a stale one. Masters are offered by every replica: each loads its own.
* **Replicated tensors** (buffers, parameters of plain replicated modules, AdamW ``step``) are
  plain tensors on every rank; DCP's default planner deduplicates them (one writer).
* **Optimizer hyper-parameters** (``lr``, ``betas``, ``initial_lr`` of LR schedulers, ...) are
  small Python objects saved as DCP byte items, one dict per parameter group kind.

Layout (keys are canonical fully qualified parameter names, ``_checkpoint_wrapped_module.``
and ``_orig_mod.`` stripped as torch's state-dict API strips them, so a checkpoint survives a
change of world size, owner plan, FSDP2 wrapping or activation checkpointing)::

    {"model": {fqn: tensor},                       # masters only on their owner
     "optim": {"state": {fqn: {"momentum_buffer": ...} | {"step", "exp_avg", "exp_avg_sq"}},
               "param_groups": {"muon": {...}, "adamw": {...}}}}

Verified with gloo on CPU in torch 2.13 (``tests/test_checkpoint.py``): a restore on the same
world size or mesh (1-D FSDP2, HSDP 2x2 in both replicate modes, FSDP x TP 2x2) continues
bitwise; a checkpoint restored on another world size or mesh continues within fp32 rounding
(1-D FSDP2 <-> HSDP and FSDP x TP both ways, HSDP "broadcast" <-> "compute", FSDP x TP ->
HSDP, HSDP "auto" with both modes in use -> "compute" and "broadcast" -> "auto", HSDP 2x2 ->
2x1 / 1x2 on 2 ranks and 2x1 -> 2x2; a replica with no saved momentum reads replica 0's).
Save each checkpoint to a new directory: DCP writes ``.metadata`` last, so a directory without
it is an interrupted save and the previous directory stays loadable.

**``dmuon.Muon(params, distributed_config=...)``** (and single-device ``dmuon.Muon(params)``):
the parameters are the user's own (FSDP2/TP DTensors, or plain replicas); the model entries
are its live parameters and persistent buffers (:func:`live_entries`: what ``model.state_dict()``
shows before any state-dict hook rewrites it), and each optimizer state tensor (a local piece, as the
step keeps it) enters as a DTensor with its parameter's mesh and placements, so DCP reshards
it with the parameter. Param groups are saved by index (``"0"``, ``"1"``, ...). Plain sharded
Muon matrices (``create_processgroup_config(fsdp_pg=...)``) cannot be described to DCP
(different local shapes under one key) and raise ``ValueError``; plain non-matrix tensors
are taken for replicas.

torch's own state-dict API (``model.state_dict()``, ``get_state_dict`` / ``set_state_dict``,
full or sharded) works on the same models (:mod:`dmuon.hooks.state_dict`,
:mod:`dmuon.hooks.optim_state`); this module adds checkpoints without a collective or a copy,
the layouts torch's path refuses (TP-split matrices, split or expert-parallel stacks) and the
all-or-nothing :func:`load` (docs/checkpointing.md).

Typical use::

    sd = dmuon.checkpoint.state_dict(model, opt)
    dcp.save(sd, checkpoint_id=f"ckpt/step{step}")
    ...
    sd = dmuon.checkpoint.state_dict(model, opt)   # fresh job, any world size
    dcp.load(sd, checkpoint_id="ckpt/step100")
    dmuon.checkpoint.load_state_dict(model, opt, sd)
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from dmuon.hooks.dedicate import get_state
from dmuon.hooks.state import DedicateState
from dmuon.hooks.state_dict import agree, canonical_fqn
from dmuon.optim import OwnerUpdate, unwrap_optimizer
from dmuon.owners.dedicated import DedicatedParam
from dmuon.owners.slices import local_tensor
from dmuon.owners.update import first_step_state

logger = logging.getLogger(__name__)

MODEL_KEY, OPTIM_KEY = "model", "optim"
UNCHANGED = "Nothing was loaded: the model and optimizer are unchanged on every rank."
_SKIP_GROUP_KEYS = ("params", "kind", "param_names")


def _adamw_params(model: nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """``(fqn, param)`` for every parameter of ``opt``'s AdamW group(s).

    Raises:
        ValueError: if a parameter of the optimizer is not a parameter of ``model``.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for group in opt.param_groups:
        if group.get("kind") != "adamw":
            continue
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"dmuon: an AdamW parameter of shape {tuple(p.shape)} is not in "
                    f"model.named_parameters(); pass the optimizer built over this model"
                )
            out.append((names[id(p)], p))
    return out


def _ensure_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create zero optimizer state where none exists yet, so ``dcp.load`` has tensors to fill.

    Zero state with ``step == 0`` is what the first step creates anyway (see
    :func:`dmuon.owners.update.adamw_update_` and ``OwnerUpdate.step_muon``), so this changes no
    update.
    """
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if not p.requires_grad:  # frozen: the optimizer never creates state for it
                continue
            if group["kind"] != "muon" or p.numel():
                first_step_state(state, p, group["kind"] == "muon")


def _check_optimizer(model: nn.Module, opt: torch.optim.Optimizer) -> DedicateState:
    """The model's dmuon state, after checking that ``opt`` was built over it.

    Raises:
        ValueError: ``dedicate_params`` was not called on ``model``, or ``opt`` is another
            model's optimizer.
    """
    ctx = get_state(model)
    if getattr(opt, "state_ctx", None) is not ctx:
        raise ValueError(
            f"dmuon: the optimizer ({type(opt).__name__}) was not built over this model; "
            f"pass the dmuon.Muon(model, ...) of the same model"
        )
    ctx.settle_pending()  # Muon(overlap=...): no master or momentum with an update pending
    return ctx


def _on_owner_runtime(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` steps a model on the owner runtime (or is not a dmuon.Muon at all:
    the owner path's check then names the mistake)."""
    strategy = getattr(opt, "strategy", None)
    return strategy is None or isinstance(strategy, OwnerUpdate)


def _agreement_group(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    """The process group whose ranks agree on a load (checks ``opt`` against ``model``)."""
    if _on_owner_runtime(opt):
        return _check_optimizer(model, opt).roles.world
    _fqns(model, opt)
    return opt.strategy.group


def _fqns(model: nn.Module, opt: torch.optim.Optimizer) -> dict[int, str]:
    """``{id(param): fqn}`` for every parameter of ``opt`` (``Muon(params, ...)``).

    Raises:
        ValueError: a parameter of ``opt`` that is not in ``model.named_parameters()``.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"dmuon: a parameter of shape {tuple(p.shape)} in param group {gi} of the "
                    f"optimizer is not in model.named_parameters(); pass the model whose "
                    f"parameters the optimizer was built over")
    return names


def _configured_state_dict(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """:func:`state_dict` for ``dmuon.Muon(params, distributed_config=... | None)``.

    Creates missing optimizer state as the first step would (zeros like the local piece,
    ``step`` 0), then offers each state tensor as its parameter is laid out (a DTensor with the
    parameter's mesh, placements, global shape and stride, aliasing the local piece).

    Raises:
        ValueError: see :func:`state_dict`.
    """
    names = _fqns(model, opt)
    strategy = opt.strategy
    layouts = getattr(strategy, "config", None) and strategy.config.state.get("layouts")
    muon_index = 0
    optim_state: dict[str, dict[str, Any]] = {}
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            fqn = names[id(p)]
            if group["use_muon"]:
                if layouts is not None and not hasattr(p, "device_mesh") \
                        and len(layouts[muon_index].representatives()) > 1:
                    raise ValueError(
                        f"dmuon: Muon matrix {fqn!r} is a plain tensor sharded over ranks (local "
                        f"shape {tuple(p.shape)} of {layouts[muon_index].full_shape}); DCP cannot "
                        f"place plain shards. Make the parameters DTensors (fully_shard, "
                        f"distribute_tensor) to checkpoint them.")
                muon_index += 1
            if not p.requires_grad:
                continue
            state = opt.state[p]
            first_step_state(state, local_tensor(p), group["use_muon"])
            optim_state[fqn] = {k: _laid_out_like(p, v) for k, v in state.items()}
    groups = {str(gi): {k: v for k, v in g.items() if k != "params"}
              for gi, g in enumerate(opt.param_groups)}
    return {MODEL_KEY: live_entries(model), OPTIM_KEY: {"state": optim_state, "param_groups": groups}}


def live_entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of ``model`` as a detached alias of the live tensor,
    keyed by its canonical FQN (:func:`canonical_fqn`; tied parameters under each of their
    names), as ``nn.Module.state_dict`` shows them before any state-dict hook runs.

    Not ``model.state_dict()``: a third-party hook may replace entries by new tensors
    (torchtitan's fused-QKV split turns ``wqkv`` into copies ``wq``/``wk``/``wv``), and then
    ``dcp.load`` into the state dict would not write through to the model (a silently
    unchanged weight); and dmuon's own hooks translate dedicated matrices (collective). The
    modules' state-dict *pre*-hooks do run, as in ``state_dict`` (FSDP2's moves its parameters
    to their sharded form; ``_state_dict_pre_hooks`` is the dict ``nn.Module.state_dict`` runs).

    Raises:
        ValueError: a module defines ``get_extra_state`` (not saved here; torch's state-dict
            API saves it).
    """
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        base = prefix + "." if prefix else ""
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            raise ValueError(
                f"dmuon: module {prefix or '<root>'!r} ({type(module).__name__}) has extra state "
                f"(get_extra_state), which dmuon.state_dict does not save. Checkpoint this model "
                f"with torch's API instead: get_state_dict(model, opt) + dcp.save, "
                f"dcp.load + set_state_dict (docs/checkpointing.md).")
        for hook in module._state_dict_pre_hooks.values():
            hook(module, base, False)
        for name, param in module._parameters.items():
            if param is not None:
                out[canonical_fqn(base + name)] = param.detach()
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[canonical_fqn(base + name)] = buf.detach()
    return out


def _laid_out_like(param: torch.Tensor, local: Any) -> Any:
    """``local`` (a state tensor shaped like ``param``'s local piece) as a DTensor aliasing it,
    with ``param``'s mesh, placements, global shape and stride; other values unchanged."""
    if not hasattr(param, "device_mesh") or not isinstance(local, torch.Tensor) \
            or hasattr(local, "device_mesh") or tuple(local.shape) != tuple(param.to_local().shape):
        return local  # a DTensor already: the distributed_config path keeps its state so
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def state_dict(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The model and optimizer state, sharded, keyed by FQN, for ``dcp.save`` / ``dcp.load``.

    Local and cheap (no collective, no copy): the values are the live tensors (detached
    aliases), so ``dcp.load`` into the returned dict writes straight into the model and the
    optimizer. Optimizer state that does not exist yet is created as zeros (what the first
    step would create), so a fresh job can load into it.

    Args:
        model: a model passed to :func:`dmuon.dedicate_params`; or, for a
            ``dmuon.Muon(params, ...)``, the model whose parameters ``params`` are.
        opt: the :class:`dmuon.Muon` built over ``model``.

    Returns:
        ``{"model": {fqn: Tensor | DTensor}, "optim": {"state": {fqn: {name: Tensor}},
        "param_groups": {"muon": {...}, "adamw": {...}}}}``. Dedicated masters
        (``[rows, cols]`` fp32, full) and their ``momentum_buffer`` appear only on their owner
        (a TP-split matrix: a DTensor of global shape ``[rows, cols]`` over this TP rank's
        slice; HSDP "broadcast" matrices: the buffer on replica 0 only); FSDP2 parameters and
        AdamW moments are DTensor shards; the rest is replicated. For ``Muon(params, ...)``:
        see the module docstring (groups keyed ``"0"``, ``"1"``, ...).

    Raises:
        ValueError: if ``dedicate_params`` was not called on ``model``, ``opt`` belongs to
            another model, or (``Muon(params, ...)``) a parameter of ``opt`` is not in
            ``model`` or a Muon matrix is a plain shard.
    """
    opt = unwrap_optimizer(opt)  # Accelerate's AcceleratedOptimizer and the like
    if not _on_owner_runtime(opt):
        return _configured_state_dict(model, opt)
    ctx = _check_optimizer(model, opt)
    ctx.ensure_bound()
    _ensure_optimizer_state(opt)
    dedicated = {canonical_fqn(rec.fqn) for rec in ctx.records}
    model_sd = {fqn: t for fqn, t in live_entries(model).items() if fqn not in dedicated}  # owners: below
    optim_state: dict[str, dict[str, Any]] = {}
    for rec in ctx.records:
        if rec.is_owner:
            for key, master in _owner_entries(rec, rec.master.detach()):
                model_sd[key] = master
            buf = opt.state.get(rec.master, {}).get("momentum_buffer")
            # HSDP "broadcast": replicas other than 0 never step this matrix; their buffer is
            # zeros, and DCP would write it if their plan happened to be the smallest.
            stale = rec.replicate_mode == "broadcast" and ctx.replicate_rank != 0
            if buf is not None and not stale:
                for key, piece in _owner_entries(rec, buf):
                    optim_state[key] = {"momentum_buffer": piece}
    for fqn, param in _adamw_params(model, opt):
        optim_state[canonical_fqn(fqn)] = dict(opt.state[param])
    groups = {g["kind"]: {k: v for k, v in g.items() if k not in _SKIP_GROUP_KEYS}
              for g in opt.param_groups}
    return {MODEL_KEY: model_sd, OPTIM_KEY: {"state": optim_state, "param_groups": groups}}


def _owner_entries(rec: DedicatedParam, local: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The state-dict entries of an owner's master or momentum buffer: ``(key, tensor)``.

    A matrix is one entry under its FQN (a DTensor if TP splits it, :func:`_tp_sharded`). An
    expert range of a stack (``rec.key`` is ``"fqn[start:stop]"``) is one entry per expert,
    ``"fqn[e]"`` -> a ``[rows, cols]`` view for each flattened expert index ``e`` in
    ``start .. stop - 1``: the keys do not depend on how the plan cut the stack into ranges, so
    a checkpoint loads into any other plan, world size or mesh (each new owner asks for the
    experts of its own ranges, and DCP writes them straight into its master).

    Args:
        rec: a dedicated matrix or expert range this rank owns.
        local: its master or momentum buffer, fp32 (``[k, rows, cols]`` for a range); not copied.
    """
    if rec.experts is None:
        return [(canonical_fqn(rec.key), _tp_sharded(rec, local))]
    experts = local.view(-1, *local.shape[-2:])
    fqn = canonical_fqn(rec.fqn)
    return [(f"{fqn}[{rec.experts[0] + i}]", experts[i]) for i in range(experts.shape[0])]


def _tp_sharded(rec: DedicatedParam, local: torch.Tensor) -> torch.Tensor:
    """``local`` as DCP should see it: a DTensor on the TP mesh if TP splits the matrix.

    Args:
        rec: the dedicated matrix (this rank owns it).
        local: its master or momentum buffer on this rank, fp32, ``rec.shape`` (this TP
            rank's slice of ``rec.full_shape``); not copied.

    Returns:
        ``local`` itself when the matrix is not split over TP ranks; otherwise a DTensor
        aliasing it, of global shape ``rec.full_shape`` with placement ``Shard(tp_shard_dim)``
        on the TP mesh the module computes on (DCP derives the slice's offset from it).
    """
    if rec.tp_shard_dim is None:
        return local
    from torch.distributed.tensor import DTensor, Shard

    rows, cols = rec.full_shape
    return DTensor.from_local(local, rec.compute.device_mesh, [Shard(rec.tp_shard_dim)],
                              run_check=False, shape=torch.Size((rows, cols)), stride=(cols, 1))


def _problem(target: torch.Tensor, value: Any, where: str) -> str | None:
    """Why ``value`` cannot be copied into ``target`` (``None``: it can)."""
    if not isinstance(value, torch.Tensor):
        return f"{where} should be a tensor, got {type(value).__name__}"
    if value is target:
        return None
    target_dt, value_dt = hasattr(target, "to_local"), hasattr(value, "to_local")
    if target_dt != value_dt:
        return (f"{where} is a {'DTensor' if value_dt else 'plain tensor'} but the model holds a "
                f"{'DTensor' if target_dt else 'plain tensor'} (build the dict with dmuon.state_dict)")
    if tuple(value.shape) != tuple(target.shape):
        return f"{where} has shape {tuple(value.shape)} but the model expects {tuple(target.shape)}"
    if target_dt and tuple(value.to_local().shape) != tuple(target.to_local().shape):
        return (f"{where} has a local shard of shape {tuple(value.to_local().shape)}, the model's is "
                f"{tuple(target.to_local().shape)} (placements {value.placements} against "
                f"{target.placements})")
    if value.dtype != target.dtype:
        return f"{where} has dtype {value.dtype} but the model holds {target.dtype}"
    return None


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a checked ``value`` (:func:`_problem` is ``None``) into ``target`` in place."""
    if value is target:
        return
    with torch.no_grad():
        if hasattr(target, "to_local"):
            if value.to_local().data_ptr() != target.to_local().data_ptr():
                target.to_local().copy_(value.to_local())
        elif target.data_ptr() != value.data_ptr() or target.numel() == 0:
            target.copy_(value)


def _pairs(expected: dict[str, Any], sd: dict[str, Any]) -> list[tuple[torch.Tensor, Any, str]]:
    """``(live tensor, loaded value, name)`` for every tensor of :func:`state_dict`."""
    pairs = [(t, sd[MODEL_KEY][fqn], f"model entry {fqn!r}") for fqn, t in expected[MODEL_KEY].items()]
    for fqn, entries in expected[OPTIM_KEY]["state"].items():
        for name, t in entries.items():
            pairs.append((t, sd[OPTIM_KEY]["state"][fqn][name], f"optimizer state {fqn!r}/{name}"))
    return pairs


def load_state_dict(model: nn.Module, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Apply a state dict from :func:`state_dict` (typically after ``dcp.load`` filled it).

    All or nothing: every key, tensor type, shape (global and local shard) and dtype is checked
    on every rank, the ranks agree (one ``all_gather_object`` over the mesh), and only then is
    anything written. Tensors that ``dcp.load`` already wrote in place are left alone; others
    are copied in. Then the optimizer's hyper-parameters are set from the saved groups (as
    ``torch.optim.Optimizer.load_state_dict`` does) and the owners refresh their compute copies
    from the loaded masters (the next forward publishes them). Collective over the mesh.

    Note: after an in-place ``dcp.load`` into :func:`state_dict` the live tensors were already
    overwritten by DCP; if that load fails half-way, they stay half-written. Use :func:`load`
    for a load that leaves everything unchanged on failure.

    Args:
        model: the model passed to :func:`dmuon.dedicate_params` in this job.
        opt: its :class:`dmuon.Muon`.
        sd: the dict returned by :func:`state_dict` for this model and optimizer on this rank.

    Raises:
        ValueError: on every rank, if on any rank ``sd`` lacks a key that rank needs or holds a
            tensor of the wrong kind, shape or dtype (a checkpoint of another model); naming the
            ranks and entries. Nothing is written.
    """
    opt = unwrap_optimizer(opt)  # Accelerate's AcceleratedOptimizer and the like
    group = _agreement_group(model, opt)
    problems: list[str] = []
    if not isinstance(sd, dict) or MODEL_KEY not in sd or OPTIM_KEY not in sd:
        problems.append(f"the checkpoint state dict has keys {sorted(sd) if isinstance(sd, dict) else type(sd).__name__}; "
                        f"expected {[MODEL_KEY, OPTIM_KEY]} (build it with dmuon.state_dict)")
    expected = state_dict(model, opt)
    if not problems:
        for section in (MODEL_KEY, OPTIM_KEY):
            missing = _missing(expected[section], sd[section])
            if missing:
                problems.append(f"the checkpoint state dict lacks {section!r} entries {missing[:5]} "
                                f"({len(missing)} in all)")
    if not problems and not isinstance(sd[OPTIM_KEY].get("param_groups"), dict):
        problems.append("the checkpoint state dict's optimizer param_groups are not a dict by kind")
    if not problems and not _on_owner_runtime(opt) and set(sd[OPTIM_KEY]["param_groups"]) != set(
            expected[OPTIM_KEY]["param_groups"]):
        problems.append(f"the checkpoint has param groups {sorted(sd[OPTIM_KEY]['param_groups'])}, "
                        f"the optimizer {sorted(expected[OPTIM_KEY]['param_groups'])}")
    if not problems:
        problems = [p for p in (_problem(t, v, w) for t, v, w in _pairs(expected, sd)) if p]
    agree(problems, group, "the checkpoint state dict does not fit this model", UNCHANGED)
    for target, value, _ in _pairs(expected, sd):
        _copy_into(target, value)
    saved_groups = sd[OPTIM_KEY]["param_groups"]
    for index, group in enumerate(opt.param_groups):
        key = group["kind"] if _on_owner_runtime(opt) else str(index)
        for name, value in saved_groups.get(key, {}).items():
            group[name] = value
    if _on_owner_runtime(opt):
        ctx = get_state(model)
        ctx.publish_after_step(issue=False)
        logger.debug("dmuon: rank %d loaded %d model entries", ctx.rank, len(expected[MODEL_KEY]))


def _first_error(err: BaseException) -> str:
    """``"Type: first line"`` of an error; for DCP's ``CheckpointException`` (which gathers
    every rank's failure) the failure of this rank, else of the first rank that failed."""
    import torch.distributed as dist

    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        mine = failures.get(dist.get_rank(), next(iter(failures.values())))
        err = mine[0] if isinstance(mine, tuple) else mine
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def _staged(value: Any) -> Any:
    """A structure like ``value`` with every tensor replaced by a new uninitialized one of the
    same kind, shape, dtype and placements (DTensors stay DTensors); other leaves are kept."""
    if isinstance(value, dict):
        return {k: _staged(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value.detach())
    return value


def _apply(target: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Write a successful staged load of ``extra`` into the caller's dict, in place."""
    for key, value in loaded.items():
        old = target.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            _apply(old, value)
        elif isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor) and old.shape == value.shape:
            _copy_into(old, value)
        else:
            target[key] = value


def load(model: nn.Module, opt: torch.optim.Optimizer, checkpoint_id: str | os.PathLike, *,
         extra: dict[str, Any] | None = None, **dcp_kwargs: Any) -> dict[str, Any]:
    """Load a DCP checkpoint all-or-nothing: the live state changes only if every rank succeeded.

    ``dcp.load`` reads into *staging* tensors (new tensors shaped like :func:`state_dict`'s,
    DTensor shards included); if it raised on any rank (a missing data file, a corrupt
    ``.metadata``, a checkpoint of another model), every rank raises and the model, the
    optimizer and ``extra`` are left exactly as they were. Otherwise the staged values are
    checked and copied in by :func:`load_state_dict`. Collective over the mesh.

    Memory: one extra copy, per rank, of the tensors this rank checkpoints (its FSDP2 shards
    and their AdamW ``exp_avg`` / ``exp_avg_sq``, the fp32 masters and momentum of the matrices
    it owns, replicated parameters and buffers), plus ``extra``'s tensors, until it returns.
    Without that memory, use the in-place path: ``dcp.load(dmuon.state_dict(model, opt), ...)``
    then :func:`load_state_dict` (a failure there can leave the state half-written).

    Args:
        model: the model passed to :func:`dmuon.dedicate_params`.
        opt: its :class:`dmuon.Muon`.
        checkpoint_id: the checkpoint directory written by ``dcp.save`` (of
            ``dmuon.state_dict(model, opt)``, with ``extra``'s keys beside ``"model"`` and
            ``"optim"``).
        extra: other state saved beside it, e.g. ``{"sched": sched.state_dict()}``; filled in
            place on success (then call ``sched.load_state_dict(extra["sched"])``).
        dcp_kwargs: passed to ``dcp.load`` (``storage_reader``, ``planner``, ``process_group``).

    Returns:
        ``extra`` (``{}`` if not given), loaded.

    Raises:
        RuntimeError: on every rank, if ``dcp.load`` failed on any rank, naming the ranks and
            the first line of each error (DCP's exception chained); nothing changed.
        ValueError: ``extra`` uses the keys ``"model"`` or ``"optim"``, or the loaded state does
            not fit the model (see :func:`load_state_dict`); nothing changed.
    """
    opt = unwrap_optimizer(opt)  # Accelerate's AcceleratedOptimizer and the like
    import torch.distributed.checkpoint as dcp  # not at import: `import dmuon` changes nothing in torch
    from torch.distributed.checkpoint.api import CheckpointException

    group = _agreement_group(model, opt)
    extra = {} if extra is None else extra
    clash = sorted({MODEL_KEY, OPTIM_KEY} & set(extra))
    if clash:
        raise ValueError(f"dmuon: extra must not use the keys {clash}; dmuon.state_dict uses them")
    live = state_dict(model, opt)
    staging = _staged({**live, **extra})
    failure: BaseException | None = None
    try:
        dcp.load(staging, checkpoint_id=checkpoint_id, **dcp_kwargs)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported on every rank, chained
        failure = err  # DCP's CheckpointException is a BaseException
    problems = [] if failure is None else [_first_error(failure)]
    agree(problems, group, f"loading checkpoint {str(checkpoint_id)!r} failed", UNCHANGED, RuntimeError, failure)
    load_state_dict(model, opt, staging)
    _apply(extra, {k: v for k, v in staging.items() if k not in (MODEL_KEY, OPTIM_KEY)})
    return extra


def _missing(expected: dict, got: Any, prefix: str = "") -> list[str]:
    if not isinstance(got, dict):
        return [prefix or "<root>"]
    out = []
    for key, value in expected.items():
        name = f"{prefix}{key}"
        if key not in got:
            out.append(name)
        elif isinstance(value, dict):
            out.extend(_missing(value, got[key], name + "."))
    return out
