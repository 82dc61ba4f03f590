"""``dmuon.Muon``: Muon on the owners' dedicated matrices, AdamW on everything else."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import nn

from dmuon.hooks.dedicate import get_state
from dmuon.owners.tp import TPItem, orthogonalize_tp
from dmuon.owners.update import ADJUST_LR_FNS, adamw_update_, muon_update_, ns_by_shape

NS_METHODS = ("gram", "standard")


def validate_hyperparameters(*, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                             adjust_lr_fn: str | None = None, ns_method: str = "gram",
                             ns_dtype: torch.dtype = torch.float16, adamw_lr: float | None = None,
                             adamw_betas: tuple[float, float] = (0.9, 0.999),
                             ns_coefficients: Any = "polar_express", ns_steps: int = 5,
                             eps: float = 1e-7, adamw_eps: float = 1e-8,
                             adamw_weight_decay: float | None = None, where: str = "") -> None:
    """Check Muon's and AdamW's hyper-parameters once, at construction (not at the first step).

    The one check behind both entry points (``dmuon.Muon(model)`` and the
    ``distributed_config`` path, also per param group) and the baselines. At least as strict as
    ``torch.optim.Muon`` (``lr``, ``momentum``, ``weight_decay`` >= 0) and ``torch.optim.AdamW``
    (``lr``, ``eps``, ``weight_decay`` >= 0, ``betas`` in [0, 1)), and stricter where torch
    lets a NaN through (``nan < 0`` is False): every number must be finite, ``momentum`` in
    [0, 1), ``ns_steps`` an integer >= 1.

    Args:
        lr ... adamw_weight_decay: as :class:`Muon` (``None`` for ``adamw_lr`` /
            ``adamw_weight_decay``: taken from ``lr`` / ``weight_decay``).
        where: names the param group in the message (``"param group 2: "``), or ``""``.

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
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"dmuon: {where}adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
    if ns_method not in NS_METHODS:
        raise ValueError(f"dmuon: {where}ns_method must be one of {NS_METHODS}, got {ns_method!r}")
    if ns_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"dmuon: {where}ns_dtype must be a float dtype, got {ns_dtype}")
    resolve_coefficients(ns_coefficients, ns_steps)


