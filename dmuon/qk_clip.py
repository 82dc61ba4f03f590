"""QK-clip (MuonClip): after each Muon step, scale the query and key heads whose attention logits
exceeded a threshold ``tau``.

The rule (Kimi K2's MuonClip, with Megatron-LM's grouped-query form) and what it scales are
:mod:`dmuon.owners.qk_plan`'s. This module records each attention module's per-head max logit
over the step's micro-batches (:class:`LogitRecorder`, or :func:`observe`), and at the start of
``opt.step()`` :meth:`QKClip.prepare` MAX-reduces the maxima over the mesh and returns the step's
frozen :class:`dmuon.owners.qk_plan.ClipPlan`. Under tensor parallelism (q / k sharded
``Shard(0)`` on head boundaries) a rank records only its slice's heads, placed at their global
indices (``-inf`` elsewhere) before the reduce.
"""

from __future__ import annotations

import logging
import math
import sys
from types import MappingProxyType
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dmuon.comm.collectives import label
from dmuon.owners.attention import AttentionLayout, find_attention
from dmuon.owners.logit_max import max_logits  # public here too: dmuon.qk_clip.max_logits
from dmuon.owners.qk_plan import ClipPlan, RowScale, group_etas, norm_gain, plan_rows
from dmuon.owners.slices import chunk_sizes

logger = logging.getLogger(__name__)

_ATTR = "_dmuon_max_logits"
#: set on every attention module a :class:`QKClip` reads, while it does (:func:`watched`)
_WATCH = "_dmuon_qk_clip_watch"


#: pipelining's shape inference (torch >= 2.13) runs a stage with gradients on, on
#: uninitialized inputs: its logits are not the model's
_METADATA_INFERENCE = frozenset({"_forward_metadata_inference", "_backward_metadata_inference"})


def in_metadata_inference(depth: int = 64) -> bool:
    """Whether the caller runs inside a pipelining stage's metadata inference (one of
    :data:`_METADATA_INFERENCE` within ``depth`` frames up the stack)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name in _METADATA_INFERENCE:
            return True
        frame = frame.f_back
    return False


def observe(module: nn.Module, max_logits: torch.Tensor) -> None:
    """Record ``module``'s per-head max attention logits for the next QK-clip.

    For attention computed outside the module's forward (a fused kernel, LeRobot's pi0);
    calls accumulate a running max until ``opt.step()`` consumes them. Calls during a
    pipelining stage's shape inference are ignored.

    Args:
        module: the attention module (as :func:`dmuon.owners.attention.find_attention` finds it).
        max_logits: ``[num_heads]`` (this rank's heads under tensor parallelism), any float
            dtype, any device: each query head's largest scaled logit ``q . k * scale`` over
            the batch (masked positions excluded: ``-inf`` for a head that attended nowhere).
            Not mutated.

    Raises:
        ValueError: a head count different from this step's earlier calls for ``module``.
    """
    if not in_metadata_inference():
        _record(module, max_logits)


def watched(module: nn.Module) -> bool:
    """Whether a :class:`QKClip` reads ``module``'s maxima (recorders outside it skip otherwise)."""
    return bool(getattr(module, _WATCH, False))


def _record(module: nn.Module, max_logits: torch.Tensor) -> None:
    """:func:`observe` without the stack check (the recorder's hooks made it once per call)."""
    value = max_logits.detach().reshape(-1).float()
    old = getattr(module, _ATTR, None)
    if old is None:
        setattr(module, _ATTR, value.clone())
    elif old.shape != value.shape:
        raise ValueError(f"dmuon: qk_clip.observe got {value.numel()} head maxima for "
                         f"{type(module).__name__}, after {old.numel()} earlier in this step.")
    else:
        torch.maximum(old, value.to(old.device), out=old)


def in_checkpoint_recomputation() -> bool:
    """Whether the caller runs inside non-reentrant activation checkpointing's recomputation
    (a repeat of a recorded forward), known by checkpointing's saved-tensor hooks on top of the
    stack; ``False`` where unreadable (recording twice is harmless to a running max)."""
    try:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError, RuntimeError):  # not in this torch: record
        return False
    return top is not None and getattr(top[0], "__qualname__", "").startswith("_recomputation_hook.")


def _records_now() -> bool:
    """Gradients on, not non-reentrant checkpointing's recomputation, not pipelining's shape
    inference."""
    return torch.is_grad_enabled() and not in_checkpoint_recomputation() and not in_metadata_inference()


