"""The global gradient-norm clip behind :func:`dmuon.clip_grad_norm_`: the p-norm of the
gradient pieces, each distinct piece counted on one rank, one all-reduce (SUM, or MAX for the
inf-norm), every held piece scaled by ``min(1, max_norm / (norm + 1e-6))``
(``torch/nn/utils/clip_grad.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


def is_first_copy(t: torch.Tensor, group_ranks: Sequence[int]) -> bool:
    """Whether this rank's local piece of the DTensor ``t`` (only its metadata is read) is the
    one copy a sum over ``group_ranks`` (global ranks) counts: coordinate 0 along the mesh dims
    it is ``Replicate`` on, and, for a DTensor on a sub-mesh of the group (an FSDP2 parameter on
    the data-parallel sub-mesh of FSDP x TP), the sub-mesh holding the group's lowest rank."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return False
    if any(c != 0 for c, p in zip(coord, t.placements) if p.is_replicate()):
        return False
    return min(int(r) for r in group_ranks) in {int(r) for r in mesh.mesh.flatten().tolist()}


def clip_by_total_norm_(counted: Sequence[torch.Tensor], clipped: Sequence[torch.Tensor], *,
                        max_norm: float, norm_type: float, error_if_nonfinite: bool, group: Any,
                        replicated: Sequence[torch.Tensor] = (), count_replicated: bool = False
                        ) -> torch.Tensor:
    """Scale ``clipped`` in place by the clip coefficient of the total norm; return the norm.
    Collective over ``group`` (an all-reduce) when torch.distributed is initialized.

    Args:
        counted: the pieces this rank counts (each distinct piece on exactly one rank), any
            shape and float dtype.
        clipped: every gradient piece this rank holds; multiplied in place.
        max_norm: largest allowed norm (the gradients' unit).
        norm_type: p of the p-norm; ``float("inf")`` for the max norm.
        error_if_nonfinite: raise instead of clipping by a nan/inf norm.
        group: the process group (``None``: the default group).
        replicated: pieces every rank holds equal copies of; added to this rank's sum when
            ``count_replicated`` (and always to the max).
        count_replicated: whether this rank counts ``replicated`` (true on exactly one rank).

    Returns:
        The total norm before clipping, a 0-d fp32 tensor, identical on every rank.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf.
    """
    norm_type = float(norm_type)
    device = next((g.device for g in clipped), torch.device("cpu"))
    is_inf = norm_type == float("inf")

    def local(gs: Sequence[torch.Tensor]) -> torch.Tensor:
        if not gs:
            return torch.zeros((), device=device)
        if is_inf:
            zero = torch.zeros((), device=device)
            return torch.stack([g.detach().abs().max().float() if g.numel() else zero for g in gs]).max()
        return sum(g.detach().float().abs().pow(norm_type).sum() for g in gs)

    collective = dist.is_available() and dist.is_initialized()
    total = local(counted)
    if is_inf:
        total = torch.maximum(total, local(replicated))
        if collective:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        if count_replicated:  # replicas are identical: count them once
            total = total + local(replicated)
        if collective:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        total = total.pow(1.0 / norm_type)
    # Host sync on CUDA only with error_if_nonfinite=True (not a hook: the user's call between
    # backward and step), as torch.nn.utils.clip_grad_norm_ does for the same check.
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"dmuon: the total gradient norm is {total.item()}; refusing to clip")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for g in clipped:
            g.mul_(coef.to(g.dtype))
    return total
