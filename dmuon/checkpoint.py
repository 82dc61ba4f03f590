"""Sharded checkpoints of a dmuon model and optimizer with ``torch.distributed.checkpoint``.

:func:`state_dict` returns the live tensors (detached aliases, no collective, no copy) that
``dcp.save`` writes and ``dcp.load`` fills in place; :func:`load_state_dict` applies what was
loaded; :func:`load` does both all-or-nothing. Keys are canonical FQNs
(:func:`dmuon.hooks.state_dict.canonical_fqn`), so a checkpoint survives a change of world
size, owner plan, mesh, FSDP2 wrapping or activation checkpointing::

    {"model": {fqn: tensor},
     "optim": {"state": {fqn: {"momentum_buffer": ...} | {"step", "exp_avg", "exp_avg_sq"}},
               "param_groups": {"muon": {...}, "adamw": {...}}}}

* FSDP2 parameters and their AdamW state are DTensors; DCP reshards them.
* A dedicated matrix's master and momentum enter only on its owner
  (:func:`dmuon.hooks.state_dict.entries`): DCP writes a key once and loads it where asked.
  A TP slice is a DTensor on the TP mesh; an expert range is one ``"fqn[e]"`` entry per expert.
* HSDP ``"broadcast"`` mode: only replica 0 offers the momentum (the others hold stale zeros).
* Replicated tensors are plain on every rank (DCP writes one copy); hyper-parameters are byte
  items, one dict per group kind.
* ``dmuon.Muon(params, distributed_config=...)`` and single-device ``Muon(params)``: state
  tensors laid out like their parameter; param groups keyed by index (``"0"``, ``"1"``, ...).
  Plain sharded Muon matrices cannot be described to DCP (``ValueError``).

Save each checkpoint to a new directory (DCP writes ``.metadata`` last)::

    dcp.save(dmuon.state_dict(model, opt), checkpoint_id=f"ckpt/step{step}")
    dmuon.load(model, opt, "ckpt/step100")   # any world size or mesh
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from dmuon.hooks.dedicate import get_state
from dmuon.hooks.state import DedicateState
from dmuon.hooks.state_dict import agree, canonical_fqn, entries, layout_of, momentum_replica
from dmuon.optim import OwnerUpdate, unwrap_optimizer
from dmuon.owners.update import first_step_state

logger = logging.getLogger(__name__)

MODEL_KEY, OPTIM_KEY = "model", "optim"
UNCHANGED = "Nothing was loaded: the model and optimizer are unchanged on every rank."
_SKIP_GROUP_KEYS = ("params", "kind", "param_names")


def _fqns(model: nn.Module, opt: torch.optim.Optimizer, kind: str | None = None) -> dict[int, str]:
    """``{id(param): fqn}`` of ``model``; ``ValueError`` if it lacks a parameter of ``opt``
    (of ``kind``'s groups, if given)."""
    names = {id(p): n for n, p in model.named_parameters()}
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"] if kind in (None, group.get("kind")) else ():
            if id(p) not in names:
                raise ValueError(
                    f"dmuon: a parameter of shape {tuple(p.shape)} in param group {gi} of the "
                    f"optimizer is not in model.named_parameters(); pass the model whose "
                    f"parameters the optimizer was built over")
    return names


def _checked(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[DedicateState | None, Any]:
    """``(the model's dmuon state or None for Muon(params, ...), the group that agrees on a
    load)``, once ``opt`` is checked to be built over ``model`` (``ValueError`` otherwise).
    """
    strategy = getattr(opt, "strategy", None)
    if strategy is not None and not isinstance(strategy, OwnerUpdate):
        _fqns(model, opt)
        return None, strategy.group
    ctx = get_state(model)
    if getattr(opt, "state_ctx", None) is not ctx:
        raise ValueError(
            f"dmuon: the optimizer ({type(opt).__name__}) was not built over this model; "
            f"pass the dmuon.Muon(model, ...) of the same model"
        )
    ctx.settle_pending()  # Muon(overlap=...): no master or momentum with an update pending
    return ctx, ctx.roles.world


def live_entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of ``model`` as a detached alias, by canonical FQN
    (tied parameters under each name): ``nn.Module.state_dict`` before its post-hooks, which may
    return copies (torchtitan's fused-QKV split) that ``dcp.load`` would not write through, or
    be collective (dmuon's). The pre-hooks run (FSDP2's reshards its parameters).
    ``ValueError`` if a module has ``get_extra_state`` (torch's API saves it).
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
    """``local`` (shaped like DTensor ``param``'s local piece) as a DTensor laid out like
    ``param``, aliasing it; other values unchanged."""
    if not hasattr(param, "device_mesh") or not isinstance(local, torch.Tensor) \
            or hasattr(local, "device_mesh") or tuple(local.shape) != tuple(param.to_local().shape):
        return local
    return layout_of(param).wrap(local)


def state_dict(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The model and optimizer state for ``dcp.save`` / ``dcp.load``, laid out as the module
    docstring says: detached aliases of the live tensors (no collective, no copy), so
    ``dcp.load`` writes straight into the model and the optimizer. Missing optimizer state is
    created as the first step would (zeros, ``step`` 0), so a fresh job can load into it.

    Args:
        model: a model passed to :func:`dmuon.dedicate_params`; or, for a
            ``dmuon.Muon(params, ...)``, the model whose parameters ``params`` are.
        opt: the :class:`dmuon.Muon` built over ``model``.

    Raises:
        ValueError: if ``dedicate_params`` was not called on ``model``, ``opt`` belongs to
            another model, or (``Muon(params, ...)``) a parameter of ``opt`` is not in
            ``model`` or a Muon matrix is a plain shard.
    """
    opt = unwrap_optimizer(opt)  # Accelerate's AcceleratedOptimizer and the like
    ctx, _ = _checked(model, opt)
    if ctx is None:
        return _configured_state_dict(model, opt)
    ctx.ensure_bound()
    names = _fqns(model, opt, "adamw")
    optim_state: dict[str, dict[str, Any]] = {}
    adamw_state: dict[str, dict[str, Any]] = {}
    for group in opt.param_groups:
        muon = group["kind"] == "muon"
        for p in group["params"]:
            if p.requires_grad and (not muon or p.numel()):  # not on a placeholder
                first_step_state(opt.state[p], p, muon)
            if not muon:
                adamw_state[canonical_fqn(names[id(p)])] = dict(opt.state[p])
    model_sd = live_entries(model)
    for rec in ctx.records:
        model_sd.pop(canonical_fqn(rec.fqn), None)  # the live master or placeholder: entries() shows it
        if not rec.is_owner:
            continue
        model_sd.update(entries(rec, rec.master.detach()))
        buf = opt.state.get(rec.master, {}).get("momentum_buffer")
        if buf is not None and momentum_replica(rec, ctx) in (None, ctx.replicate_rank):
            optim_state.update({key: {"momentum_buffer": t} for key, t in entries(rec, buf)})
    optim_state.update(adamw_state)
    groups = {g["kind"]: {k: v for k, v in g.items() if k not in _SKIP_GROUP_KEYS} for g in opt.param_groups}
    return {MODEL_KEY: model_sd, OPTIM_KEY: {"state": optim_state, "param_groups": groups}}


def _configured_state_dict(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """:func:`state_dict` of a ``dmuon.Muon(params, ...)``: state tensors laid out like their
    parameter, param groups keyed by index."""
    names = _fqns(model, opt)
    config = getattr(opt.strategy, "config", None)
    layouts = iter((config and config.state.get("layouts")) or ())
    optim_state: dict[str, dict[str, Any]] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            layout = next(layouts, None) if group["use_muon"] else None
            if layout is not None and not hasattr(p, "device_mesh") and len(layout.representatives()) > 1:
                raise ValueError(
                    f"dmuon: Muon matrix {names[id(p)]!r} is a plain tensor sharded over ranks (local "
                    f"shape {tuple(p.shape)} of {layout.full_shape}); DCP cannot place plain shards. "
                    f"Make the parameters DTensors (fully_shard, distribute_tensor) to checkpoint them.")
            if p.requires_grad:  # zero state where none exists yet, for dcp.load to fill
                state = first_step_state(opt.state[p], p, group["use_muon"])
                optim_state[canonical_fqn(names[id(p)])] = {k: _laid_out_like(p, v) for k, v in state.items()}
    groups = {str(gi): {k: v for k, v in g.items() if k != "params"} for gi, g in enumerate(opt.param_groups)}
    return {MODEL_KEY: live_entries(model), OPTIM_KEY: {"state": optim_state, "param_groups": groups}}


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
    for fqn, tensors in expected[OPTIM_KEY]["state"].items():
        for name, t in tensors.items():
            pairs.append((t, sd[OPTIM_KEY]["state"][fqn][name], f"optimizer state {fqn!r}/{name}"))
    return pairs


def load_state_dict(model: nn.Module, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Apply a state dict from :func:`state_dict` (typically after ``dcp.load`` filled it).

    All or nothing: every key, tensor type, shape (global and local) and dtype is checked and
    the ranks agree (one ``all_gather_object``) before anything is written; tensors ``dcp.load``
    wrote in place are left alone, others copied in. Then the saved hyper-parameters are set
    and the owners refresh their compute copies. Collective. ``model`` and ``opt`` as for
    :func:`state_dict`; ``sd`` its dict on this rank.

    Raises:
        ValueError: on every rank, if on any rank ``sd`` lacks a key that rank needs or holds a
            tensor of the wrong kind, shape or dtype (a checkpoint of another model); naming the
            ranks and entries. Nothing is written.
    """
    opt = unwrap_optimizer(opt)  # Accelerate's AcceleratedOptimizer and the like
    ctx, group = _checked(model, opt)
    problems: list[str] = []
    if not isinstance(sd, dict) or MODEL_KEY not in sd or OPTIM_KEY not in sd:
        keys = sorted(sd) if isinstance(sd, dict) else type(sd).__name__
        problems.append(f"the checkpoint state dict has keys {keys}; expected {[MODEL_KEY, OPTIM_KEY]} "
                        f"(build it with dmuon.state_dict)")
    expected = state_dict(model, opt)
    if not problems:
        for section in (MODEL_KEY, OPTIM_KEY):
            missing = _missing(expected[section], sd[section])
            if missing:
                problems.append(f"the checkpoint state dict lacks {section!r} entries {missing[:5]} "
                                f"({len(missing)} in all)")
    if not problems and not isinstance(sd[OPTIM_KEY].get("param_groups"), dict):
        problems.append("the checkpoint state dict's optimizer param_groups are not a dict by kind")
    if not problems and ctx is None and set(sd[OPTIM_KEY]["param_groups"]) != set(
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
        for name, value in saved_groups.get(group["kind"] if ctx is not None else str(index), {}).items():
            group[name] = value
    if ctx is not None:
        ctx.publish_after_step(issue=False)
        logger.debug("dmuon: rank %d loaded %d model entries", ctx.rank, len(expected[MODEL_KEY]))


def _first_error(err: BaseException) -> str:
    """``"Type: first line"`` of an error (of a ``CheckpointException``: this rank's failure,
    else the first rank's)."""
    import torch.distributed as dist

    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        mine = failures.get(dist.get_rank(), next(iter(failures.values())))
        err = mine[0] if isinstance(mine, tuple) else mine
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def _staged(value: Any) -> Any:
    """``value`` with every tensor replaced by an uninitialized one like it (DTensors too)."""
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

    ``dcp.load`` reads into staging tensors like :func:`state_dict`'s; if it raised on any
    rank, every rank raises. Otherwise :func:`load_state_dict` checks and copies them in.
    Collective. Memory: one extra copy of this rank's checkpointed tensors and ``extra``'s
    (``dcp.load(dmuon.state_dict(...))`` + :func:`load_state_dict` loads in place).

    Args:
        model, opt: as for :func:`state_dict`.
        checkpoint_id: the directory ``dcp.save`` wrote ``dmuon.state_dict(model, opt)`` to
            (with ``extra``'s keys beside ``"model"`` and ``"optim"``).
        extra: other state saved beside it, e.g. ``{"sched": sched.state_dict()}``; filled in
            place on success.
        dcp_kwargs: passed to ``dcp.load`` (``storage_reader``, ``planner``, ``process_group``).

    Returns:
        ``extra`` (``{}`` if not given), loaded.

    Raises:
        RuntimeError: on every rank, if ``dcp.load`` failed on any rank, naming the ranks and
            their first error line (DCP's exception chained); nothing changed.
        ValueError: ``extra`` uses the keys ``"model"`` or ``"optim"``, or the loaded state does
            not fit the model (:func:`load_state_dict`); nothing changed.
    """
    opt = unwrap_optimizer(opt)  # Accelerate's AcceleratedOptimizer and the like
    import torch.distributed.checkpoint as dcp  # not at import: `import dmuon` changes nothing in torch
    from torch.distributed.checkpoint.api import CheckpointException

    _, group = _checked(model, opt)
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
    what = f"loading checkpoint {str(checkpoint_id)!r} failed"
    agree(problems, group, what, UNCHANGED, RuntimeError, failure)
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