_SDPA = F.scaled_dot_product_attention
SOFTMAX = frozenset((F.softmax, torch.softmax, torch.Tensor.softmax))


def attention_logits(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The input of a :data:`SOFTMAX` call over the last dim of a ``[batch, heads, rows, keys]``
    tensor (an eager attention's scaled, masked logits), else ``None``."""
    x = args[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return x if isinstance(x, torch.Tensor) and x.dim() == 4 and dim in (-1, 3) else None


class _SDPAMode(TorchFunctionMode):
    """Inside one attention module's forward: record the per-head max logits of its
    ``F.scaled_dot_product_attention`` calls (recomputed, :func:`max_logits`) and of its eager
    softmax (the softmax input *is* the scaled, masked logits: one ``amax``)."""

    def __init__(self, module: nn.Module, heads: int) -> None:
        super().__init__()
        self.module, self.heads = module, heads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # every torch call of the module's forward passes here: keep the common case to two
        # identity tests (docs/history.md, "QK-clip recording cost")
        if func is _SDPA:
            kwargs = kwargs or {}
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            bound = dict(zip(names, args), **kwargs)
            _record(self.module, max_logits(bound["query"], bound["key"], scale=bound.get("scale"),
                                            attn_mask=bound.get("attn_mask"),
                                            is_causal=bool(bound.get("is_causal", False))))
        elif func in SOFTMAX:
            kwargs = kwargs or {}
            x = attention_logits(args, kwargs)
            if x is not None and x.shape[1] == self.heads:
                _record(self.module, x.detach().amax(dim=(0, 2, 3)))
        return func(*args, **kwargs) if kwargs else func(*args)


class LogitRecorder:
    """Forward hooks that record every recognized attention module's per-head max logits when
    :func:`_records_now`: for ``nn.MultiheadAttention`` a pre-hook recomputes ``q k^T / sqrt(d)``
    from its inputs and ``in_proj_*``; for other modules a ``TorchFunctionMode`` around the
    forward sees ``F.scaled_dot_product_attention`` (recomputed) and eager softmax calls.

    Args:
        layouts: the model's attention modules.
        local_heads: per layout, the number of query heads this rank's forward computes (its TP
            slice's); ``None``: every layout's ``num_heads``.
    """

    def __init__(self, layouts: Sequence[AttentionLayout], local_heads: Sequence[int] | None = None) -> None:
        self.layouts = list(layouts)
        self.handles: list[Any] = []
        counts = list(local_heads) if local_heads is not None else [lay.num_heads for lay in self.layouts]
        for layout, count in zip(self.layouts, counts):
            module = layout.module
            if isinstance(module, nn.MultiheadAttention):
                self.handles.append(module.register_forward_pre_hook(self._mha_hook, with_kwargs=True))
                continue
            modes: list[_SDPAMode] = []

            def enter(mod, args, count=count, modes=modes):
                if _records_now():
                    mode = _SDPAMode(mod, count)
                    mode.__enter__()
                    modes.append(mode)

            def leave(mod, args, output, modes=modes):
                if modes:
                    modes.pop().__exit__(None, None, None)

            self.handles.append(module.register_forward_pre_hook(enter))
            self.handles.append(module.register_forward_hook(leave, always_call=True))

    @staticmethod
    def _mha_hook(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
        if not _records_now():
            return
        names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
        bound = dict(zip(names, args), **kwargs)
        query, key = bound["query"], bound["key"]
        if not module.batch_first and query.dim() == 3:
            query, key = query.transpose(0, 1), key.transpose(0, 1)
        if query.dim() == 2:
            query, key = query.unsqueeze(0), key.unsqueeze(0)
        e, h = module.embed_dim, module.num_heads
        w = module.in_proj_weight
        b = module.in_proj_bias
        with torch.no_grad():
            q = F.linear(query, w[:e], None if b is None else b[:e])
            k = F.linear(key, w[e: 2 * e], None if b is None else b[e: 2 * e])
            batch = q.shape[0]
            q = q.view(batch, -1, h, module.head_dim).transpose(1, 2)
            k = k.view(batch, -1, h, module.head_dim).transpose(1, 2)
            mask = bound.get("attn_mask")
            if mask is not None and mask.dim() == 3:
                mask = mask.view(batch, h, *mask.shape[-2:])
            pad = bound.get("key_padding_mask")
            if pad is not None:  # True (or -inf) marks a padded key
                pad = pad.view(batch, 1, 1, -1)
                if pad.dtype == torch.bool:
                    pad = torch.zeros(pad.shape, device=q.device).masked_fill(pad, float("-inf"))
                if mask is not None and mask.dtype == torch.bool:
                    mask = torch.zeros(mask.shape, device=q.device).masked_fill(mask, float("-inf"))
                mask = pad if mask is None else mask + pad
            _record(module, max_logits(q, k, attn_mask=mask, mask_true_keeps=False,
                                       is_causal=bool(bound.get("is_causal", False)) and mask is None))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def validate_qk_clip(threshold: Any, alpha: Any, where: str = "") -> None:
    """``threshold``: ``None`` (off) or a finite number > 0; ``alpha`` in [0, 1].

    Raises:
        ValueError: naming the hyper-parameter and its value.
    """
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or not math.isfinite(threshold) or threshold <= 0):
        raise ValueError(f"dmuon: {where}qk_clip_threshold must be None (off) or a finite number "
                         f"> 0 (a max attention logit), got {threshold!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"dmuon: {where}qk_clip_alpha must be in [0, 1] (the query's share of "
                         f"the scaling), got {alpha!r}")


class QKClip:
    """The clip of one model's attention heads on the owner runtime.

    Args:
        model: the model passed to ``dedicate_params``.
        ctx: its :class:`dmuon.hooks.state.DedicateState` (records, groups).

    Attributes:
        clipped_heads: query heads in the groups the last step clipped.
        max_logit: the largest finite reduced max logit of the last step.

    Raises:
        ValueError: a model with no recognized attention module; a ``q_norm`` / ``k_norm``
            whose gain cannot be scaled (:func:`dmuon.owners.qk_plan.norm_gain`); under tensor
            parallelism, a query projection that is not a dedicated matrix, is sharded by
            columns, or whose TP slices cut a head.
    """

    def __init__(self, model: nn.Module, ctx: Any) -> None:
        self.ctx = ctx
        self.layouts = find_attention(model, ctx.records)
        if not self.layouts:
            raise ValueError(
                f"dmuon: qk_clip_threshold is set but {type(model).__name__} has no attention "
                f"module dmuon recognizes (Hugging Face q_proj/k_proj/v_proj, nn.MultiheadAttention, "
                f"torchtitan wq/wk/wv or wqkv; see docs/usage.md). Leave qk_clip_threshold=None.")
        self.record_of = {(id(r.module), r.attr): r for r in ctx.records}
        self.module_names = {id(m): n for n, m in model.named_modules()}
        # QK-norms: their gains are what the clip scales (refused here when it cannot)
        self.gains = [(norm_gain("q_norm", lay, lay.q_norm, lay.num_heads) if lay.q_norm is not None else None,
                       norm_gain("k_norm", lay, lay.k_norm, lay.num_kv_heads) if lay.k_norm is not None else None)
                      for lay in self.layouts]
        self.local = [self._local_heads(layout) for layout in self.layouts]
        self.recorder = LogitRecorder(self.layouts, [len(heads) for heads in self.local])
        for layout in self.layouts:  # recorders outside this module (observe's callers) ask
            setattr(layout.module, _WATCH, True)
        self.first_step = True  # nothing recorded in the first step is an error
        self.warned: set[str] = set()  # modules whose skipped groups were logged
        self.clipped_heads = 0  # query heads in clipped groups at the last step (logs, tests)
        self.max_logit = float("-inf")  # the largest finite reduced max logit of the last step

    def _tp_rows(self, rec: Any) -> tuple[int, int]:
        """``(first row, rows)`` of this TP rank's slice of ``rec`` (the whole matrix unless TP
        shards its rows: ``Shard(0)``, sized as ``torch.chunk``)."""
        full = int(rec.full_shape[0])
        tp = self.ctx.roles.tp
        if tp is None or rec.tp_shard_dim != 0:
            return 0, full
        rank, size = dist.get_rank(tp), dist.get_world_size(tp)
        sizes = chunk_sizes(full, size)
        return sum(sizes[:rank]), sizes[rank]

    def _local_heads(self, layout: AttentionLayout) -> tuple[int, ...]:
        """Global indices of the query heads this rank's forward of ``layout`` computes, in order
        (under TP: the heads whose rows lie in this rank's slice of the query weight)."""
        every = tuple(range(layout.num_heads))
        if self.ctx.roles.tp is None:
            return every
        ref = layout.q
        rec = self.record_of.get((id(ref.module), ref.attr))
        if rec is None:
            raise ValueError(
                f"dmuon: qk_clip_threshold under tensor parallelism maps a TP rank's heads through "
                f"the query projection of attention module {layout.name!r}, which is not a dedicated "
                f"matrix; dedicate it (Muon) or leave qk_clip_threshold=None.")
        if rec.tp_shard_dim is None:
            return every
        if rec.tp_shard_dim != 0 or isinstance(layout.module, nn.MultiheadAttention):
            raise ValueError(
                f"dmuon: qk_clip_threshold under tensor parallelism needs the query projection "
                f"{rec.fqn!r} of {layout.name!r} sharded by rows on head boundaries "
                f"(ColwiseParallel); it is sharded along dim {rec.tp_shard_dim} of "
                f"{type(layout.module).__name__}. Leave qk_clip_threshold=None for this mesh.")
        start, rows = self._tp_rows(rec)
        heads = []
        for h, first in enumerate(ref.head_rows):
            inside = start <= first < start + rows
            if inside != (start < first + ref.head_dim <= start + rows):
                raise ValueError(
                    f"dmuon: qk_clip_threshold under tensor parallelism: the TP slice (rows "
                    f"{start}:{start + rows}) of {rec.fqn!r} cuts query head {h} of {layout.name!r} "
                    f"(rows {first}:{first + ref.head_dim}); shard on head boundaries (heads "
                    f"divisible by the TP size) or leave qk_clip_threshold=None.")
            if inside:
                heads.append(h)
        return tuple(heads)

    def _gather(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's recorded maxima, MAX-reduced over the mesh in one all-reduce, and reset.

        Returns:
            ``maxima`` ``[total heads]`` fp32 CPU (``-inf``: unseen; NaN travels as ``-inf``
            plus a flag), ``nan`` ``[total heads]`` bool, and ``recorded`` ``[layouts]`` fp32:
            0 (nobody recorded the module), 1 (recorded), 2 (a rank recorded a wrong head count).
        """
        device = self.ctx.records[0].compute.device if self.ctx.records else torch.device("cpu")
        maxima, nans, flags = [], [], []
        for layout, local in zip(self.layouts, self.local):
            seen = getattr(layout.module, _ATTR, None)
            setattr(layout.module, _ATTR, None)
            full = torch.full((layout.num_heads,), float("-inf"), device=device)
            nan = torch.zeros(layout.num_heads, device=device)
            flag = 0.0 if seen is None else 1.0 if seen.numel() == len(local) else 2.0
            if flag == 1.0:  # at their global head indices (a TP rank's are a subset)
                seen = seen.to(device)
                full[list(local)] = seen.masked_fill(seen.isnan(), float("-inf"))  # keeps +-inf
                nan[list(local)] = seen.isnan().float()
            maxima.append(full)
            nans.append(nan)
            flags.append(flag)
        flat = torch.cat([*maxima, *nans, torch.tensor(flags, device=device)])
        if dist.is_initialized() and dist.get_world_size(self.ctx.roles.world) > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.ctx.roles.world)
        flat = flat.cpu()
        heads = sum(layout.num_heads for layout in self.layouts)
        return flat[:heads], flat[heads: 2 * heads] > 0, flat[2 * heads:]

    def _check_recorded(self, recorded: torch.Tensor) -> None:
        """Raise (on every rank) when a module recorded a wrong head count, or none in the first
        step; later, a module that did not run is skipped."""
        wrong = {lay.name: f"{len(local)} of {lay.num_heads} heads on rank {getattr(self.ctx, 'rank', '?')}"
                 for lay, local, r in zip(self.layouts, self.local, recorded.tolist()) if r == 2}
        if wrong:
            raise RuntimeError(
                f"dmuon: QK-clip: on some rank, attention module(s) {sorted(wrong)} recorded a number "
                f"of head maxima that is not the number of query heads that rank computes (here: "
                f"{wrong}); dmuon.qk_clip.observe takes [num_heads], the heads of the rank's own "
                f"forward under tensor parallelism.")
        missing = [lay.name for lay, r in zip(self.layouts, recorded.tolist()) if r == 0]
        first, self.first_step = self.first_step, False
        if missing and first:
            raise RuntimeError(
                f"dmuon: qk_clip_threshold is set, but no rank recorded attention logits of "
                f"{missing} in the first optimizer step, so QK-clip could never act on them: their "
                f"attention is computed outside the module's own forward (LeRobot's pi0 / pi05 / "
                f"SmolVLA compute it in functions of their own) or the modules did not run. Where "
                f"the logits are computed, call dmuon.qk_clip.observe(module, max_logits) with the "
                f"attention module and its per-head maxima ([num_heads]; "
                f"dmuon.qk_clip.max_logits(query, key, ...) computes them), or leave "
                f"qk_clip_threshold=None. Nothing was updated in this step.")
        if missing:
            logger.debug("dmuon: QK-clip: no logits of %s this step (not run); not clipped", missing)

    @torch.no_grad()
    def prepare(self, group: dict) -> ClipPlan | None:
        """Reduce this step's maxima and decide the clip, before any parameter moves.

        Call at the start of ``opt.step()`` on every rank of the mesh (collective when
        ``group["qk_clip_threshold"]`` is set; the recorded maxima are reset either way).

        Args:
            group: the Muon param group (``qk_clip_threshold`` ``tau``, ``qk_clip_alpha``).

        Returns:
            The frozen :class:`dmuon.owners.qk_plan.ClipPlan` of this step, or ``None`` when no
            group clips (or the threshold is ``None``).

        Raises:
            RuntimeError: on every rank, a module that recorded no logits in the first step, or
                a wrong number of head maxima.
        """
        tau = group.get("qk_clip_threshold")
        if tau is None:
            for layout in self.layouts:
                setattr(layout.module, _ATTR, None)
            return None
        alpha = float(group.get("qk_clip_alpha", 0.5))
        with label("dmuon::qk_clip_prepare"):
            maxima, nan, recorded = self._gather()
        self._check_recorded(recorded)
        finite = maxima[torch.isfinite(maxima)]
        self.max_logit = float(finite.max()) if finite.numel() else float("-inf")
        self.clipped_heads = 0
        acc: dict[tuple[int, str], list] = {}
        offset = 0
        for layout, gains, seen in zip(self.layouts, self.gains, recorded.tolist()):
            heads = slice(offset, offset + layout.num_heads)
            offset += layout.num_heads
            if not seen:
                continue
            eta, skipped = group_etas(maxima[heads], nan[heads], layout.num_kv_heads, tau)
            if bool(skipped.any()) and layout.name not in self.warned:
                self.warned.add(layout.name)
                logger.warning(
                    "dmuon: QK-clip left KV group(s) %s of %r unscaled: their max logit is -inf "
                    "(every position masked), inf or NaN (head maxima %s). Logged once per module.",
                    skipped.nonzero().flatten().tolist(), layout.name, maxima[heads].tolist())
            if not bool((eta < 1).any()):
                continue
            self.clipped_heads += int((eta < 1).sum()) * layout.group
            for module, attr, factors, shift in plan_rows(layout, eta, alpha, gains, self._rows_of):
                entry = acc.setdefault((id(module), attr), [module, attr, torch.ones_like(factors), shift])
                entry[2] = entry[2] * factors  # a fused weight: its q and its k rows
        if not acc:
            return None
        return self._plan(tau, alpha, acc.values())

    def _rows_of(self, module: nn.Module, attr: str) -> int | None:
        rec = self.record_of.get((id(module), attr))
        if rec is not None:
            return int(rec.full_shape[0])
        param = module._parameters.get(attr)
        return None if param is None else int(param.shape[0])

    def _plan(self, tau: float, alpha: float, entries: Any) -> ClipPlan:
        masters, records, others = {}, [], []
        for module, attr, factors, shift in entries:
            rec = self.record_of.get((id(module), attr))
            if rec is None:
                param = module._parameters.get(attr)
                if param is None or not param.requires_grad:
                    continue  # frozen: no optimizer step moves it, nor does its clip
                name = self.module_names.get(id(module), type(module).__name__)
                others.append(RowScale(fqn=f"{name}.{attr}", module=module, attr=attr,
                                       factors=factors.float(), offset=shift))
            elif rec.is_owner and rec.master.numel():
                first, count = self._tp_rows(rec)  # the master is this TP rank's slice of the rows
                masters[id(rec)] = factors[first: first + count].float().to(rec.master.device)
                records.append(rec)
        return ClipPlan(tau=float(tau), alpha=alpha, masters=MappingProxyType(masters),
                        records=tuple(records), others=tuple(others),
                        clipped_heads=self.clipped_heads, max_logit=self.max_logit)
