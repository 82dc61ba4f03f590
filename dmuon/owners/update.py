"""Owner-side update math: Muon for dedicated matrices, AdamW for everything else.

Both follow PyTorch's single-tensor implementations op for op, so a dmuon step equals a
single-process ``torch.optim.Muon`` / ``torch.optim.AdamW`` step on the same gradient:

* Muon: ``torch/optim/_muon.py`` (``_single_tensor_muon``), after Jordan et al., "Muon: An
  optimizer for hidden layers in neural networks" (2024).
* AdamW: ``torch/optim/adam.py`` (``_single_tensor_adam`` with ``decoupled_weight_decay``),
  after Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (ICLR 2019).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from dmuon.owners import torch_muon
from dmuon.owners.slices import chunk_span, local_tensor

NS_METHODS = ("gram", "standard")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``: how an ``ns_dtype`` is written in a state dict (torch's
    state-dict utilities and DCP take no ``torch.dtype`` values in ``param_groups``)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: Any) -> Any:
    """``"float16"`` (or ``"torch.float16"``) -> ``torch.float16``; anything else unchanged."""
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    return value


def first_step_state(state: dict[str, Any], like: torch.Tensor, use_muon: bool) -> dict[str, Any]:
    """Add to ``state`` (and return it) what torch's first step would create, keeping what is
    there: Muon's ``momentum_buffer``, or AdamW's ``step`` (0-d fp32 CPU 0), ``exp_avg`` and
    ``exp_avg_sq``; zeros like ``like`` (a DTensor for a DTensor)."""
    if use_muon:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(like, memory_format=torch.preserve_format)
    elif not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(like, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
    return state


def validate_hyperparameters(*, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                             adjust_lr_fn: str | None = None, ns_method: str = "gram",
                             ns_dtype: torch.dtype | None = None, adamw_lr: float | None = None,
                             adamw_betas: tuple[float, float] = (0.9, 0.999),
                             ns_coefficients: Any = "polar_express", ns_steps: int = 5,
                             eps: float = 1e-7, adamw_eps: float = 1e-8,
                             adamw_weight_decay: float | None = None, where: str = "") -> None:
    """Check :class:`dmuon.Muon`'s hyper-parameters as ``torch.optim.Muon`` / ``AdamW`` do, and
    also that every number is finite, ``momentum`` in [0, 1) and ``ns_steps`` an integer >= 1.
    ``where`` prefixes the message (``"param group 2: "``).

    Raises:
        ValueError: naming the hyper-parameter, its value and the accepted range.
        TypeError: a hyper-parameter that is not a real number (a string, ``None``...).
    """
    from dmuon.kernels import resolve_coefficients

    def number(name: str, value: Any, low: float = 0.0, high: float | None = None) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            else:
                raise TypeError(f"dmuon: {where}{name} must be a real number, got "
                                f"{type(value).__name__} {value!r}")
        if not math.isfinite(value) or value < low or (high is not None and value >= high):
            accepted = f"in [{low:g}, {high:g})" if high is not None else f"a finite number >= {low:g}"
            raise ValueError(f"dmuon: {where}{name} must be {accepted}, got {value!r}")

    number("lr", lr)
    number("weight_decay", weight_decay)
    number("momentum", momentum, high=1.0)
    number("eps", eps)
    if adamw_lr is not None:
        number("adamw_lr", adamw_lr)
    if adamw_weight_decay is not None:
        number("adamw_weight_decay", adamw_weight_decay)
    number("adamw_eps", adamw_eps)
    if not isinstance(adamw_betas, (tuple, list)) or len(adamw_betas) != 2:
        raise ValueError(f"dmuon: {where}adamw_betas must be a pair (beta1, beta2), got {adamw_betas!r}")
    number("adamw_betas[0]", adamw_betas[0], high=1.0)
    number("adamw_betas[1]", adamw_betas[1], high=1.0)
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"dmuon: {where}ns_steps must be an integer >= 1, got {ns_steps!r}")
    torch_muon.installed().check_adjust_lr_fn(adjust_lr_fn, where)
    if ns_method not in NS_METHODS:
        raise ValueError(f"dmuon: {where}ns_method must be one of {NS_METHODS}, got {ns_method!r}")
    if ns_dtype is not None and ns_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"dmuon: {where}ns_dtype must be a float dtype or None (by device), got {ns_dtype}")
    resolve_coefficients(ns_coefficients, ns_steps)


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """Muon's shape-dependent learning rate (``torch.optim.Muon``'s ``_adjust_lr``).

    Args:
        lr: base learning rate (unitless step size).
        adjust_lr_fn: ``None``/``"original"``: ``lr * sqrt(max(1, rows / cols))`` (Jordan et al.);
            ``"match_rms_adamw"``: ``lr * 0.2 * sqrt(max(rows, cols))`` (Liu et al. 2025,
            "Muon is Scalable for LLM Training", eq. 4); ``"spectral_unclamped"`` (torch>=2.14):
            ``lr * sqrt(rows / cols)`` (Bernstein, "Deriving Muon").
        shape: ``(rows, cols)`` of the full matrix.

    Raises:
        ValueError: an ``adjust_lr_fn`` the installed ``torch.optim.Muon`` does not take (a
            state dict may carry one past construction's check).
    """
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    torch_muon.installed().check_adjust_lr_fn(adjust_lr_fn)
    return lr * math.sqrt(rows / cols)


@dataclass(frozen=True, slots=True, kw_only=True)
class MuonHyper:
    """A param group's Muon hyper-parameters, frozen when ``opt.step()`` runs (a job running
    after ``step()`` must not see what a scheduler set since).

    ``ns``: the Newton-Schulz settings as sorted ``(name, value)`` pairs, lists as tuples (two
    records compare by value); ``max_batch_bytes``: cap on one same-shape batch, or ``None``.
    """

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    adjust_lr_fn: str | None
    ns: tuple[tuple[str, Any], ...]
    max_batch_bytes: int | None = None

    @classmethod
    def of(cls, group: dict, *, backend: str = "auto", max_batch_bytes: int | None = None) -> "MuonHyper":
        """The record of a Muon param group (keys as :class:`dmuon.Muon` writes them)."""
        ns = dict(steps=group["ns_steps"], coefficients=_frozen(group["ns_coefficients"]),
                  method=group["ns_method"], dtype=parse_dtype(group["ns_dtype"]), eps=group["eps"],
                  backend=backend)
        return cls(lr=_number(group["lr"]), weight_decay=_number(group["weight_decay"]),
                   momentum=_number(group["momentum"]), nesterov=bool(group["nesterov"]),
                   adjust_lr_fn=group["adjust_lr_fn"], ns=tuple(sorted(ns.items())),
                   max_batch_bytes=max_batch_bytes)

    def orthogonalizer(self) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        """:func:`dmuon.kernels.orthogonalize_by_shape` with these settings."""
        from dmuon.kernels import orthogonalize_by_shape

        kwargs = dict(self.ns)
        if self.max_batch_bytes is not None:
            kwargs["max_batch_bytes"] = self.max_batch_bytes
        return lambda tensors: orthogonalize_by_shape(tensors, **kwargs)


def _frozen(value: Any) -> Any:
    """Lists (per-step coefficient lists) as tuples, recursively: hashable, compared by value."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _number(value: Any) -> Any:
    """A 0-d tensor hyper-parameter as a Python number (a scheduler may write into the tensor)."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


@dataclass(frozen=True, slots=True, kw_only=True)
class MatrixLayout:
    """How the update of one master is cut for Newton-Schulz and scaled by the lr adjustment.

    Attributes:
        full_shape: the whole matrix's ``(rows, cols)`` (that of a tensor-parallel slice), or
            the master's own shape.
        matrix_shape: ``(rows, cols)`` of one Newton-Schulz matrix (:mod:`dmuon.owners.stacks`).
        split: the :class:`dmuon.owners.blocks.Split` of a per-head / split matrix, or ``None``.
        tp_shard_dim, tp_rank, tp_size: the tensor-parallel slice the master is (0/1, or
            ``None``: whole) and this rank's place in the TP group.
    """

    full_shape: tuple[int, ...]
    matrix_shape: tuple[int, ...]
    split: Any = None
    tp_shard_dim: int | None = None
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def lr_shape(self) -> tuple[int, ...]:
        """The shape :func:`adjust_lr` reads: the whole matrix of a TP slice, else one
        Newton-Schulz matrix (each expert of a stack is a matrix of its own)."""
        return self.full_shape if self.tp_shard_dim is not None else self.matrix_shape


def _ns_matrices(t: torch.Tensor, split: Any, matrix_shape: Sequence[int] | None) -> list[torch.Tensor]:
    """Views of ``t``'s Newton-Schulz matrices: the blocks of ``split``, else ``t`` whole when it
    is one matrix of ``matrix_shape`` (or that is ``None``), else a stack's matrices."""
    if split is not None:
        return [t.narrow(split.dim, a, b - a) for a, b in split.bounds()]
    if matrix_shape is None or tuple(t.shape) == tuple(matrix_shape):
        return [t]
    return list(t.reshape(-1, int(matrix_shape[0]), int(matrix_shape[1])).unbind(0))


