"""QK-clip (MuonClip): after each Muon step, scale the query and key heads whose attention logits
exceeded a threshold ``tau``.

The rule (Kimi Team, "Kimi K2: Open Agentic Intelligence", 2025, MuonClip; grouped-query attention
as Megatron-LM's ``SelfAttention.clip_qk``): ``S_g`` is the largest scaled logit ``q . k * scale``
of key/value group ``g``'s query heads over the step's global batch. A group with ``S_g`` finite
and ``> tau`` has ``eta_g = tau / S_g``; its queries are scaled by ``eta_g ** alpha`` and its keys
by ``eta_g ** (1 - alpha)``, so each of its logits shrinks by exactly ``eta_g``. A group at
``-inf`` / ``inf`` / NaN is skipped and logged.

Scaling the queries (RoPE commutes with it) scales the head's rows of ``W`` and of its bias, or
after a QK-norm the gain instead: the head's slice of a per-head gain, or for a gain shared by the
heads the layer's smallest ``eta``. A gain ``1 + weight`` (Gemma's RMSNorm) is scaled as
``weight <- c * (1 + weight) - 1``.

Maxima are recorded in forward (:class:`LogitRecorder`, or :func:`observe`), MAX-reduced over the
mesh by :meth:`QKClip.prepare`, and applied through the step's frozen :class:`ClipPlan`.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dmuon.comm.collectives import all_reduce, label
from dmuon.owners.attention import AttentionLayout, find_attention
from dmuon.owners.slices import chunk_span, local_rows, local_tensor

logger = logging.getLogger(__name__)

_ATTR = "_dmuon_max_logits"
#: set on every attention module a :class:`QKClip` reads (:func:`watched`)
_WATCH = "_dmuon_qk_clip_watch"
#: pipelining's shape inference (torch >= 2.13) runs a stage with gradients on, on
#: uninitialized inputs: its logits are not the model's
_METADATA_INFERENCE = frozenset({"_forward_metadata_inference", "_backward_metadata_inference"})
#: elements of one chunk of recomputed logits when one batch element alone is larger than this
#: ([batch, heads, rows, keys] fp32): 16 Mi = 64 MiB
_CHUNK_ELEMENTS = 1 << 24
#: logits of one batch chunk: 128 Ki fp32 = 512 KiB, half an EPYC core's 1 MiB L2
_CACHE_ELEMENTS = 1 << 17
_SDPA = F.scaled_dot_product_attention
SOFTMAX = frozenset((F.softmax, torch.softmax, Tensor.softmax))


def _masked_max_(scores: Tensor, start: int, attn_mask: Tensor | None, is_causal: bool,
                 mask_true_keeps: bool) -> Tensor:
    """Per-head max of ``scores`` ``[batch, heads, rows, keys]`` (rows ``start:``), masked in
    place (the caller's own tensor: no second copy of the logits)."""
    rows, keys = scores.shape[-2], scores.shape[-1]
    if is_causal:
        drop = torch.ones(rows, keys, dtype=torch.bool, device=scores.device).triu_(diagonal=start + 1)
        scores.masked_fill_(drop, float("-inf"))
    if attn_mask is not None:
        mask = attn_mask
        if mask.dim() >= 2 and mask.shape[-2] != 1:
            mask = mask[..., start: start + rows, :]
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask if mask_true_keeps else mask, float("-inf"))
        else:
            scores.add_(mask)
    return scores.amax(dim=(0, 2, 3))


