"""QK-clip (MuonClip): after each Muon step, scale the query and key heads whose attention logits
exceeded a threshold.

Kimi Team, "Kimi K2: Open Agentic Intelligence" (2025), MuonClip: for each head ``h`` with max
logit ``S_h`` (the largest ``q_i . k_j * scale`` the head computed over the step's batch),
``eta_h = min(1, tau / S_h)``; the head's query rows are scaled by ``eta_h ** alpha`` and its key
rows by ``eta_h ** (1 - alpha)`` (Kimi: ``alpha = 0.5``), so the head's logits shrink by
``eta_h``.

Grouped-query attention (one key head serves ``G`` query heads): Megatron-LM's rule
(``SelfAttention.clip_qk``, ``megatron/core/transformer/attention.py``): per key/value group
``g``, ``S_g = max`` over its query heads, ``eta_g = min(1, tau / S_g)``; all of the group's
query heads take ``eta_g ** alpha`` and its key head ``eta_g ** (1 - alpha)``. Without GQA this
is Kimi's per-head rule.

Where it runs (dmuon's owner runtime): every forward records each attention module's per-head
max logit (:func:`observe`, or automatically, :class:`LogitRecorder`), as a running max over
the micro-batches of the step; inside ``opt.step()``, after the owners' Muon update, the
per-head maxima are MAX-reduced over the mesh (the stage's ranks), and the owner of each query
/ key weight scales the head rows of its fp32 master before the publication.

Tensor parallelism (q / k projections sharded colwise, ``Shard(0)``, on head boundaries): a TP
rank's attention computes only the query heads whose rows lie in its slice of the query weight,
in head order (Megatron's and torchtitan's layout). Their maxima are placed at their global head
indices (the slice's row offset, from ``torch.chunk``'s sizes, against the layout's head rows),
the other heads left at ``-inf``; the MAX-reduce over the whole mesh (data-parallel and TP ranks)
fills every head. Each TP slice's owner then scales the rows of the heads in its slice.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dmuon.owners.attention import AttentionLayout, find_attention
from dmuon.owners.slices import chunk_sizes

logger = logging.getLogger(__name__)

_ATTR = "_dmuon_max_logits"
#: elements of one chunk of recomputed logits ([batch, heads, rows, keys] fp32): 16 Mi = 64 MiB
_CHUNK_ELEMENTS = 1 << 24


#: ``torch.distributed.pipelining`` (torch >= 2.13) runs one forward (and backward) of each
#: stage with gradients on to infer its shapes, a non-first stage on *uninitialized* inputs
#: (``torch.empty``); logits of those calls are not the model's (torch 2.11 infers under
#: ``no_grad``, which the recorder skips anyway)
_METADATA_INFERENCE = frozenset({"_forward_metadata_inference", "_backward_metadata_inference"})


def in_metadata_inference(depth: int = 64) -> bool:
    """Whether the caller runs inside a pipelining stage's metadata inference (the frames of
    its :data:`_METADATA_INFERENCE` methods, looked for up to ``depth`` frames up the stack:
    a few microseconds, paid once per attention call while QK-clip records)."""
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

    Any attention implementation can call it (a fused kernel that returns its row maxima, say);
    calls accumulate a running max until ``opt.step()`` consumes them.

    Args:
        module: the attention module (as :func:`dmuon.owners.attention.find_attention` finds it).
        max_logits: ``[num_heads]``, any float dtype: each query head's largest scaled logit
            ``q . k * scale`` over the batch (masked positions excluded). Not mutated.

    Calls made while a pipelining stage infers its shapes (:func:`in_metadata_inference`)
    are ignored: that forward runs on uninitialized inputs.
    """
    if not in_metadata_inference():
        _record(module, max_logits)


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