def split_orthogonalize(splits: Sequence[Any], matrix_shapes: Sequence[tuple[int, int]] | None,
                        ns: Callable[[list[torch.Tensor]], list[torch.Tensor]]
                        ) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """A function: Newton-Schulz of full updates, each cut into the blocks of ``splits[i]`` (or
    the matrices of ``matrix_shapes[i]``), all in one ``ns`` call, results shaped as the updates."""
    def run(updates: list[torch.Tensor]) -> list[torch.Tensor]:
        flat: list[torch.Tensor] = []
        spans = []
        for i, (update, split) in enumerate(zip(updates, splits)):
            pieces = _ns_matrices(update, split, None if matrix_shapes is None else matrix_shapes[i])
            if split is not None and split.dim == 1:
                pieces = [p.contiguous() for p in pieces]
            spans.append((len(flat), len(pieces)))
            flat.extend(pieces)
        out = ns(flat) if flat else []
        result = []
        for update, split, (start, count) in zip(updates, splits, spans):
            part = out[start: start + count]
            if split is not None:
                result.append(torch.cat(part, dim=split.dim))
            elif count == 1 and tuple(part[0].shape) == tuple(update.shape):
                result.append(part[0])
            else:
                result.append(torch.stack(part).view(update.shape))
        return result

    return run


