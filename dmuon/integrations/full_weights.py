"""Full (unsharded) weights of a dmuon model, for the exports trainers write.

What ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))`` gives a
FSDP2 model, for a model passed to :func:`dmuon.dedicate_params`: every entry of
``model.state_dict()`` whole. FSDP2 parameters are gathered (``DTensor.full_tensor``), and each
dedicated matrix is broadcast from its owner's fp32 master. 🤗 Accelerate's ``get_state_dict``
and ``save_model`` and the transformers ``Trainer``'s ``save_model`` go through it in
:mod:`dmuon.integrations.accelerate` and :mod:`dmuon.integrations.transformers`.

Until the state-dict transparency of issue 31 is on main, torch's own full state dict
returns zero-size placeholders (``(0,)``) for the matrices another rank owns. This module is
the stop-gap, and it can go once ``get_model_state_dict`` returns full matrices.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dmuon.hooks.dedicate import get_state

#: Wrapper prefixes ``model.state_dict()`` strips and ``named_parameters()`` keeps.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical(fqn: str) -> str:
    """``fqn`` without wrapper prefixes (activation checkpointing, ``torch.compile``), as
    ``model.state_dict()`` keys it."""
    for prefix in _WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn


def full_state_dict(model: nn.Module, *, rank0_only: bool = False,
                    cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """Every entry of ``model.state_dict()`` as a full tensor (collective over the mesh).

    Each rank must call it, in the same order relative to other collectives: FSDP2 parameters
    are all-gathered and each dedicated matrix is broadcast from its owner over its shard group.

    Args:
        model: a model passed to :func:`dmuon.dedicate_params` (FSDP2, HSDP or plain
            replicated; no tensor parallelism or expert stacks split into ranges).
        rank0_only: return ``{}`` on every rank but global rank 0 (the gathers still run
            everywhere), as FSDP2's full state dict with ``cpu_offload=True`` does.
        cpu_offload: move every tensor to the CPU.

    Returns:
        ``{key: tensor}`` keyed as ``model.state_dict()`` (wrapper prefixes stripped); the
        dedicated matrices are their owners' fp32 masters (``[rows, cols]``, float32), other
        entries keep their dtype. Detached copies or views; nothing aliases a placeholder.

    Raises:
        ValueError: ``dedicate_params`` was not called on ``model``, or a dedicated matrix is
            split by tensor parallelism or into expert ranges (this export does not assemble
            them; save with ``dcp.save(dmuon.state_dict(model, opt), ...)`` instead).
    """
    ctx = get_state(model)
    ctx.ensure_bound()
    split = [rec.fqn for rec in ctx.records if rec.tp_shard_dim is not None or rec.experts is not None]
    if split:
        raise ValueError(
            f"dmuon: full_state_dict does not assemble matrices split over tensor-parallel ranks "
            f"or expert ranges ({split[:3]}{' and more' if len(split) > 3 else ''}); save "
            f"dcp.save(dmuon.state_dict(model, opt), checkpoint_id=...) and read it with DCP instead")
    dedicated: dict[str, torch.Tensor] = {}
    for rec in ctx.records:  # the same order on every rank (the plan's)
        group = rec.group if rec.group is not None else ctx.roles.shard
        if rec.is_owner:
            full = rec.master.detach().clone()
        else:
            full = torch.empty(rec.shape, dtype=rec.master.dtype, device=rec.master.device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.broadcast(full, src=dist.get_global_rank(group, rec.owner), group=group)
        dedicated[canonical(rec.fqn)] = full
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        key = canonical(key)
        if key in dedicated:
            value = dedicated[key]
        elif hasattr(value, "full_tensor"):
            value = value.full_tensor()
        value = value.detach()
        out[key] = value.cpu() if cpu_offload else value
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return out


def is_dedicated_model(model: Any) -> bool:
    """Whether ``model`` was passed to :func:`dmuon.dedicate_params`."""
    try:
        get_state(model)
    except (ValueError, TypeError):
        return False
    return True