class Muon(torch.optim.Optimizer):
    """Owner-centric Muon for a model passed to :func:`dmuon.dedicate_params`.

    ``param_groups[0]`` holds every dedicated matrix (its fp32 master on the owner, a
    zero-size placeholder elsewhere; identical group layout on every rank, so LR schedulers
    work), ``param_groups[1]`` every other trainable parameter (FSDP2 shards or replicas),
    stepped by AdamW. The update equals ``torch.optim.Muon`` + ``torch.optim.AdamW`` on the
    global batch (Jordan et al. 2024; Loshchilov & Hutter 2019); see :mod:`dmuon.owners.update`.

    Args:
        model: the model given to ``dedicate_params``.
        lr: Muon learning rate; weight decay is applied as ``p *= 1 - lr * weight_decay``.
        weight_decay: decoupled weight decay of the matrices.
        momentum: Muon momentum (``buf.lerp_(grad, 1 - momentum)``).
        nesterov: use ``grad.lerp(buf, momentum)`` as the Newton-Schulz input.
        ns_coefficients: ``"polar_express"`` (default), ``"muon"`` ((3.4445, -4.7750, 2.0315)),
            one ``(a, b, c)`` or a per-step list.
        eps: Frobenius-norm floor of the Newton-Schulz normalization.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"`` (as ``torch.optim.Muon``).
        ns_method: ``"gram"`` (Gram-space, default) or ``"standard"``.
        ns_dtype: iteration dtype: ``torch.float16`` (default), ``torch.bfloat16`` (with
            ``"standard"`` and ``"muon"`` coefficients: ``torch.optim.Muon``'s iteration), or
            ``torch.float32`` (exact-math mode).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW's hyper-parameters for the
            other parameters; ``adamw_lr``/``adamw_weight_decay`` default to ``lr``/``weight_decay``.
        ns_backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see :func:`dmuon.kernels.newton_schulz`).
        max_batch_bytes: cap (bytes) on one same-shape Newton-Schulz batch.

    Raises:
        ValueError: bad hyper-parameters (:func:`validate_hyperparameters`), or
            ``dedicate_params`` not called on ``model``.
        TypeError: a hyper-parameter that is not a number.
    """

    def __new__(cls, model: Any = None, *args: Any, **kwargs: Any) -> "Muon":
        # ``Muon(params, distributed_config=...)``: the hook-free entry point (dmuon.distconfig).
        if cls is Muon and model is not None and not isinstance(model, nn.Module):
            from dmuon.distconfig import ConfiguredMuon

            return super().__new__(ConfiguredMuon)
        return super().__new__(cls)

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = "polar_express",
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_method: str = "gram",
        ns_dtype: torch.dtype = torch.float16,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        ns_backend: str = "auto",
        max_batch_bytes: int = 1 << 30,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"dmuon: Muon takes the model passed to dedicate_params, got {type(model).__name__}"
            )
        validate_hyperparameters(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                 adjust_lr_fn=adjust_lr_fn, ns_method=ns_method, ns_dtype=ns_dtype,
                                 adamw_lr=adamw_lr, adamw_betas=adamw_betas,
                                 ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps,
                                 adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay)
        self.state_ctx = get_state(model)
        self.state_ctx.ensure_bound()
        dedicated = [rec.master for rec in self.state_ctx.records]
        others = [p for p in model.parameters()
                  if id(p) not in self.state_ctx.record_of_master and p.requires_grad]
        muon_group = dict(
            params=dedicated, kind="muon", lr=lr, weight_decay=weight_decay, momentum=momentum,
            nesterov=nesterov, ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, ns_method=ns_method, ns_dtype=ns_dtype,
        )
        adamw_group = dict(
            params=others, kind="adamw", lr=lr if adamw_lr is None else adamw_lr,
            betas=tuple(adamw_betas), eps=adamw_eps,
            weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
        )
        self.ns_backend = ns_backend
        self.max_batch_bytes = max_batch_bytes
        super().__init__([muon_group, adamw_group], defaults={})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step, then the asynchronous publication of the new weights.

        Returns:
            ``closure()``'s value when a closure is given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ctx = self.state_ctx
        with torch.profiler.record_function("dmuon::optimizer_step"):
            for group in self.param_groups:
                if group["kind"] == "muon":
                    self._step_muon(group)
                else:
                    self._step_adamw(group)
        ctx.step_check.after_step()
        ctx.publish_after_step()
        return loss

    def _step_muon(self, group: dict) -> None:
        ctx = self.state_ctx
        params, grads, bufs, recs = [], [], [], []
        for p in group["params"]:
            if p.grad is None or p.numel() == 0:  # placeholders: someone else owns it
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            bufs.append(state["momentum_buffer"])
            recs.append(ctx.record_of_master[id(p)])
        ns_kwargs = dict(steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                         method=group["ns_method"], dtype=group["ns_dtype"], eps=group["eps"],
                         backend=self.ns_backend)
        orthogonalize = ns_by_shape(ns_kwargs, self.max_batch_bytes)
        if ctx.roles.tp is not None:
            local_ns = orthogonalize

            def orthogonalize(updates: list[torch.Tensor]) -> list[torch.Tensor]:
                items = [TPItem(u, r.tp_shard_dim, r.full_shape, r.tp_owner) for u, r in zip(updates, recs)]
                return orthogonalize_tp(items, ctx.roles.tp, local_ns)

        with torch.profiler.record_function("dmuon::newton_schulz"):
            muon_update_(
                params, grads, bufs, lr=group["lr"], weight_decay=group["weight_decay"],
                momentum=group["momentum"], nesterov=group["nesterov"],
                adjust_lr_fn=group["adjust_lr_fn"], ns_kwargs=ns_kwargs,
                shapes=[r.full_shape for r in recs], orthogonalize=orthogonalize,
            )
        ctx.ns_matrices += sum(1 for r in recs if ctx.roles.tp is None or r.tp_owner == ctx.tp_rank)

    def _step_adamw(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        with torch.profiler.record_function("dmuon::adamw"):
            adamw_update_(
                params, [p.grad for p in params], [self.state[p] for p in params],
                lr=group["lr"], betas=group["betas"], eps=group["eps"],
                weight_decay=group["weight_decay"],
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip gradients by the global norm single-process ``clip_grad_norm_`` would compute.

    Call it between ``backward()`` and ``step()``; it clips the averaged gradients *before*
    Newton-Schulz (which is scale-invariant up to ``eps``, so clipping changes Muon's update only
    through momentum, exactly as it does for ``torch.optim.Muon``). Collective over the mesh.

    Args:
        model: the model given to ``dedicate_params``.
        max_norm: largest allowed norm (same unit as the gradients).
        norm_type: p of the p-norm; ``float("inf")`` for the max norm.

    Returns:
        The total norm (0-d fp32 tensor, identical on every rank) before clipping.

    Raises:
        RuntimeError: if ``error_if_nonfinite`` and the norm is nan or inf.
    """
    import torch.distributed as dist

    ctx = get_state(model)
    ctx.ensure_bound()
    norm_type = float(norm_type)
    counted, clipped, replicated = [], [], []  # counted: held by exactly one rank
    for rec in ctx.records:
        if rec.master.grad is None:
            continue
        clipped.append(rec.master.grad)
        # HSDP replicas and TP ranks holding a whole matrix have equal copies: count one.
        if ctx.replicate_rank == 0 and (rec.tp_shard_dim is not None or ctx.tp_rank == 0):
            counted.append(rec.master.grad)
    for p in model.parameters():
        if id(p) in ctx.record_of_master or p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "to_local"):
            clipped.append(g.to_local())
            if _first_replica(g, ctx):
                counted.append(g.to_local())
        else:
            replicated.append(g)
            clipped.append(g)
    device = next((g.device for g in clipped), torch.device("cpu"))
    is_inf = norm_type == float("inf")

    def local(gs: Sequence[torch.Tensor]) -> torch.Tensor:
        if not gs:
            return torch.zeros((), device=device)
        if is_inf:
            return torch.stack([g.detach().abs().max().float() if g.numel() else torch.zeros((), device=device)
                                for g in gs]).max()
        return sum(g.detach().float().abs().pow(norm_type).sum() for g in gs)

    total = local(counted)
    world = ctx.roles.world
    if is_inf:
        total = torch.maximum(total, local(replicated))
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=world)
    else:
        if ctx.rank == 0:  # replicas are identical: count them once
            total = total + local(replicated)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=world)
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"dmuon: the total gradient norm is {total.item()}; refusing to clip")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for g in clipped:
            g.mul_(coef.to(g.dtype))
    return total


def _first_replica(dtensor_grad: torch.Tensor, ctx) -> bool:
    """Whether this rank's local piece of a DTensor is the one to count: coordinate 0 along
    every mesh dimension on which the tensor is replicated, and along the TP / replicate
    dimensions its mesh does not have (an FSDP2 shard on the DP sub-mesh of an FSDP x TP
    model is the same on every TP rank)."""
    mesh = dtensor_grad.device_mesh
    coord = mesh.get_coordinate() or []
    if not all(c == 0 for c, p in zip(coord, dtensor_grad.placements) if p.is_replicate()):
        return False
    names = set(mesh.mesh_dim_names or ())
    if ctx.roles.tp is not None and ctx.roles.tp_name not in names and ctx.tp_rank != 0:
        return False
    return not (ctx.roles.replicate is not None and mesh.ndim == 1 and ctx.replicate_rank != 0)