def _apply_split_update_(param: torch.Tensor, update: torch.Tensor, lay: MatrixLayout,
                         hp: MuonHyper) -> None:
    """Decoupled weight decay, then ``param[block] -= adjust_lr(lr, block) * update[block]`` per
    block of ``lay.split``; ``param`` the fp32 master or its TP slice, ``update`` shaped like it."""
    param.mul_(1 - hp.lr * hp.weight_decay)
    dim = lay.split.dim
    offset = 0
    if lay.tp_shard_dim == dim and lay.tp_size > 1:
        offset = chunk_span(int(lay.full_shape[dim]), lay.tp_size, lay.tp_rank)[0]
    length = param.shape[dim]
    for index, (a, b) in enumerate(lay.split.bounds()):
        lo, hi = max(a, offset), min(b, offset + length)
        if lo >= hi:
            continue
        alpha = -adjust_lr(hp.lr, hp.adjust_lr_fn, lay.split.block_shape(index, lay.full_shape))
        param.narrow(dim, lo - offset, hi - lo).add_(
            update.narrow(dim, lo - offset, hi - lo).to(param.dtype), alpha=alpha)


def muon_momentum_(grads: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor],
                   hp: MuonHyper) -> list[torch.Tensor]:
    """Phase 3a: :func:`momentum_update_` of every matrix; returns the Newton-Schulz inputs."""
    return [momentum_update_(g, b, momentum=hp.momentum, nesterov=hp.nesterov) for g, b in zip(grads, bufs)]


