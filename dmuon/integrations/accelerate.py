"""dmuon under 🤗 Accelerate's FSDP2 (the trainer of LeRobot's training script).

One call replaces ``accelerator.prepare(model, optimizer)``::

    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    import dmuon.integrations.accelerate

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
                              gradient_accumulation_steps=2)
    model, optimizer = dmuon.integrations.accelerate.prepare(accelerator, model, lr=0.02)
    loader, scheduler = accelerator.prepare(loader, scheduler)    # as usual

and the stock loop runs unchanged: ``with accelerator.accumulate(model)``,
``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_(model.parameters(), max_norm)``
(the global norm), ``optimizer.step()`` / ``zero_grad()``, ``accelerator.get_state_dict(model)``
(full weights), ``accelerator.save_state(dir)`` / ``load_state(dir)`` (exact resume).

:func:`prepare` does Accelerate's FSDP2 preparation of the model (its auto-wrap policy,
activation checkpointing, mixed precision), :func:`dmuon.dedicate_params` on the mesh FSDP2
sharded over, builds :class:`dmuon.Muon` and hands it to ``accelerator.prepare_optimizer``.

**Overrides (until issue 31's state-dict and clipping transparency is on main).** Accelerate
1.15 reads dmuon's placeholders and owner-only gradients as FSDP2 parameters, so three of its
calls would be silently wrong for the prepared model. :func:`prepare` routes them through
dmuon on *this* ``accelerator`` only (instance attributes; the ``Accelerator`` class and other
accelerators are untouched), each in its own function below, so each can be deleted once stock
Accelerate sees the right values:

* ``clip_grad_norm_`` -> :func:`dmuon.clip_grad_norm_` (stock: ``_clip_grad_norm_dtensor_aware``
  takes owner-only plain gradients for replicated ones: a rank-dependent norm);
* ``get_state_dict`` -> :func:`dmuon.integrations.full_weights.full_state_dict` (stock: DCP's
  full state dict, zero-size tensors for the matrices another rank owns);
* ``save_state`` / ``load_state`` -> Accelerate's own for everything but this model and
  optimizer (schedulers, RNG, step, dataloaders, custom objects), then ``dcp.save`` of
  :func:`dmuon.state_dict` / :func:`dmuon.load` in ``<dir>/dmuon`` (stock: DCP's sharded state
  dicts, which cannot describe an owner-held matrix and fail, and FSDP models are saved before
  any pre-hook could step in).
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Iterable, Iterator

import torch
from torch import nn

import dmuon
from dmuon.integrations.full_weights import full_state_dict

#: Sub-directory of an Accelerate checkpoint that holds dmuon's DCP checkpoint.
DMUON_DIR = "dmuon"


def prepare(accelerator: Any, model: nn.Module, *, mesh: Any = None,
            dedicate_kwargs: dict[str, Any] | None = None,
            **muon_kwargs: Any) -> tuple[nn.Module, Any]:
    """Accelerate's FSDP2 preparation of ``model``, then dmuon's owners and optimizer.

    Collective: every rank calls it with the same arguments.

    Args:
        accelerator: an ``accelerate.Accelerator`` whose state is FSDP2
            (``FullyShardedDataParallelPlugin(fsdp_version=2)`` or ``accelerate launch`` with
            ``fsdp_version: 2``).
        model: the unwrapped model (not yet prepared).
        mesh: the mesh to pass to :func:`dmuon.dedicate_params`; ``None``: the mesh FSDP2
            sharded the model's parameters over.
        dedicate_kwargs: extra keyword arguments for :func:`dmuon.dedicate_params`.
        muon_kwargs: keyword arguments for :class:`dmuon.Muon` (``lr``, ``weight_decay``,
            ``adamw_lr``, ...).

    Returns:
        ``(model, optimizer)``: the FSDP2 model (the same object, sharded in place) and the
        ``AcceleratedOptimizer`` wrapping its :class:`dmuon.Muon`. The accelerator's
        ``clip_grad_norm_``, ``get_state_dict``, ``save_state`` and ``load_state`` are routed
        through dmuon for this model (see the module docstring).

    Raises:
        ValueError: the accelerator is not FSDP2, it already prepared a model, or ``model``
            was already passed to ``dedicate_params``; or what ``dedicate_params`` /
            ``dmuon.Muon`` raise.
    """
    if not getattr(accelerator, "is_fsdp2", False):
        raise ValueError(
            f"dmuon: dmuon.integrations.accelerate.prepare needs Accelerate's FSDP2 (got "
            f"distributed_type {accelerator.distributed_type}); pass "
            f"Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)) or set "
            f"fsdp_version: 2 in the accelerate config")
    if accelerator._models:
        raise ValueError(
            f"dmuon: this accelerator already prepared {len(accelerator._models)} model(s); "
            f"Accelerate's FSDP2 takes one model per accelerator: call prepare() on a fresh one")
    # Accelerate's FSDP2 path refuses a model without an optimizer (it swaps the optimizer's
    # parameters for the sharded ones); dmuon.Muon can only be built after dedicate_params,
    # which needs the sharded model. A throwaway SGD fills the slot and is dropped at once.
    stand_in = torch.optim.SGD([p for p in model.parameters() if p.requires_grad] or
                               [nn.Parameter(torch.zeros(1))], lr=0.0)
    model, prepared_stand_in = accelerator.prepare(model, stand_in)
    accelerator._optimizers.remove(prepared_stand_in)  # save_state pairs _optimizers[i] with _models[i]
    dmuon.dedicate_params(model, mesh if mesh is not None else fsdp_mesh(model),
                          **(dedicate_kwargs or {}))
    optimizer = accelerator.prepare_optimizer(dmuon.Muon(model, **muon_kwargs))
    _route_clip(accelerator, model)
    _route_get_state_dict(accelerator, model)
    _route_save_load(accelerator, model, optimizer)
    return model, optimizer


def fsdp_mesh(model: nn.Module) -> Any:
    """The device mesh FSDP2 sharded ``model``'s parameters over (the first DTensor's).

    Raises:
        ValueError: no parameter of ``model`` is a DTensor (FSDP2 did not shard it).
    """
    for p in model.parameters():
        if hasattr(p, "device_mesh"):
            return p.device_mesh
    raise ValueError(f"dmuon: no parameter of {type(model).__name__} is a DTensor; FSDP2 did not "
                     f"shard it. Pass mesh= to prepare()")


def _is_whole_model(params: list[torch.Tensor], model: nn.Module) -> bool:
    return {id(p) for p in params} == {id(p) for p in model.parameters()}


# --------------------------------------------------------------------------- the overrides
# Each one can be deleted once stock Accelerate sees FSDP2-like values for a dmuon model
# (issue 31): then the class method runs again.

def _route_clip(accelerator: Any, model: nn.Module) -> None:
    """``accelerator.clip_grad_norm_(model.parameters(), ...)`` -> :func:`dmuon.clip_grad_norm_`.

    Why: Accelerate 1.15's FSDP2 clip (``_clip_grad_norm_dtensor_aware``) treats plain-tensor
    gradients as replicated, but a dedicated matrix's gradient is on its owner only: each rank
    would get its own norm. Other parameter lists go to the stock method; a list holding part
    of this model's dedicated matrices is refused (its norm cannot be told from the owners').
    """
    stock = accelerator.clip_grad_norm_
    dedicated = {id(rec.master) for rec in model._dmuon_state.records}

    def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        params = list(parameters)
        if _is_whole_model(params, model):
            accelerator.unscale_gradients()
            return dmuon.clip_grad_norm_(model, max_norm, norm_type)
        if any(id(p) in dedicated for p in params):
            raise ValueError(
                "dmuon: accelerator.clip_grad_norm_ got part of the parameters of a dmuon model; "
                "dmuon computes the global norm over the whole model only: pass "
                "model.parameters()")
        return stock(params, max_norm, norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_


def _route_get_state_dict(accelerator: Any, model: nn.Module) -> None:
    """``accelerator.get_state_dict(model)`` -> full weights from the owners.

    Why: stock FSDP2 ``get_state_dict`` is DCP's full state dict (rank 0, on the CPU), which
    returns a zero-size tensor for every matrix another rank owns. Same contract here: the
    full weights on rank 0, ``{}`` elsewhere; collective.
    """
    stock = accelerator.get_state_dict

    def get_state_dict(m: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        if m is model or accelerator.unwrap_model(m) is model:
            return full_state_dict(model, rank0_only=True, cpu_offload=True)
        return stock(m, unwrap=unwrap)

    accelerator.get_state_dict = get_state_dict


@contextlib.contextmanager
def _hidden(accelerator: Any, model: nn.Module, optimizer: Any) -> Iterator[None]:
    """Within the block, ``accelerator`` does not list ``model`` and ``optimizer`` (so its
    own save/load skips them); restored on exit."""
    models, optimizers = list(accelerator._models), list(accelerator._optimizers)
    accelerator._models[:] = [m for m in models if m is not model]
    accelerator._optimizers[:] = [o for o in optimizers if o is not optimizer]
    try:
        yield
    finally:
        accelerator._models[:] = models
        accelerator._optimizers[:] = optimizers


def _route_save_load(accelerator: Any, model: nn.Module, optimizer: Any) -> None:
    """``save_state`` / ``load_state``: Accelerate's own for everything else, dmuon's DCP
    checkpoint of this model and optimizer in ``<dir>/dmuon``.

    Why: stock FSDP2 ``save_state`` saves the model and optimizer through DCP's sharded state
    dicts, which cannot hold an owner's full matrix beside the other ranks' placeholders (the
    save fails), and it does so before any ``register_save_state_pre_hook`` hook runs.
    The load is :func:`dmuon.load`: all-or-nothing on every rank.
    """
    import torch.distributed.checkpoint as dcp

    stock_save, stock_load = accelerator.save_state, accelerator.load_state

    def save_state(output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        with _hidden(accelerator, model, optimizer):
            location = stock_save(output_dir, safe_serialization=safe_serialization,
                                  **save_model_func_kwargs)
        dcp.save(dmuon.state_dict(model, optimizer.optimizer),
                 checkpoint_id=os.path.join(location, DMUON_DIR))
        return location

    def load_state(input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        input_dir = _resolve_input_dir(accelerator, input_dir)
        with _hidden(accelerator, model, optimizer):
            stock_load(input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)
        dmuon.load(model, optimizer.optimizer, os.path.join(input_dir, DMUON_DIR))

    accelerator.save_state, accelerator.load_state = save_state, load_state


def _resolve_input_dir(accelerator: Any, input_dir: str | None) -> str:
    """The directory ``load_state(input_dir)`` reads: Accelerate's rule (the latest
    ``checkpoint_<n>`` under automatic checkpoint naming when ``input_dir`` is ``None``).

    Raises:
        ValueError: as Accelerate: no directory given and automatic naming off.
    """
    if input_dir is not None:
        return os.path.expanduser(input_dir)
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError("dmuon: load_state got no input_dir and automatic checkpoint naming is "
                         "disabled; pass the directory save_state wrote")
    root = os.path.join(accelerator.project_dir, "checkpoints")
    folders = [os.path.join(root, f) for f in os.listdir(root)]
    return max(folders, key=lambda f: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)[0]))
