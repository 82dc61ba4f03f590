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
    """Scale every piece of ``clipped`` in place by the clip coefficient of the total norm and
    return the norm before clipping (0-d fp32, alike on every rank); an all-reduce over ``group``
    when torch.distributed is initialized. ``counted``: the pieces this rank counts (each
    distinct piece on one rank); ``replicated``: pieces every rank holds alike, summed where
    ``count_replicated`` (one rank) and always in the max. Raises RuntimeError on a nan/inf norm
    with ``error_if_nonfinite``.
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
    # a host sync on CUDA, as torch.nn.utils.clip_grad_norm_ does for the same check
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"dmuon: the total gradient norm is {total.item()}; refusing to clip")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for g in clipped:
            g.mul_(coef.to(g.dtype))
    return total
