"""dmuon under 🤗 Accelerate's FSDP2 (recipe: docs/integrations.md).

``model, optimizer = prepare(accelerator, model, lr=0.02)`` replaces
``accelerator.prepare(model, optimizer)``; the stock Accelerate loop (``accumulate``,
``backward``, ``clip_grad_norm_``, ``get_state_dict``, ``save_state`` / ``load_state``) runs
unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import dmuon


def prepare(accelerator: Any, model: nn.Module, *, mesh: Any = None,
            dedicate_kwargs: dict[str, Any] | None = None,
            **muon_kwargs: Any) -> tuple[nn.Module, Any]:
    """Accelerate's FSDP2 preparation of ``model``, then :func:`dmuon.dedicate_params` and
    :class:`dmuon.Muon`. Collective.

    Args:
        accelerator: an ``accelerate.Accelerator`` whose state is FSDP2 (``fsdp_version=2``).
        model: the unwrapped model (not yet prepared).
        mesh: the mesh for :func:`dmuon.dedicate_params`; ``None``: the one FSDP2 sharded over.
        dedicate_kwargs: extra keyword arguments for :func:`dmuon.dedicate_params`.
        muon_kwargs: keyword arguments for :class:`dmuon.Muon`.

    Returns:
        ``(model, optimizer)``: the FSDP2 model (sharded in place) and the
        ``AcceleratedOptimizer`` wrapping its :class:`dmuon.Muon`.

    Raises:
        ValueError: the accelerator is not FSDP2 or already prepared a model, or ``model`` was
            already dedicated; or what ``dedicate_params`` / ``dmuon.Muon`` raise.
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
    model, stand_in = accelerator.prepare(model, stand_in_optimizer(model))
    return model, replace_stand_in(accelerator, model, stand_in,
                                   {**(dedicate_kwargs or {}), "mesh": mesh}, muon_kwargs)


def replace_stand_in(accelerator: Any, model: nn.Module, stand_in: Any,
                     dedicate_kwargs: dict[str, Any], muon_kwargs: dict[str, Any]) -> Any:
    """:func:`dedicate` the sharded ``model`` and prepare a :class:`dmuon.Muon` in place of
    ``stand_in`` (collective)."""
    if stand_in in accelerator._optimizers:
        accelerator._optimizers.remove(stand_in)  # save_state pairs _optimizers[i] with _models[i]
    dedicate(model, dedicate_kwargs)
    return accelerator.prepare_optimizer(dmuon.Muon(model, **muon_kwargs))


def stand_in_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """A throwaway ``SGD(lr=0)``: Accelerate's FSDP2 ``prepare`` needs an optimizer beside the
    model, and :class:`dmuon.Muon` needs the sharded model."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params or [nn.Parameter(torch.zeros(1))], lr=0.0)


def dedicate(model: nn.Module, dedicate_kwargs: dict[str, Any]) -> None:
    """:func:`dmuon.dedicate_params` with ``dedicate_kwargs`` (``mesh`` default :func:`fsdp_mesh`)."""
    kwargs = dict(dedicate_kwargs)
    mesh = kwargs.pop("mesh", None)
    dmuon.dedicate_params(model, mesh if mesh is not None else fsdp_mesh(model), **kwargs)


def fsdp_mesh(model: nn.Module) -> Any:
    """The mesh of ``model``'s first DTensor parameter.

    Raises:
        ValueError: no parameter of ``model`` is a DTensor (FSDP2 did not shard it).
    """
    for p in model.parameters():
        if hasattr(p, "device_mesh"):
            return p.device_mesh
    raise ValueError(f"dmuon: no parameter of {type(model).__name__} is a DTensor; FSDP2 did not "
                     f"shard it. Pass mesh= to prepare()")