@torch.no_grad()
def max_logits(query: Tensor, key: Tensor, *, scale: float | None = None, attn_mask: Tensor | None = None,
               is_causal: bool = False, mask_true_keeps: bool = True) -> Tensor:
    """Per-query-head max of ``query @ key^T * scale`` over the kept positions, recomputed in
    fp32, a few batch elements (or rows) at a time into one cache-sized buffer.

    Args:
        query: ``[batch, heads, rows, dim]`` (or without ``batch``), any float dtype. Not mutated.
        key: ``[batch, kv_heads, keys, dim]``; ``heads % kv_heads == 0`` (query head ``h`` reads
            key head ``h // (heads / kv_heads)``; one key head expanded to every query head is
            read once). Not mutated.
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
    if key.shape[1] > 1 and key.stride(1) == 0:  # one key head expanded to every query head
        key = key[:, :1]
    batch, heads, rows, dim = query.shape
    kv, keys = key.shape[1], key.shape[2]
    group = heads // kv
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    # A positive scale commutes with the max (rounding is monotonic: max(fl(c s)) = fl(c max s)),
    # so the logits are scaled after the max, [heads] numbers instead of every logit; an
    # additive float mask needs the scaled logits.
    late = scale > 0 and (attn_mask is None or attn_mask.dtype == torch.bool)
    key_t = key.float().transpose(-1, -2)  # [batch, kv, dim, keys]
    best = torch.full((heads,), float("-inf"), device=query.device)
    if not batch * rows * keys:  # nothing attended
        return best
    # chunks of `per` batch elements and `step` rows: a cache-sized buffer of logits, or where one
    # batch element's exceed _CHUNK_ELEMENTS, the whole batch a few rows at a time
    if heads * rows * keys <= _CHUNK_ELEMENTS:
        per, step = max(1, min(batch, _CACHE_ELEMENTS // max(1, heads * rows * keys))), rows
    else:
        per, step = batch, max(1, _CHUNK_ELEMENTS // max(1, batch * heads * keys))
    buffer = torch.empty(per * heads * step * keys, device=query.device)
    for first in range(0, batch, per):
        count = min(per, batch - first)
        mask = attn_mask  # a per-batch mask: this chunk's batch elements
        if mask is not None and mask.dim() >= 4 and mask.shape[0] != 1 and count != batch:
            mask = mask[first: first + count]
        for start in range(0, rows, step):
            n = min(step, rows - start)
            # grouped-query attention: each key head's query heads in one product, no copy of
            # the keys per query head (query head h reads key head h // group)
            chunk = query[first: first + count, :, start: start + n].float()
            chunk = chunk.reshape(count, kv, group * n, dim)
            out = buffer[: count * heads * n * keys].view(count, kv, group * n, keys)
            scores = torch.matmul(chunk, key_t[first: first + count], out=out)
            scores = scores.view(count, heads, n, keys)
            if not late:
                scores.mul_(scale)
            best = torch.maximum(best, _masked_max_(scores, start, mask, is_causal, mask_true_keeps))
    return best * scale if late else best


def in_metadata_inference(depth: int = 64) -> bool:
    """Whether the caller runs inside a pipelining stage's metadata inference (a frame named in
    :data:`_METADATA_INFERENCE` within ``depth`` frames up the stack)."""
    if "torch.distributed.pipelining" not in sys.modules:  # no stage ever ran: skip the stack walk
        return False
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name in _METADATA_INFERENCE:
            return True
        frame = frame.f_back
    return False


def _records_now() -> bool:
    """Gradients on, not pipelining's shape inference, and not non-reentrant checkpointing's
    recomputation (a repeat of a recorded forward, known by checkpointing's saved-tensor hooks on
    top of the stack; where unreadable it is recorded twice, harmless to a running max)."""
    if not torch.is_grad_enabled():
        return False
    try:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError, RuntimeError):  # not in this torch: record
        top = None
    if top is not None and getattr(top[0], "__qualname__", "").startswith("_recomputation_hook."):
        return False
    return not in_metadata_inference()


def observe(module: nn.Module, max_logits: Tensor) -> None:
    """Record ``module``'s per-head max attention logits for the next QK-clip, where attention
    runs outside the module's forward (a fused kernel, LeRobot's pi0). Calls accumulate a running
    max until ``opt.step()``; calls during a pipelining stage's shape inference are ignored.

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


def _record(module: nn.Module, max_logits: Tensor) -> None:
    """:func:`observe` without the stack check."""
    value = max_logits.detach().reshape(-1).float()
    old = getattr(module, _ATTR, None)
    if old is None:
        setattr(module, _ATTR, value.clone())
    elif old.shape != value.shape:
        raise ValueError(f"dmuon: qk_clip.observe got {value.numel()} head maxima for "
                         f"{type(module).__name__}, after {old.numel()} earlier in this step.")
    else:
        torch.maximum(old, value.to(old.device), out=old)