def _masked_max(scores: torch.Tensor, start: int, attn_mask: torch.Tensor | None, is_causal: bool,
                mask_true_keeps: bool) -> torch.Tensor:
    """Per-head max of ``scores`` ``[batch, heads, rows, keys]`` (rows ``start:``), masked."""
    rows, keys = scores.shape[-2], scores.shape[-1]
    if is_causal:
        keep = torch.ones(rows, keys, dtype=torch.bool, device=scores.device).tril(diagonal=start)
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        mask = attn_mask
        if mask.dim() >= 2 and mask.shape[-2] != 1:
            mask = mask[..., start: start + rows, :]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask if mask_true_keeps else mask, float("-inf"))
        else:
            scores = scores + mask
    return scores.amax(dim=(0, 2, 3))


@torch.no_grad()
def max_logits(query: torch.Tensor, key: torch.Tensor, *, scale: float | None = None,
               attn_mask: torch.Tensor | None = None, is_causal: bool = False,
               mask_true_keeps: bool = True) -> torch.Tensor:
    """Per-query-head max of ``query @ key^T * scale``, recomputed in fp32 in row chunks of at
    most ``_CHUNK_ELEMENTS`` logits.

    Args:
        query: ``[batch, heads, rows, dim]`` (or without ``batch``).
        key: ``[batch, kv_heads, keys, dim]``; ``heads % kv_heads == 0`` (query head ``h`` reads
            key head ``h // (heads / kv_heads)``).
        scale: ``None``: ``1 / sqrt(dim)`` (``F.scaled_dot_product_attention``'s default).
        attn_mask: broadcastable to ``[batch, heads, rows, keys]``: bool (``mask_true_keeps``:
            True marks a kept position, as SDPA; else a masked one, as ``nn.MultiheadAttention``)
            or additive float.
        is_causal: top-left causal mask (SDPA's).

    Returns:
        ``[heads]`` fp32 (``-inf`` for a head that attended nowhere).
    """
    if query.dim() == 3:
        query, key = query.unsqueeze(0), key.unsqueeze(0)
    heads, kv = query.shape[1], key.shape[1]
    if heads != kv:
        key = key.repeat_interleave(heads // kv, dim=1)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    keys = key.float().transpose(-1, -2)
    rows = query.shape[2]
    step = max(1, _CHUNK_ELEMENTS // max(1, query.shape[0] * heads * key.shape[2]))
    best = torch.full((heads,), float("-inf"), device=query.device)
    for start in range(0, rows, step):
        scores = torch.matmul(query[:, :, start: start + step].float(), keys) * scale
        best = torch.maximum(best, _masked_max(scores, start, attn_mask, is_causal, mask_true_keeps))
    return best


class _SDPAMode(TorchFunctionMode):
    """Inside one attention module's forward: record the per-head max logits of its
    ``F.scaled_dot_product_attention`` calls (recomputed, :func:`max_logits`) and of its eager
    softmax (the softmax input *is* the scaled, masked logits: one ``amax``)."""

    def __init__(self, module: nn.Module, heads: int) -> None:
        super().__init__()
        self.module, self.heads = module, heads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            bound = dict(zip(names, args), **kwargs)
            _record(self.module, max_logits(bound["query"], bound["key"], scale=bound.get("scale"),
                                            attn_mask=bound.get("attn_mask"),
                                            is_causal=bool(bound.get("is_causal", False))))
        elif func in (F.softmax, torch.softmax, torch.Tensor.softmax):
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if isinstance(x, torch.Tensor) and x.dim() == 4 and dim in (-1, 3) and x.shape[1] == self.heads:
                _record(self.module, x.detach().amax(dim=(0, 2, 3)))
        return func(*args, **kwargs)


class LogitRecorder:
    """Forward hooks that record every recognized attention module's per-head max logits while
    gradients are enabled (training forwards, and activation checkpointing's recomputation,
    which records the same values again), except in a pipelining stage's shape inference
    (:func:`in_metadata_inference`).

    * ``nn.MultiheadAttention``: a pre-hook recomputes ``q k^T / sqrt(d)`` from the module's
      inputs and its ``in_proj_weight`` / ``in_proj_bias`` (one extra ``[L, S]`` product per
      head, in row chunks);
    * any other recognized module: a ``TorchFunctionMode`` around its forward sees its
      ``F.scaled_dot_product_attention`` (recomputed the same way) and eager softmax calls.

    Attention that reaches neither (a fused kernel called directly) calls :func:`observe`.

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
                if torch.is_grad_enabled() and not in_metadata_inference():
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
        if not torch.is_grad_enabled() or in_metadata_inference():
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

    Raises:
        ValueError: a model with no recognized attention module; under tensor parallelism, a
            query projection that is not a dedicated matrix, is sharded by columns, or whose
            TP slices cut a head.
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
        self.local = [self._local_heads(layout) for layout in self.layouts]
        self.recorder = LogitRecorder(self.layouts, [len(heads) for heads in self.local])
        self.warned = False
        self.clipped_heads = 0  # heads with eta < 1 at the last step (for logs and tests)
        self.max_logit = float("-inf")  # the largest reduced max logit of the last step

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
        """Global indices of the query heads this rank's forward of ``layout`` computes, in the
        order it computes them: every head, or under TP the heads whose rows lie in this rank's
        slice of the query weight."""
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

    def _gather(self) -> torch.Tensor:
        device = self.ctx.records[0].compute.device if self.ctx.records else torch.device("cpu")
        parts = []
        for layout, local in zip(self.layouts, self.local):
            seen = getattr(layout.module, _ATTR, None)
            setattr(layout.module, _ATTR, None)
            full = torch.full((layout.num_heads,), float("-inf"), device=device)
            if seen is not None and seen.numel() != len(local):
                raise ValueError(f"dmuon: attention module {layout.name!r} recorded "
                                 f"{seen.numel()} head maxima; this rank computes {len(local)} of "
                                 f"its {layout.num_heads} heads.")
            if seen is not None:  # at their global head indices (a TP rank's are a subset)
                full[list(local)] = seen.to(device)
            parts.append(full)
        flat = torch.cat(parts)
        if dist.is_initialized() and dist.get_world_size(self.ctx.roles.world) > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.ctx.roles.world)
        return flat

    @torch.no_grad()
    def apply(self, group: dict) -> None:
        """Reduce this step's maxima and scale the owned query / key head rows (collective over
        the mesh when ``group["qk_clip_threshold"]`` is set; the maxima are reset either way)."""
        tau = group.get("qk_clip_threshold")
        if tau is None:
            for layout in self.layouts:
                setattr(layout.module, _ATTR, None)
            return
        alpha = float(group.get("qk_clip_alpha", 0.5))
        flat = self._gather().cpu()
        self.clipped_heads = 0
        self.max_logit = float(flat.max()) if flat.numel() else float("-inf")
        offset = 0
        for layout in self.layouts:
            s = flat[offset: offset + layout.num_heads]
            offset += layout.num_heads
            if not torch.isfinite(s).any():
                if not self.warned:
                    logger.warning("dmuon: QK-clip saw no logits of %r this step (not run, or its "
                                   "attention reaches no hook: call dmuon.qk_clip.observe)", layout.name)
                    self.warned = True
                continue
            per_group = s.view(layout.num_kv_heads, layout.group).amax(dim=1)
            eta = torch.clamp(tau / per_group, max=1.0)
            if bool((eta >= 1).all()):
                continue
            self.clipped_heads += int((eta < 1).sum()) * layout.group
            self._scale(layout.q, eta.repeat_interleave(layout.group) ** alpha)
            self._scale(layout.k, eta ** (1 - alpha))

    def _scale(self, ref: Any, factors: torch.Tensor) -> None:
        rec = self.record_of.get((id(ref.module), ref.attr))
        if rec is None or not rec.is_owner or rec.master.numel() == 0:
            return  # not dedicated here, or someone else owns it
        rows = torch.ones(rec.full_shape[0], dtype=torch.float32)
        for start, factor in zip(ref.head_rows, factors.tolist()):
            rows[start: start + ref.head_dim] = factor
        first, count = self._tp_rows(rec)  # the master is this TP rank's slice of the rows
        master = rec.master.data
        master.mul_(rows[first: first + count].to(master.device).view(-1, 1))

    def remove(self) -> None:
        self.recorder.remove()
