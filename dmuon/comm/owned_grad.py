"""What third-party code sees as a dedicated matrix's gradient: an :class:`OwnedGrad`.

A dedicated matrix's averaged gradient lives on its owner only. Outside backward every rank
shows an :class:`OwnedGrad` per dedicated parameter that had a gradient: the local tensor (the
owner's fp32 ``[rows, cols]`` average, ``[0]`` on a placeholder, ``absent`` zeros where no rank
had one) whose ``__torch_function__`` answers whole-tensor norms (``vector_norm``, ``norm``,
``linalg.norm``, ``_foreach_norm``) with the full gradient's norm, the same on every rank (one
all-reduce), MAX-reduces a grad scaler's non-finite flag, and runs every other op on the local
tensor (``mul_`` on every piece behind it; a 0-d DTensor clip factor as its full value). So
torch's, Accelerate's, transformers' and torchtitan's ``clip_grad_norm_`` compute the
single-process norm.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from dmuon.comm.collectives import all_reduce
from dmuon.owners.dedicated import DedicatedParam

_WHOLE_NORMS = (torch.linalg.vector_norm, torch.norm, torch.Tensor.norm, torch.linalg.norm)


class OwnedGrad(torch.Tensor):
    """A dedicated parameter's gradient as third-party code sees it (module docstring).

    Attributes (set by :func:`present`):
        dmuon_pieces: the plain local gradients behind the parameter (a split stack's ranges).
        dmuon_counts: whether this rank's pieces count in a sum (one of equal copies does).
        dmuon_group: the process group the norm is reduced over (the whole mesh).
        dmuon_absent: no rank produced a gradient (the owner's zeros stand for ``None``).
    """

    dmuon_pieces: list[torch.Tensor]
    dmuon_counts: bool
    dmuon_group: Any
    dmuon_absent: bool

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _WHOLE_NORMS:
            return _whole_norm(func, args, kwargs)
        if func is torch._foreach_norm:
            return _foreach_norm(*args, **kwargs)
        if func is torch._foreach_mul_:
            return _foreach_mul_(*args, **kwargs)
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            return _amp_unscale_(*args, **kwargs)
        args, kwargs = tree_map(_full_scalar, (args, kwargs))
        if getattr(func, "__name__", "") == "mul_" and isinstance(args[0], OwnedGrad):
            return _mul_pieces_(args[0], args[1])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def plain(grad: torch.Tensor | None) -> torch.Tensor | None:
    """``grad`` as a plain tensor (same storage) for dmuon's own math; ``None`` stays ``None``."""
    return grad.as_subclass(torch.Tensor) if isinstance(grad, OwnedGrad) else grad


def _full_scalar(a: Any) -> Any:
    """A 0-d DTensor (a clip coefficient computed from FSDP2's DTensor norms) as its full value."""
    if isinstance(a, torch.Tensor) and not isinstance(a, OwnedGrad) and a.ndim == 0 \
            and hasattr(a, "full_tensor"):
        return a.full_tensor()
    return a


def _ord(p: Any) -> float:
    if p is None or p == "fro":
        return 2.0
    if isinstance(p, str):
        raise RuntimeError(f"dmuon: the norm {p!r} of an owner-held gradient is not a vector norm; "
                           f"dmuon computes whole-gradient p-norms only. Use dmuon.clip_grad_norm_.")
    return float(p)


def _whole_norm(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``func(grad, p)`` over the whole gradient: the global norm, the same on every rank."""
    grad, *rest = args
    p = kwargs.pop("ord", kwargs.pop("p", rest.pop(0) if rest else None))
    dim = kwargs.pop("dim", rest.pop(0) if rest else None)
    if dim is not None or kwargs.get("keepdim", False):
        raise RuntimeError(
            f"dmuon: {getattr(func, '__name__', func)}(dim={dim!r}) on the gradient of a dedicated "
            f"matrix; its rows live on the owner only, so only a whole-tensor norm is answered "
            f"(the same on every rank). Reduce over all dims, or use dmuon.clip_grad_norm_.")
    if not isinstance(grad, OwnedGrad):  # an OwnedGrad passed elsewhere (out=, ...)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if func is torch.linalg.norm and p not in (None, "fro") and grad.dim() != 1:
        raise RuntimeError(
            f"dmuon: torch.linalg.norm(ord={p!r}) of a dedicated matrix's gradient is a matrix "
            f"norm; dmuon answers whole-gradient vector norms only (ord=None / 'fro', or "
            f"torch.linalg.vector_norm). Use dmuon.clip_grad_norm_.")
    (norm,) = global_norms([grad], _ord(p))
    dtype = kwargs.get("dtype")
    return norm.to(dtype) if dtype is not None else norm


def global_norms(grads: Sequence[OwnedGrad], p: float) -> list[torch.Tensor]:
    """The full gradients' p-norms, 0-d in each gradient's dtype, identical on every rank; one
    all-reduce (SUM of ``|g|^p``, MAX for inf) per process group. RuntimeError if ``p <= 0``."""
    if not grads:
        return []
    if not (p > 0):
        raise RuntimeError(f"dmuon: the {p}-norm of an owner-held gradient is not supported; "
                           f"use a p-norm with p > 0 or float('inf').")
    is_inf = math.isinf(p)
    out: list[torch.Tensor | None] = [None] * len(grads)
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(grads):
        by_group.setdefault(id(g.dmuon_group), []).append(i)
    for idx in by_group.values():
        first = grads[idx[0]]
        values = torch.zeros(len(idx), dtype=torch.float64, device=first.device)
        for j, i in enumerate(idx):
            if not (grads[i].dmuon_counts or is_inf):
                continue
            for piece in grads[i].dmuon_pieces:
                if piece.numel() == 0:
                    continue
                x = piece.detach().abs().to(torch.float64)
                values[j] = torch.maximum(values[j], x.max()) if is_inf else values[j] + x.pow(p).sum()
        if first.dmuon_group is not None and dist.is_available() and dist.is_initialized():
            all_reduce(values, dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, first.dmuon_group,
                       f"the all-reduce of {len(idx)} gradient norm(s)")
        if not is_inf:
            values = values.pow(1.0 / p)
        for j, i in enumerate(idx):
            out[i] = values[j].to(grads[i].dtype)
    return out  # type: ignore[return-value]


def _foreach_norm(tensors: Sequence[torch.Tensor], ord: Any = 2, dtype: Any = None) -> list[torch.Tensor]:
    """``torch._foreach_norm`` of a list holding OwnedGrads: theirs global, the rest as torch does."""
    p = _ord(ord)
    mine = [i for i, t in enumerate(tensors) if isinstance(t, OwnedGrad)]
    rest = [i for i, t in enumerate(tensors) if not isinstance(t, OwnedGrad)]
    out: list[Any] = [None] * len(tensors)
    for i, norm in zip(mine, global_norms([tensors[i] for i in mine], p)):
        out[i] = norm if dtype is None else norm.to(dtype)
    if rest:
        kw = {} if dtype is None else {"dtype": dtype}
        for i, norm in zip(rest, torch._foreach_norm([tensors[i] for i in rest], ord, **kw)):
            out[i] = norm
    return out


def _mul_pieces_(grad: OwnedGrad, factor: Any) -> OwnedGrad:
    """In-place ``grad.mul_(factor)`` on every piece behind the parameter (a clip)."""
    with torch._C.DisableTorchFunctionSubclass():
        for piece in grad.dmuon_pieces:
            piece.mul_(factor)
    return grad


def _foreach_mul_(tensors: Sequence[torch.Tensor], other: Any) -> None:
    """``torch._foreach_mul_`` of a list holding OwnedGrads by one factor (a clip coefficient)."""
    if isinstance(other, (list, tuple)):
        for t, o in zip(tensors, other):
            t.mul_(o)
        return
    rest = [t for t in tensors if not isinstance(t, OwnedGrad)]
    if rest:
        torch._foreach_mul_(rest, other)
    factor = _full_scalar(other)
    for t in tensors:
        if isinstance(t, OwnedGrad):
            _mul_pieces_(t, factor)


def _amp_unscale_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """A grad scaler's unscale of a list holding OwnedGrads; their non-finite flag is
    MAX-reduced over the mesh so ``found_inf`` (``[1]`` fp32) agrees on every rank."""
    rest = [g for g in grads if not isinstance(g, OwnedGrad)]
    if rest:
        torch._amp_foreach_non_finite_check_and_unscale_(rest, found_inf, inv_scale)
    owned = [g for g in grads if isinstance(g, OwnedGrad)]
    pieces = [p for g in owned for p in g.dmuon_pieces if p.numel()]
    mine = torch.zeros_like(found_inf)
    if pieces:
        torch._amp_foreach_non_finite_check_and_unscale_(pieces, mine, inv_scale)
    if owned and dist.is_available() and dist.is_initialized():
        all_reduce(mine, dist.ReduceOp.MAX, owned[0].dmuon_group,
                   "the all-reduce of a grad scaler's non-finite check")
    torch.maximum(found_inf, mine, out=found_inf)


def _view(local: torch.Tensor, pieces: list[torch.Tensor], counts: bool, group: Any,
          absent: bool = False) -> OwnedGrad:
    grad = local.as_subclass(OwnedGrad)
    grad.dmuon_pieces = pieces
    grad.dmuon_counts = counts
    grad.dmuon_group = group
    grad.dmuon_absent = absent
    grad.dmuon_local = local  # what unpresent gives back: no second alias per step
    return grad


def present(records: Sequence[DedicatedParam], *, group: Any, replicate_rank: int, tp_rank: int,
            made_up: dict[int, OwnedGrad]) -> None:
    """End of a synchronized backward: show each reduced (``had_grad``) record's gradient as
    an :class:`OwnedGrad` whose norms reduce over ``group`` (the mesh); ``replicate_rank`` and
    ``tp_rank`` say whether this rank's copy counts; ``made_up`` (``id(parameter) ->
    OwnedGrad``) keeps the gradients shown where this rank holds none, reused every step."""
    by_param: dict[int, tuple[DedicatedParam, list[DedicatedParam]]] = {}
    for rec in records:
        shown = rec.stack.records[0] if rec.stack is not None else rec
        by_param.setdefault(id(shown), (shown, []))[1].append(rec)
    for shown, recs in by_param.values():
        if not any(r.had_grad for r in recs):
            continue
        pieces = [plain(r.master.grad) for r in recs if r.master.grad is not None]
        counts = replicate_rank == 0 and (recs[0].tp_shard_dim is not None or tp_rank == 0)
        master = shown.master
        grad = plain(master.grad)
        if grad is None and len(pieces) == 0 and id(master) in made_up:
            master.grad = made_up[id(master)]
            continue
        if grad is None:
            absent = master.numel() > 0  # an owner (or non-0 HSDP replica) without a gradient
            grad = torch.zeros((), dtype=master.dtype, device=master.device).expand(master.shape)
            master.grad = made_up[id(master)] = _view(grad, pieces, counts, group, absent)
        else:
            master.grad = _view(grad, pieces, counts, group)


def unpresent(records: Sequence[DedicatedParam]) -> None:
    """Before the owners accumulate: plain gradients again, ``None`` where :func:`present` made
    one up, so a second backward adds to what the first left."""
    for rec in records:
        g = rec.master.grad
        if isinstance(g, OwnedGrad):
            rec.master.grad = None if g.dmuon_absent or g.numel() != rec.master.numel() \
                or (rec.master.numel() == 0 and not rec.is_owner) else g.dmuon_local