class LogitMode(TorchFunctionMode):
    """While active, the attention logits of the torch calls it sees: each
    ``F.scaled_dot_product_attention`` call's per-head max (recomputed, :func:`max_logits`), and
    each softmax over the last dim of a ``[batch, heads, rows, keys]`` tensor (an eager
    attention's softmax input *is* its scaled, masked logits: one ``amax``).

    Args:
        module: where the maxima go (:func:`observe`'s store; softmax inputs of ``heads`` heads
            only); ``None``: each softmax's ``[heads, rows]`` fp32 maxima are appended to
            :attr:`rows` and SDPA calls are not read (LeRobot's joint attention splits the rows).
    """

    def __init__(self, module: nn.Module | None = None, heads: int = 0) -> None:
        super().__init__()
        self.module, self.heads = module, heads
        self.rows: list[Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # every torch call of the forward passes here: keep the common case to two identity tests
        if func is _SDPA and self.module is not None:
            kwargs = kwargs or {}
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            bound = dict(zip(names, args), **kwargs)
            _record(self.module, max_logits(bound["query"], bound["key"], scale=bound.get("scale"),
                                            attn_mask=bound.get("attn_mask"),
                                            is_causal=bool(bound.get("is_causal", False))))
        elif func in SOFTMAX:
            kwargs = kwargs or {}
            x, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else None)
            if isinstance(x, Tensor) and x.dim() == 4 and dim in (-1, 3):
                if self.module is None:
                    self.rows.append(x.detach().amax(dim=(0, 3)).float())
                elif x.shape[1] == self.heads:
                    _record(self.module, x.detach().amax(dim=(0, 2, 3)))
        return func(*args, **kwargs) if kwargs else func(*args)


class LogitRecorder:
    """Forward hooks that record the per-head max logits of ``layouts``' modules when
    :func:`_records_now`: for ``nn.MultiheadAttention`` a pre-hook recomputes ``q k^T / sqrt(d)``
    from its inputs and ``in_proj_*``; other modules run their forward under a :class:`LogitMode`.
    ``local_heads``: per layout, the query heads this rank's forward computes (default: all).
    """

    def __init__(self, layouts: Sequence[AttentionLayout], local_heads: Sequence[int] | None = None) -> None:
        self.handles: list[Any] = []
        counts = list(local_heads) if local_heads is not None else [lay.num_heads for lay in layouts]
        for layout, count in zip(layouts, counts):
            module = layout.module
            if isinstance(module, nn.MultiheadAttention):
                self.handles.append(module.register_forward_pre_hook(self._mha_hook, with_kwargs=True))
                continue
            modes: list[LogitMode] = []

            def enter(mod, args, count=count, modes=modes):
                if _records_now():
                    mode = LogitMode(mod, count)
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


