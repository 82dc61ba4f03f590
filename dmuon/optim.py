"""``dmuon.Muon`` (Muon on the matrices, AdamW on the rest), its owner-runtime strategy
:class:`OwnerUpdate`, and ``dmuon.clip_grad_norm_``."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from dmuon.comm.collectives import label
from dmuon.comm.exchange import orthogonalize_tp
from dmuon.comm.owned_grad import plain
from dmuon.distconfig.config import DistributedConfig
from dmuon.distconfig.optimizer import MUON_KEYS, ConfiguredUpdate, SingleDeviceUpdate, split_param_groups
from dmuon.hooks.dedicate import get_state
from dmuon.hooks.state_dict import OptimizerStateHooks, param_names
from dmuon.owners.blocks import resolve_splits, tp_orthogonalizer, tp_rank_size
from dmuon.owners.clip import clip_by_total_norm_, is_first_copy
from dmuon.owners.overlap import check_overlap, speculate, step_overlapped
from dmuon.owners.update import (
    MatrixLayout,
    MuonHyper,
    adamw_update_,
    first_step_state,
    muon_update_,
    validate_hyperparameters,
)
from dmuon.qk_clip import QKClip, validate_qk_clip


class Muon(torch.optim.Optimizer):
    """Muon for the matrices and AdamW for the rest; the update equals ``torch.optim.Muon`` +
    ``torch.optim.AdamW`` on the global batch (Jordan et al. 2024; Loshchilov & Hutter 2019;
    :mod:`dmuon.owners.update`).

    With a model, ``param_groups[0]`` holds every dedicated matrix (the fp32 master on its owner,
    a zero-size placeholder elsewhere) and ``param_groups[1]`` every other trainable parameter.
    With parameters, each group is marked ``use_muon``
    (:func:`~dmuon.distconfig.optimizer.split_param_groups`).

    Args:
        params: the model given to ``dedicate_params``; or parameters / param groups (dicts
            with ``"params"``; a group may set ``"use_muon"`` and override any hyper-parameter).
        distributed_config: with parameters: how matrices are assigned, gathered and
            redistributed (:class:`dmuon.DistributedConfig`); ``None``: single-device Muon.
            Not accepted with a model (the owner runtime distributes it).
        lr: Muon learning rate; weight decay is applied as ``p *= 1 - lr * weight_decay``.
        weight_decay: decoupled weight decay of the matrices.
        momentum: Muon momentum (``buf.lerp_(grad, 1 - momentum)``).
        nesterov: use ``grad.lerp(buf, momentum)`` as the Newton-Schulz input.
        ns_coefficients: ``"polar_express"`` (default), ``"muon"`` ((3.4445, -4.7750, 2.0315)),
            one ``(a, b, c)`` or a per-step list.
        eps: Frobenius-norm floor of the Newton-Schulz normalization.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: ``None``/``"original"``, ``"match_rms_adamw"`` or ``"spectral_unclamped"``
            (torch>=2.14), as the installed ``torch.optim.Muon`` (:mod:`dmuon.owners.torch_muon`).
        ns_method: ``"gram"`` (Gram-space, default) or ``"standard"``.
        ns_dtype: iteration dtype: ``None`` (:func:`dmuon.kernels.default_ns_dtype`: fp16 on
            CUDA, fp32 on CPU), ``torch.float16``, ``torch.bfloat16`` (with ``"standard"`` and
            ``"muon"``: ``torch.optim.Muon``'s iteration) or ``torch.float32`` (exact math).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW's hyper-parameters for the
            other parameters; ``adamw_lr``/``adamw_weight_decay`` default to ``lr``/``weight_decay``.
        ns_backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see :func:`dmuon.kernels.newton_schulz`).
        max_batch_bytes: cap (bytes) on one same-shape Newton-Schulz batch.
        per_head: orthogonalize the query / key / value projections of the attention modules
            dmuon recognizes one head block at a time (:mod:`dmuon.owners.blocks`; model only).
        split: ``{fqn or parameter: dmuon.Split}`` or a callable ``(fqn, shape) -> Split | None``:
            matrices cut into blocks Newton-Schulz treats separately (wins over ``per_head``).
        qk_clip_threshold: QK-clip (MuonClip) threshold ``tau`` on the per-head max attention
            logit (:mod:`dmuon.qk_clip`); ``None``: off. A param-group hyper-parameter; model only.
        qk_clip_alpha: the query's share of the clip (``eta ** alpha`` on q, ``eta ** (1 - alpha)``
            on k).
        overlap: model only: ``"off"`` (Newton-Schulz inside ``step()``), ``"forward"`` (behind
            the next forward) or ``"backward"`` (also speculated at the end of backward, kept only
            when bit-for-bit valid); see :mod:`dmuon.owners.overlap`.

    Attributes:
        strategy: :class:`OwnerUpdate` (a model), ``ConfiguredUpdate`` (``distributed_config``) or
            ``SingleDeviceUpdate``.

    Raises:
        ValueError: bad hyper-parameters (:func:`validate_hyperparameters`, also per param
            group), ``dedicate_params`` not called on the model, a model with a
            ``distributed_config``, a bad ``distributed_config``, no parameters, or a bad
            ``assign_fn`` result.
        TypeError: a hyper-parameter that is not a number, or ``params`` of neither kind.
        RuntimeError: ranks computed different ``assign_fn`` assignments.
    """

    def __init__(
        self,
        params: Any,
        *,
        distributed_config: DistributedConfig | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = "polar_express",
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_method: str = "gram",
        ns_dtype: torch.dtype | None = None,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        ns_backend: str = "auto",
        max_batch_bytes: int = 1 << 30,
        per_head: bool = False,
        split: Any = None,
        qk_clip_threshold: float | None = None,
        qk_clip_alpha: float = 0.5,
        overlap: str = "off",
    ) -> None:
        validate_qk_clip(qk_clip_threshold, qk_clip_alpha)
        check_overlap(overlap)
        muon_defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                             ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                             adjust_lr_fn=adjust_lr_fn, ns_method=ns_method, ns_dtype=ns_dtype)
        validate_hyperparameters(**{k: muon_defaults[k] for k in MUON_KEYS}, adamw_lr=adamw_lr,
                                 adamw_betas=adamw_betas, adamw_eps=adamw_eps,
                                 adamw_weight_decay=adamw_weight_decay)
        adamw_defaults = dict(lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas),
                              eps=adamw_eps,
                              weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay)
        if isinstance(params, nn.Module):
            if distributed_config is not None:
                raise ValueError(
                    f"dmuon: Muon got a model ({type(params).__name__}) and a distributed_config; "
                    f"a model passed to dedicate_params is distributed by dmuon's owner runtime. "
                    f"Pass the model alone, or its parameters with the distributed_config.")
            muon_defaults.update(qk_clip_threshold=qk_clip_threshold, qk_clip_alpha=qk_clip_alpha)
            groups = OwnerUpdate.param_groups(params, muon_defaults, adamw_defaults)
        elif per_head or split is not None or qk_clip_threshold is not None or overlap != "off":
            raise ValueError(
                "dmuon: per_head, split, qk_clip_threshold and overlap need the owner runtime (the "
                "model passed to dedicate_params: dmuon.Muon(model, ...)); the parameter / "
                "distributed_config path does not support them. Pass the model, or leave them off "
                "(overlap='off').")
        elif params is None or isinstance(params, (str, bytes)):
            raise TypeError(f"dmuon: Muon takes the model passed to dedicate_params, or parameters "
                            f"/ param groups; got {type(params).__name__}")
        else:
            if distributed_config is not None and not isinstance(distributed_config, DistributedConfig):
                raise ValueError(f"dmuon: distributed_config must be a DistributedConfig or None; "
                                 f"got {type(distributed_config).__name__}")
            groups = split_param_groups(params, muon_defaults, adamw_defaults)
        self.overlap = overlap
        self.ns_backend = ns_backend
        self.max_batch_bytes = max_batch_bytes
        super().__init__(groups, defaults={})
        self.distributed_config = distributed_config
        if isinstance(params, nn.Module):
            self.strategy: Any = OwnerUpdate(self, params, per_head=per_head, split=split,
                                             qk_clip=qk_clip_threshold is not None)
            self.state_ctx = self.strategy.state
            # torch's state-dict utilities see plain param_groups and momentum laid out like
            # the parameters (the other strategies install their own)
            self._state_dict_handles = OptimizerStateHooks(self, self.state_ctx).install()
        elif distributed_config is None:
            self.strategy = SingleDeviceUpdate(self)
        else:
            self.strategy = ConfiguredUpdate(self, distributed_config)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; returns ``closure()``'s value when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.strategy.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:  # an absent gradient (dmuon.comm.owned_grad) stands for None
            for group in self.param_groups:
                for p in group["params"]:
                    if getattr(p.grad, "dmuon_absent", False):
                        p.grad = None
        super().zero_grad(set_to_none=set_to_none)

    def overlap_stats(self) -> dict[str, int]:
        """``{"kept": int, "recomputed": int}``: speculative Newton-Schulz results of
        ``overlap="backward"`` that ``step()`` used or recomputed, summed over steps (zeros for
        other modes and strategies)."""
        if isinstance(self.strategy, OwnerUpdate):
            return self.strategy.state.pending.stats()
        return {"kept": 0, "recomputed": 0}

    def wait_pending(self) -> None:
        """Block until every owner update an overlapped ``step()`` scheduled has finished; needed
        only to read a master directly before the next forward (dmuon's own APIs wait).

        Raises:
            RuntimeError: an update failed on dmuon's worker thread (naming the matrices).
        """
        if isinstance(self.strategy, OwnerUpdate):
            self.strategy.state.settle_pending()


class OwnerUpdate:
    """The owner runtime's update: Muon on the masters this rank owns (TP matrices through their
    TP owner), AdamW on the other parameters, then the publication of the new weights. ``per_head``
    / ``split`` go through :func:`dmuon.owners.blocks.resolve_splits`; ``qk_clip`` installs a
    :class:`dmuon.qk_clip.QKClip`."""

    def __init__(self, opt: torch.optim.Optimizer, model: nn.Module, *, per_head: bool = False,
                 split: Any = None, qk_clip: bool = False) -> None:
        self.opt, self.model = opt, model
        self.state = state = get_state(model)
        self.overlap = getattr(opt, "overlap", "off")
        pending = state.pending

        def wait(*args: Any, **kwargs: Any) -> None:
            state.settle_pending()

        def wait_and_forget(*args: Any, **kwargs: Any) -> None:
            state.settle_pending()
            pending.clear_speculations()  # new momentum buffers: nothing speculated stays

        # no optimizer state is read or written while an overlapped update is pending
        opt.register_state_dict_pre_hook(wait)
        opt.register_load_state_dict_pre_hook(wait_and_forget)
        if self.overlap != "off" and state.roles.tp is not None:
            warnings.warn(
                f"dmuon: Muon(overlap={self.overlap!r}) has no effect on this tensor-parallel model: "
                f"its Newton-Schulz runs through collectives over the TP group, which cannot run "
                f"on a second thread beside the main thread's; each step runs as with overlap='off'.",
                stacklevel=3)
        if self.overlap == "backward":
            state.backward.speculator = self
        self.splits: dict[int, Any] = {}  # id(record) -> Split
        if per_head or split is not None:
            self.splits = resolve_splits(model, state.records, per_head=per_head, split=split)
        self.qk_clip = QKClip(model, state) if qk_clip else None

    @staticmethod
    def param_groups(model: nn.Module, muon_defaults: dict, adamw_defaults: dict) -> list[dict]:
        """``[muon group (every dedicated master), adamw group (every other trainable parameter)]``,
        keyed ``kind``; binds the model's matrices if not done yet.

        Raises:
            ValueError: ``dedicate_params`` was not called on ``model``.
        """
        state = get_state(model)
        state.ensure_bound()
        dedicated = [rec.master for rec in state.records]
        others = [p for p in model.parameters() if p not in state.record_of_master and p.requires_grad]
        return [dict(params=dedicated, kind="muon", param_names=param_names(model, dedicated, state),
                     **muon_defaults),
                dict(params=others, kind="adamw", param_names=param_names(model, others), **adamw_defaults)]

    def step(self) -> None:
        """QK-clip's maxima (before anything changes), Muon then AdamW, the clip's scaling,
        then the step check and the publication.

        Raises:
            RuntimeError: before any parameter changes: a gradient never reduced to its owner
                (:meth:`dmuon.hooks.backward.ReduceToOwners.check_reduced`), ``fully_shard``
                run after binding (:meth:`DedicateState.check_not_sharded_since_binding`), or
                QK-clip recorded no logits of an attention layer (:mod:`dmuon.qk_clip`).
        """
        state = self.state
        state.pending.wait_for(list(state.pending.jobs))  # the previous step's
        state.pending.retire_speculation()  # the last backward's that finished (overlap="backward")
        state.check_not_sharded_since_binding("the first opt.step()")
        state.backward.check_reduced()
        state.publisher.adopt_forward_order()  # first step: jobs and prefetch in execution order
        # QK-clip's reduce and checks before anything moves (an error loses nothing)
        clip = self.qk_clip.prepare(self.opt.param_groups[0]) if self.qk_clip is not None else None
        with label("dmuon::optimizer_step"):
            for group in self.opt.param_groups:
                if group["kind"] == "muon":
                    self.step_muon(group, clip)
                else:
                    self.step_adamw(group)
            if clip is not None:  # biases and QK-norm gains (FSDP2 shards), after AdamW
                with label("dmuon::qk_clip"):
                    clip.scale_others()
        state.publish_after_step()
        # after the publications: under FSDP2 this issues the next forward's step check, which
        # publish_after_step's settle() would otherwise wait for at once
        state.step_check.after_step()

    @property
    def overlaps(self) -> bool:
        """Whether Newton-Schulz runs behind the next forward (not under TP: it is collective there)."""
        return self.overlap != "off" and self.state.roles.tp is None

    def _owned(self, group: dict) -> list[tuple]:
        """``(master, grad, momentum buffer, record)`` of every master of ``group`` this rank owns
        that has a gradient (as ``torch.optim.Muon`` skips ``grad=None``)."""
        items = []
        for p in group["params"]:
            if p.grad is None or p.numel() == 0 or getattr(p.grad, "dmuon_absent", False):
                continue
            buf = first_step_state(self.opt.state[p], p, use_muon=True)["momentum_buffer"]
            items.append((p, plain(p.grad), buf, self.state.record_of_master[p]))
        return items

    def layout(self, rec: Any) -> MatrixLayout:
        """``rec``'s Newton-Schulz matrix shape, split and tensor-parallel slice."""
        tp = self.state.roles.tp
        rank, size = tp_rank_size(tp)  # (0, 1) without TP
        return MatrixLayout(full_shape=tuple(rec.full_shape), split=self.splits.get(id(rec)),
                            matrix_shape=tuple(rec.matrix_shape if tp is None else rec.full_shape),
                            tp_shard_dim=None if tp is None else rec.tp_shard_dim, tp_rank=rank, tp_size=size)

    def hyper(self, group: dict) -> MuonHyper:
        """The Muon group's hyper-parameters, frozen now."""
        return MuonHyper.of(group, backend=self.opt.ns_backend, max_batch_bytes=self.opt.max_batch_bytes)

    @torch.no_grad()
    def speculate(self) -> None:
        """:func:`dmuon.owners.overlap.speculate` on the owned matrices (end of a synced backward)."""
        if not self.overlaps:
            return
        for group in self.opt.param_groups:
            if group["kind"] == "muon":
                items = self._owned(group)
                speculate(self.state.pending, self.hyper(group), items, [self.layout(i[3]) for i in items])

    @torch.no_grad()
    def speculate_early(self, averages: dict) -> None:
        """Speculate from ``averages`` (``{record: fp32 average}``) once a bucket's reduce-to-owner
        completed, for the matrices that have a momentum buffer."""
        if not self.overlaps:
            return
        group = next(g for g in self.opt.param_groups if g["kind"] == "muon")
        bufs = {rec: self.opt.state.get(rec.master, {}).get("momentum_buffer") for rec in averages}
        items = [(rec.master, avg, bufs[rec], rec) for rec, avg in averages.items() if bufs[rec] is not None]
        if items:
            speculate(self.state.pending, self.hyper(group), items, [self.layout(i[3]) for i in items],
                      early=True)

    def step_muon(self, group: dict, clip: Any = None) -> None:
        """Muon on the masters of ``group`` this rank owns, then ``clip``'s scaling of their rows."""
        state = self.state
        hp = self.hyper(group)
        items = self._owned(group)
        layouts = [self.layout(item[3]) for item in items]
        scale = clip.scale_master if clip is not None else None
        if self.overlaps:
            pubs = list(dict.fromkeys(g for unit in state.units for g in unit.groups if g.is_owner))
            with label("dmuon::schedule_newton_schulz"):
                step_overlapped(state.pending, hp, items, layouts, pubs, scale)
            return
        params, grads, bufs, recs = (list(x) for x in zip(*items)) if items else ([], [], [], [])
        orthogonalize = None
        if state.roles.tp is not None:  # through the TP owners (collective over the TP group)
            orthogonalize = tp_orthogonalizer(recs, [lay.split for lay in layouts], state.roles.tp,
                                              hp.orthogonalizer(), orthogonalize_tp)
        with label("dmuon::newton_schulz"):
            muon_update_(params, grads, bufs, hp, layouts, orthogonalize)
            if scale is not None:
                for rec, param in zip(recs, params):
                    scale(rec, param)

    def step_adamw(self, group: dict) -> None:
        """AdamW on ``group`` (FSDP2 shards or replicas), element-wise."""
        params = [p for p in group["params"] if p.grad is not None]
        with label("dmuon::adamw"):
            adamw_update_(
                params, [p.grad for p in params], [self.opt.state[p] for p in params],
                lr=group["lr"], betas=group["betas"], eps=group["eps"],
                weight_decay=group["weight_decay"],
            )


