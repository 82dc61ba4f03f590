"""Optimizer state of ``dmuon.Muon(params, ...)`` laid out like the parameters, as torch's
state-dict utilities (``get_/set_optimizer_state_dict``), ``dcp.save`` / ``dcp.load`` and the
trainers built on them expect from FSDP2 + ``torch.optim.AdamW``:

* **State tensors are shaped like their parameter** (``torch.zeros_like(param)``: a DTensor
  parameter's state is a DTensor with its mesh, placements, global shape and stride; the step
  updates the local pieces in place), so DCP saves and reshards them like the parameter.
* **State exists from construction** (zeros, AdamW ``step`` 0: what the first step creates), so
  torch's ``_init_optim_state`` finds state and does not step (on cleared state, its
  ``lr = 0`` step with zero gradients changes no parameter).
* **param_groups hold plain values** (:class:`dmuon.hooks.state_dict.OptimizerStateHooks`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dmuon.hooks.state_dict import OptimizerStateHooks
from dmuon.owners.slices import local_tensor
from dmuon.owners.update import first_step_state


def zero_state(opt: torch.optim.Optimizer, param: Tensor, use_muon: bool) -> dict[str, Any]:
    """``opt.state[param]``, with the state the first step would create added where missing
    (:func:`dmuon.owners.update.first_step_state`, zeros like ``param``)."""
    return first_step_state(opt.state[param], param, use_muon)


def init_state(opt: torch.optim.Optimizer) -> None:
    """Create every trainable parameter's state now (see the module docstring); frozen
    parameters get none, as in torch's optimizers. Local: no collective."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                zero_state(opt, p, group["use_muon"])


def local_state(value: Tensor, shape: torch.Size, name: str, where: str) -> Tensor:
    """This rank's piece of a state tensor, checked against the parameter's local piece.

    Args:
        value: the state tensor ``name`` (a DTensor laid out like its parameter, or a plain
            tensor shaped like the parameter's local piece).
        shape: the local piece's shape (of the parameter or its gradient).
        where: names the parameter in the message (``"Muon matrix 3 (shape (7, 12))"``).

    Raises:
        RuntimeError: the shapes differ (a state dict from another layout given to
            ``opt.load_state_dict``), naming the fix.
    """
    local = local_tensor(value)
    if local.shape != shape:
        raise RuntimeError(
            f"dmuon: {where}: optimizer state {name!r} holds a local piece of shape "
            f"{tuple(local.shape)} ({type(value).__name__} of shape {tuple(value.shape)}), but the "
            f"parameter's local piece is {tuple(shape)}. Load optimizer state with "
            f"torch.distributed.checkpoint.state_dict.set_optimizer_state_dict (or dcp.load into "
            f"get_optimizer_state_dict's dict), which lays it out like the parameter.")
    return local


def install_state_dict_hooks(opt: torch.optim.Optimizer) -> list[Any]:
    """Register ``opt``'s ``param_groups`` translation (``ns_dtype`` as a string); returns the
    handles."""
    return OptimizerStateHooks(opt).install()