def validate_qk_clip(threshold: Any, alpha: Any) -> None:
    """``threshold``: ``None`` (off) or a finite number > 0; ``alpha`` in [0, 1].

    Raises:
        ValueError: naming the hyper-parameter and its value.
    """
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or not math.isfinite(threshold) or threshold <= 0):
        raise ValueError(f"dmuon: qk_clip_threshold must be None (off) or a finite number "
                         f"> 0 (a max attention logit), got {threshold!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"dmuon: qk_clip_alpha must be in [0, 1] (the query's share of "
                         f"the scaling), got {alpha!r}")


# ``(1 + self.weight`` / ``(1.0 + self.weight`` or ``self.weight... + 1)``: Gemma's RMSNorm family
_ONE_PLUS = re.compile(r"\(\s*1(?:\.0*)?\s*\+\s*self\.weight\b"
                       r"|self\.weight(?:\.\w+\(\))*\s*\+\s*1(?:\.0*)?\s*\)")
_TIMES_WEIGHT = re.compile(r"\bself\.weight\b")


@dataclass(frozen=True, slots=True, kw_only=True)
class Gain:
    """What multiplies a QK-norm's normalized output: ``module``'s ``attrs`` (``("weight",
    "bias")`` for a ``LayerNorm`` with a bias: ``n(x) * w + b`` scales by ``c`` when both do),
    ``[heads * head_dim]`` if ``per_head`` else ``[head_dim]``; ``offset`` 1.0 for a ``1 + weight``
    gain (Gemma's RMSNorm)."""

    module: nn.Module
    attrs: tuple[str, ...]
    per_head: bool
    offset: float = 0.0


def norm_gain(which: str, layout: AttentionLayout, norm: nn.Module, heads: int) -> Gain:
    """The gain of ``layout``'s ``which`` norm (``"q_norm"`` / ``"k_norm"``) over ``heads`` heads,
    ``weight`` or ``1 + weight`` as read from ``torch.nn``'s types or the norm's ``forward`` source.

    Raises:
        ValueError: naming ``which`` and the module: no weight, a weight not ``[head_dim]`` or
            ``[heads * head_dim]``, a norm shared by ``q`` and ``k``, or an unreadable gain.
    """
    weight = norm._parameters.get("weight")
    shape = tuple(weight.shape) if weight is not None else None

    def refuse(why: str) -> ValueError:
        return ValueError(
            f"dmuon: qk_clip_threshold: the {which} of attention module {layout.name!r} "
            f"({type(norm).__name__}) {why}. After a QK-norm, scaling the projection rows changes "
            f"nothing, so QK-clip scales the norm's gain instead. Give the norm a weight "
            f"(elementwise_affine=True / with_scale=True), or leave qk_clip_threshold=None.")

    if layout.q_norm is not None and layout.q_norm is layout.k_norm:
        raise refuse("is the same module as the other QK-norm (one gain cannot take two factors)")
    if weight is None:
        raise refuse("has no weight")
    if len(shape) != 1 or shape[0] not in (layout.head_dim, heads * layout.head_dim):
        raise refuse(f"has a weight of shape {shape}, neither [head_dim] = [{layout.head_dim}] "
                     f"nor [heads * head_dim] = [{heads * layout.head_dim}]")
    per_head = shape[0] != layout.head_dim
    others = sorted(n for n, p in norm.named_parameters(recurse=False) if n != "weight" and p is not None)
    if type(norm) in (nn.RMSNorm, nn.LayerNorm):
        return Gain(module=norm, attrs=("weight", *others), per_head=per_head)
    if others:
        raise refuse(f"has parameters {others} besides its weight (dmuon cannot tell how they "
                     f"enter its output)")
    try:
        source = inspect.getsource(type(norm).forward)
    except (OSError, TypeError):
        raise refuse("has no Python source to read its gain from") from None
    if _ONE_PLUS.search(source):
        return Gain(module=norm, attrs=("weight",), per_head=per_head, offset=1.0)
    if _TIMES_WEIGHT.search(source):
        return Gain(module=norm, attrs=("weight",), per_head=per_head)
    raise refuse("does not read self.weight in its forward (dmuon cannot tell its gain)")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ClipPlan:
    """What one step's QK-clip scales (built by :meth:`QKClip.prepare`).

    Attributes:
        masters: ``{id(record): [rows of this rank's master] fp32}`` on the master's device,
            for every dedicated matrix this rank owns that has rows to scale.
        others: ``(module, attr, factors, offset)`` per other tensor (a bias, a gain, a
            projection left to AdamW: ``module._parameters[attr]``), scaled by every rank on
            its local piece: ``x <- factor * (x + offset) - offset``, ``factors`` ``[full rows]``
            fp32 CPU (``offset`` 1.0 for a ``1 + weight`` gain).
    """

    masters: Mapping[int, Tensor]
    others: tuple[tuple[nn.Module, str, Tensor, float], ...]

    @torch.no_grad()
    def scale_master(self, rec: Any, master: Tensor) -> None:
        """Scale ``master`` (``rec``'s fp32 ``[rows, cols]``, or this TP rank's rows; mutated) by
        the plan's row factors, if it has some for ``rec``."""
        rows = self.masters.get(id(rec))
        if rows is not None and master.numel():
            master.mul_(rows.to(master.device, master.dtype).view(-1, *([1] * (master.dim() - 1))))

    @torch.no_grad()
    def scale_others(self) -> None:
        """Scale the biases, gains and non-dedicated projections, each rank its local piece at
        its global rows (:func:`dmuon.owners.slices.local_rows`)."""
        for module, attr, factors, offset in self.others:
            param = module._parameters.get(attr)
            local = None if param is None else local_tensor(param)
            if local is None or local.numel() == 0:
                continue
            f = factors.index_select(0, local_rows(param).to(factors.device)).to(local.device)
            f = f.view(-1, *([1] * (local.dim() - 1)))
            if offset:
                local.copy_(((local.float() + offset) * f - offset).to(local.dtype))
            else:
                local.mul_(f.to(local.dtype))


def group_etas(maxima: Tensor, nan: Tensor, num_kv_heads: int, tau: float) -> tuple[Tensor, Tensor]:
    """``(eta, skipped)`` per key/value group, both ``[num_kv_heads]``, from ``maxima`` ``[heads]``
    fp32 (``-inf``: unseen) and ``nan`` ``[heads]`` bool: ``eta`` fp64 is ``tau / S_g`` where
    ``S_g`` is finite and ``> tau``, else 1; ``skipped`` where ``S_g`` is ``+-inf`` or NaN."""
    s = maxima.double().view(num_kv_heads, -1).amax(dim=1)
    skipped = nan.view(num_kv_heads, -1).any(dim=1) | ~torch.isfinite(s)
    clip = ~skipped & (s > tau)
    return torch.where(clip, tau / torch.where(clip, s, torch.ones_like(s)), torch.ones_like(s)), skipped


def plan_rows(layout: AttentionLayout, eta: Tensor, alpha: float, gains: Sequence[Gain | None]
              ) -> list[tuple[nn.Module, str, Tensor, float]]:
    """The row factors of one layout's clip: ``(module, attr, [full rows] fp64, offset)`` per
    tensor to scale (a fused weight appears once per side; the caller multiplies them).

    Args:
        eta: ``[num_kv_heads]`` fp64 from :func:`group_etas` (some ``< 1``).
        gains: ``(q gain, k gain)``, ``None`` where that side has no QK-norm.
    """
    out = []
    q_eta, eta_min = eta.repeat_interleave(layout.group), float(eta.min())
    sides = ((layout.q, gains[0], q_eta, alpha), (layout.k, gains[1], eta, 1 - alpha))
    for ref, gain, per_head, power in sides:
        factors = per_head ** power
        if gain is not None:  # after the norm: its gain, per head or the layer's smallest eta
            width = layout.head_dim
            if gain.per_head:
                gain_rows = torch.repeat_interleave(factors, width)
            else:
                gain_rows = torch.full((width,), eta_min ** power, dtype=torch.float64)
            for attr in gain.attrs:
                out.append((gain.module, attr, gain_rows, gain.offset if attr == "weight" else 0.0))
            continue
        rows = torch.ones(ref.rows, dtype=torch.float64)  # the weight's and its bias's rows
        for first, factor in zip(ref.head_rows, factors.tolist()):
            rows[first: first + ref.head_dim] = factor
        out += [(ref.module, attr, rows, 0.0) for attr in (ref.attr, ref.bias) if attr is not None]
    return out


class QKClip:
    """The clip of one model's attention heads on the owner runtime (``ctx``: the model's
    :class:`dmuon.hooks.state.DedicateState`).

    Attributes:
        clipped_heads: query heads in the groups the last step clipped.
        max_logit: the largest finite reduced max logit of the last step.

    Raises:
        ValueError: a model with no recognized attention module; a ``q_norm`` / ``k_norm``
            whose gain cannot be scaled (:func:`norm_gain`); under tensor parallelism, a query
            projection that is not a dedicated matrix, is sharded by columns, or whose TP
            slices cut a head.
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
        self.gains = [(None if lay.q_norm is None else norm_gain("q_norm", lay, lay.q_norm, lay.num_heads),
                       None if lay.k_norm is None else norm_gain("k_norm", lay, lay.k_norm, lay.num_kv_heads))
                      for lay in self.layouts]
        self.local = [self._local_heads(layout) for layout in self.layouts]
        self.recorder = LogitRecorder(self.layouts, [len(heads) for heads in self.local])
        for layout in self.layouts:  # recorders outside this module (observe's callers) ask
            setattr(layout.module, _WATCH, True)
        self.first_step = True  # nothing recorded in the first step is an error
        self.warned: set[str] = set()  # modules whose skipped groups were logged
        self.clipped_heads = 0
        self.max_logit = float("-inf")

    def _tp_span(self, rec: Any) -> tuple[int, int]:
        """``[start, stop)`` of this TP rank's rows of ``rec`` (all of them unless TP shards its rows)."""
        full = int(rec.full_shape[0])
        tp = self.ctx.roles.tp
        if tp is None or rec.tp_shard_dim != 0:
            return 0, full
        return chunk_span(full, dist.get_world_size(tp), dist.get_rank(tp))

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
        start, stop = self._tp_span(rec)
        heads = []
        for h, first in enumerate(ref.head_rows):
            inside = start <= first < stop
            if inside != (start < first + ref.head_dim <= stop):
                raise ValueError(
                    f"dmuon: qk_clip_threshold under tensor parallelism: the TP slice (rows "
                    f"{start}:{stop}) of {rec.fqn!r} cuts query head {h} of {layout.name!r} "
                    f"(rows {first}:{first + ref.head_dim}); shard on head boundaries (heads "
                    f"divisible by the TP size) or leave qk_clip_threshold=None.")
            if inside:
                heads.append(h)
        return tuple(heads)

    def _gather(self) -> tuple[Tensor, Tensor, Tensor]:
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
            all_reduce(flat, dist.ReduceOp.MAX, self.ctx.roles.world,
                       "QK-clip's all-reduce of the max logits")
        flat = flat.cpu()
        heads = sum(layout.num_heads for layout in self.layouts)
        return flat[:heads], flat[heads: 2 * heads] > 0, flat[2 * heads:]

    def _check_recorded(self, recorded: Tensor) -> None:
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
                f"attention is computed outside the module's forward, or they did not run. Where the "
                f"logits are computed, call dmuon.qk_clip.observe(module, max_logits) (per-head maxima, "
                f"[num_heads]: dmuon.qk_clip.max_logits(query, key, ...)), or leave "
                f"qk_clip_threshold=None. Nothing was updated in this step.")
        if missing:
            logger.debug("dmuon: QK-clip: no logits of %s this step (not run); not clipped", missing)

    @torch.no_grad()
    def prepare(self, group: dict) -> ClipPlan | None:
        """Reduce this step's maxima (collective when ``group["qk_clip_threshold"]`` is set) and
        reset them, at the start of ``opt.step()`` before any parameter moves.

        Args:
            group: the Muon param group (``qk_clip_threshold`` ``tau``, ``qk_clip_alpha``).

        Returns:
            The step's frozen :class:`ClipPlan`, or ``None`` when no group clips (or ``tau`` is ``None``).

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
            for module, attr, factors, shift in plan_rows(layout, eta, alpha, gains):
                entry = acc.setdefault((id(module), attr), [module, attr, torch.ones_like(factors), shift])
                entry[2] = entry[2] * factors  # a fused weight: its q and its k rows
        if not acc:
            return None
        masters, others = {}, []
        for module, attr, factors, shift in acc.values():
            rec = self.record_of.get((id(module), attr))
            if rec is None:
                param = module._parameters.get(attr)
                if param is not None and param.requires_grad:  # frozen: no step moves it, nor its clip
                    others.append((module, attr, factors.float(), shift))
            elif rec.is_owner and rec.master.numel():
                start, stop = self._tp_span(rec)  # the master is this TP rank's slice of the rows
                masters[id(rec)] = factors[start:stop].float().to(rec.master.device)
        return ClipPlan(masters=MappingProxyType(masters), others=tuple(others))
