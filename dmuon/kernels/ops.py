"""The small op set the Newton-Schulz algorithms are written over, and its torch version.

The iteration in :mod:`dmuon.kernels.newton_schulz` is written once over three ops, so the
Triton backend (:mod:`dmuon.kernels.triton_ops`) cannot drift from the torch reference, which is
the spec (pattern of Dao-AILab/gram-newton-schulz's ``_TORCH_BE``/``_TRITON_BE`` and
microsoft/dion):

* ``sym_mm(A, B, C=None, alpha=1, beta=0) = alpha * A @ B + beta * C`` where the caller promises
  the result is symmetric (``A @ B`` with ``B = A^T``, or a product of two commuting symmetric
  matrices, which is what every Gram-polynomial product is). A kernel may compute one triangle
  and mirror it.
* ``mm(A, B, C=None, alpha=1, beta=0) = alpha * A @ B + beta * C`` with no structure.
* ``add_diag(A, value) = A + value * I`` (a new tensor).

All take ``[m, k]`` or ``[batch, m, k]`` operands of one floating dtype and return that dtype.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["NSOps", "TORCH_OPS", "torch_add_diag", "torch_mm", "torch_sym_mm"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NSOps:
    """A backend for the Newton-Schulz algorithms.

    Attributes:
        name: backend name, ``"torch"`` or ``"triton"``.
        sym_mm: ``(A, B, C=None, alpha=1.0, beta=0.0) -> alpha*A@B + beta*C``, symmetric result.
        mm: ``(A, B, C=None, alpha=1.0, beta=0.0) -> alpha*A@B + beta*C``.
        add_diag: ``(A, value) -> A + value * I``.
    """

    name: str
    sym_mm: Callable[..., Tensor]
    mm: Callable[..., Tensor]
    add_diag: Callable[[Tensor, float], Tensor]


def torch_mm(
    A: Tensor, B: Tensor, C: Optional[Tensor] = None, alpha: float = 1.0, beta: float = 0.0
) -> Tensor:
    """``alpha * A @ B + beta * C`` (``A`` ``[m, k]`` or ``[batch, m, k]``, ``B`` ``[.., k, n]``,
    ``C`` ``None`` or ``[.., m, n]``, one dtype) with the calls ``torch.optim.Muon`` issues
    (``A @ B``, ``torch.addmm``; ``baddbmm`` for 3-D), so the bf16 standard iteration is bitwise
    identical to it."""
    if C is None:
        if alpha == 1.0:
            return A @ B
        return torch.mul(A @ B, alpha)
    if A.dim() == 2:
        return torch.addmm(C, A, B, beta=beta, alpha=alpha)
    return torch.baddbmm(C, A, B, beta=beta, alpha=alpha)


def torch_sym_mm(
    A: Tensor, B: Tensor, C: Optional[Tensor] = None, alpha: float = 1.0, beta: float = 0.0
) -> Tensor:
    """:func:`torch_mm` for a result the caller promises symmetric (torch computes all of it)."""
    return torch_mm(A, B, C, alpha=alpha, beta=beta)


def torch_add_diag(A: Tensor, value: float) -> Tensor:
    """Return ``A + value * I`` for ``A`` of shape ``[m, m]`` or ``[batch, m, m]`` (new tensor)."""
    out = A.clone()
    out.diagonal(dim1=-2, dim2=-1).add_(value)
    return out


#: The reference backend.
TORCH_OPS = NSOps(name="torch", sym_mm=torch_sym_mm, mm=torch_mm, add_diag=torch_add_diag)
