"""Optimizer state of ``dmuon.Muon(params, ...)`` laid out like the parameters, and
``param_groups`` that torch's state-dict utilities accept.

What torch's ``torch.distributed.checkpoint.state_dict`` (``get_/set_optimizer_state_dict``,
sharded, full or flattened), ``dcp.save`` / ``dcp.load`` and the trainers built on them read
is ``opt.state_dict()``, as they read it from FSDP2 + ``torch.optim.AdamW``:

* **State tensors are shaped like their parameter.** Muon's ``momentum_buffer`` and AdamW's
  ``exp_avg`` / ``exp_avg_sq`` of a DTensor parameter are DTensors with its mesh, placements,
  global shape and stride (``torch.zeros_like(param)``); the step updates their local pieces in
  place (``to_local()`` aliases the storage). DCP then saves and reshards them like the
  parameter. Plain parameters get plain state (replicas for DCP; plain *sharded* matrices, as
  ``create_processgroup_config(fsdp_pg=...)`` makes them, cannot be described to DCP, exactly
  as the parameters themselves cannot).
* **State exists from construction** (zeros, AdamW ``step`` 0: what the first step would
  create), so ``_init_optim_state`` -- which otherwise runs ``opt.step()`` with zero gradients
  and ``lr = 0`` on an optimizer without state, moving AdamW's step count to 1 -- finds state and
  does nothing. If the state was cleared, that step still changes no parameter (the Muon
  update of a zero gradient is zero, the decay factor ``1 - 0 * wd`` is 1).
* **param_groups hold plain values:** ``ns_dtype`` is written as a string (``"float32"``;
  torch's full-state-dict gather refuses a ``torch.dtype``) and parsed back on load. Param
  groups built from ``(name, parameter)`` pairs (``model.named_parameters()``) carry torch's
  ``param_names``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from dmuon.owners.slices import local_tensor
from dmuon.owners.update import dtype_name, first_step_state, parse_dtype

logger = logging.getLogger(__name__)


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


def _plain_groups(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` post-hook: ``ns_dtype`` as a string in the (copied) groups."""
    for group in sd["param_groups"]:
        if isinstance(group.get("ns_dtype"), torch.dtype):
            group["ns_dtype"] = dtype_name(group["ns_dtype"])
    return sd


def _parse_groups(opt: torch.optim.Optimizer) -> None:
    """``load_state_dict`` post-hook: ``ns_dtype`` of the live groups back to a ``torch.dtype``."""
    for group in opt.param_groups:
        if "ns_dtype" in group:
            group["ns_dtype"] = parse_dtype(group["ns_dtype"])


def install_state_dict_hooks(opt: torch.optim.Optimizer) -> list[Any]:
    """Register :func:`_plain_groups` and :func:`_parse_groups` on ``opt``; returns the handles."""
    return [opt.register_state_dict_post_hook(_plain_groups),
            opt.register_load_state_dict_post_hook(_parse_groups)]