def orthogonalize_updates(updates: list[torch.Tensor], layouts: Sequence[MatrixLayout],
                          ns: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> list[torch.Tensor]:
    """Phase 3b, on one rank: :func:`split_orthogonalize` by ``layouts``."""
    return split_orthogonalize([lay.split for lay in layouts], [lay.matrix_shape for lay in layouts],
                               ns)(updates)


def muon_finish_(params: Sequence[torch.Tensor], orthos: Sequence[torch.Tensor],
                 bufs: Sequence[torch.Tensor], layouts: Sequence[MatrixLayout], hp: MuonHyper) -> None:
    """Phase 3c, after Newton-Schulz has read its inputs: :func:`normalize_like_torch_` on
    ``bufs``, then :func:`apply_update_` (or per block of a split) of the fp32 masters ``params``
    (full, a stack or a TP slice; in place) by ``orthos`` (shaped like them)."""
    normalize_like_torch_(bufs, layouts, nesterov=hp.nesterov, eps=dict(hp.ns)["eps"])
    for param, ortho, lay in zip(params, orthos, layouts):
        if lay.split is None:
            apply_update_(param, ortho, lr=hp.lr, weight_decay=hp.weight_decay,
                          adjust_lr_fn=hp.adjust_lr_fn, shape=lay.lr_shape)
        else:
            _apply_split_update_(param, ortho, lay, hp)


@torch.no_grad()
def muon_update_(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_bufs: list[torch.Tensor],
                 hp: MuonHyper, layouts: Sequence[MatrixLayout] | None = None,
                 orthogonalize: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None) -> None:
    """One Muon step (``torch.optim.Muon``'s ``_single_tensor_muon``, Jordan et al. 2024) on the
    matrices one rank owns: :func:`muon_momentum_`, Newton-Schulz, :func:`muon_finish_` (the
    overlapped paths, :mod:`dmuon.owners.overlap`, run the same three split in time).

    ``params``: fp32 masters ``[rows, cols]`` (or ``[k, rows, cols]``, or a TP slice) and
    ``momentum_bufs`` (fp32 or the parameter's dtype), updated in place; ``grads`` their averaged
    gradients; ``layouts`` default every param one whole matrix; ``orthogonalize`` default
    :func:`orthogonalize_updates` (TP passes :func:`dmuon.owners.blocks.tp_orthogonalizer`).
    """
    if not params:
        return
    if layouts is None:  # every master one whole matrix
        layouts = [MatrixLayout(full_shape=tuple(p.shape), matrix_shape=tuple(p.shape[-2:]))
                   for p in params]
    updates = muon_momentum_(grads, momentum_bufs, hp)
    if orthogonalize is None:
        orthos = orthogonalize_updates(updates, layouts, hp.orthogonalizer())
    else:
        orthos = orthogonalize(updates)
    muon_finish_(params, orthos, momentum_bufs, layouts, hp)


def momentum_update_(grad: torch.Tensor, buf: torch.Tensor, *, momentum: float,
                     nesterov: bool) -> torch.Tensor:
    """Muon's momentum step, element-wise (any shard): ``buf.lerp_(grad, 1 - momentum)`` in
    place; returns the Newton-Schulz input, ``grad.lerp(buf, momentum)`` with Nesterov, else
    ``buf`` (``torch.optim.Muon``)."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def normalize_like_torch_(bufs: Sequence[torch.Tensor], layouts: Sequence[MatrixLayout], *,
                          nesterov: bool, eps: float) -> None:
    """What the installed torch's step leaves in the momentum buffers besides the lerp
    (:mod:`dmuon.owners.torch_muon`: torch <= 2.14 divides a bf16 buffer by its norm with
    ``nesterov=False``), per Newton-Schulz matrix.

    RuntimeError for such a buffer that is a TP slice (unreachable: dmuon's TP buffers are fp32).
    """
    semantics = torch_muon.installed()
    for buf, lay in zip(bufs, layouts):
        if not semantics.normalizes_momentum(buf, nesterov):
            continue
        if lay.tp_shard_dim is not None:
            raise RuntimeError(f"dmuon: a bf16 momentum buffer of shape {tuple(buf.shape)} is a "
                               f"tensor-parallel slice; torch {semantics.version} normalizes it "
                               f"whole with nesterov=False. Use fp32 parameters or nesterov=True.")
        for mat in _ns_matrices(buf, lay.split, lay.matrix_shape):
            torch_muon.normalize_momentum_(mat, eps)


def apply_update_(param: torch.Tensor, update: torch.Tensor, *, lr: float, weight_decay: float,
                  adjust_lr_fn: str | None, shape: Sequence[int]) -> None:
    """Decoupled weight decay with the unadjusted lr, then ``param -= adjust_lr(lr) * update``,
    element-wise (full matrix or shard); ``shape`` is the *full* matrix's ``(rows, cols)``."""
    param.mul_(1 - lr * weight_decay)
    param.add_(update.to(param.dtype), alpha=-adjust_lr(lr, adjust_lr_fn, shape))


@torch.no_grad()
def adamw_update_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, torch.Tensor]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step, element-wise, on full, local-shard or DTensor tensors, ``states[i]`` as
    ``torch.optim.AdamW``'s: ``_single_tensor_adam``'s math op for op, one ``torch._foreach_*``
    call per op over the local tensors (no DTensor dispatch)."""
    if not params:
        return
    beta1, beta2 = betas
    for param, state in zip(params, states):
        first_step_state(state, param, use_muon=False)["step"] += 1
    # the step counters are CPU tensors (created above without a device): no GPU sync
    steps = [state["step"].item() for state in states]
    local = [local_tensor(t) for t in params]
    exp_avgs = [local_tensor(state["exp_avg"]) for state in states]
    exp_avg_sqs = [local_tensor(state["exp_avg_sq"]) for state in states]
    local_grads = [local_tensor(g) for g in grads]
    torch._foreach_mul_(local, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, local_grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, local_grads, local_grads, value=1 - beta2)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, [math.sqrt(1 - beta2**step) for step in steps])
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(local, exp_avgs, denoms, [-lr / (1 - beta1**step) for step in steps])