def unwrap_optimizer(opt: Any) -> Any:
    """The optimizer inside wrappers that hold it as ``.optimizer`` (Accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``), followed until a
    :class:`Muon` (or something without ``.optimizer``); anything else is returned unchanged."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        inner = getattr(opt, "optimizer", None)
        if isinstance(opt, Muon) or not isinstance(inner, torch.optim.Optimizer):
            return opt
        opt = inner
    return opt


def clip_grad_norm_(model_or_optimizer: nn.Module | Muon, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip gradients by the global norm single-process ``clip_grad_norm_`` would compute (between
    ``backward()`` and ``step()``). Collective; the math is :func:`dmuon.owners.clip.clip_by_total_norm_`.

    Args:
        model_or_optimizer: the model given to ``dedicate_params``, or a :class:`Muon` (any
            strategy, or a wrapper holding it as ``.optimizer``: :func:`unwrap_optimizer`;
            with ``distributed_config`` pass the optimizer: the norm covers its parameters,
            and plain non-matrix tensors are taken for replicas, as DDP holds them).
        max_norm: largest allowed norm (same unit as the gradients).
        norm_type: p of the p-norm; ``float("inf")`` for the max norm.
        error_if_nonfinite: raise instead of clipping by a nan/inf norm.

    Returns:
        The total norm (0-d fp32 tensor, identical on every rank) before clipping.

    Raises:
        RuntimeError: if ``error_if_nonfinite`` and the norm is nan or inf.
        ValueError: a model not passed to ``dedicate_params``, one pipeline stage of several
            (its norm is not the model's), or (``distributed_config``) a plain Muon matrix
            whose layout the config does not record.
        TypeError: neither a model nor a :class:`Muon`.
    """
    model_or_optimizer = unwrap_optimizer(model_or_optimizer)
    if isinstance(model_or_optimizer, Muon):
        strategy = model_or_optimizer.strategy
        if not isinstance(strategy, OwnerUpdate):
            return strategy.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        model_or_optimizer = strategy.model
    if not isinstance(model_or_optimizer, nn.Module):
        raise TypeError(f"dmuon: clip_grad_norm_ takes the model passed to dedicate_params or a "
                        f"dmuon.Muon; got {type(model_or_optimizer).__name__}")
    model = model_or_optimizer
    state = get_state(model)
    state.ensure_bound()
    # no wait for overlapped work: it writes masters, buffers and its own copies, never a gradient
    if state.roles.pp_size > 1:
        # the norm of one stage is not the model's: refuse rather than clip by it
        raise ValueError(
            f"dmuon: clip_grad_norm_ covers one model's gradients, and this model is one pipeline "
            f"stage of {state.roles.pp_size} ('pp' mesh dimension): its norm is not the whole "
            f"model's. Compute each stage's norm (torch.linalg.vector_norm over its gradients, "
            f"all-reduced within the stage's data-parallel group) and combine them over the 'pp' "
            f"group, as torchtitan's dist_utils.clip_grad_norm_ does.")
    counted, clipped, replicated = [], [], []  # counted: held by exactly one rank
    world = dist.get_process_group_ranks(state.roles.world)
    for rec in state.records:
        grad = plain(rec.master.grad)  # the local tensor: a shown grad's pieces are records too
        if grad is None or getattr(rec.master.grad, "dmuon_absent", False):  # absent: None
            continue
        clipped.append(grad)
        # HSDP replicas and TP ranks holding a whole matrix have equal copies: count one.
        if state.replicate_rank == 0 and (rec.tp_shard_dim is not None or state.tp_rank == 0):
            counted.append(grad)
    for p in model.parameters():
        if p in state.record_of_master or p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "to_local"):
            clipped.append(g.to_local())
            if is_first_copy(g, world):
                counted.append(g.to_local())
        else:
            replicated.append(g)
            clipped.append(g)
    return clip_by_total_norm_(counted, clipped, max_norm=max_norm, norm_type=norm_type,
                               error_if_nonfinite=error_if_nonfinite, group=state.roles.world,
                               replicated=replicated, count_replicated=state.rank == 0)

