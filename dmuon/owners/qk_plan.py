"""QK-clip's plan for one step: which rows of which tensors to scale, and by how much.

The rule (Kimi Team, "Kimi K2: Open Agentic Intelligence", 2025, MuonClip; with grouped-query
attention as Megatron-LM's ``SelfAttention.clip_qk``, ``megatron/core/transformer/attention.py``):
for each key/value group ``g`` of an attention module, ``S_g`` is the largest scaled logit
``q_i . k_j * scale`` its query heads computed over the step's global batch. Only a group with
``S_g`` finite and ``> tau`` is clipped: ``eta_g = tau / S_g``, its query heads' queries are
scaled by ``eta_g ** alpha`` and its key head's keys by ``eta_g ** (1 - alpha)``, so each of its
logits shrinks by exactly ``eta_g``. A group at ``S_g <= tau`` is left alone (``S_g <= 0``
would give a negative ``eta``, ``S_g = -inf`` a zero one); a group at ``-inf`` / ``NaN`` is
skipped (the caller says so).

What "scale the queries" touches depends on what sits between the projection and the logits
(RoPE is linear per head, so it commutes with the scaling):

* nothing, or a bias (``q = W x + b``): the head's rows of ``W`` *and* of ``b``;
* a QK-norm (``q = g * norm(W x)``: Qwen3, Gemma 3, OLMo 2): scaling ``W`` changes nothing
  after the norm, so the gain ``g`` is scaled instead: the head's slice of a per-head gain
  (``[heads * head_dim]``, OLMo 2), or, for a gain shared by the heads (``[head_dim]``, Qwen3,
  Gemma 3), the layer's smallest ``eta`` (``eta_min ** alpha`` on ``q_norm``,
  ``eta_min ** (1 - alpha)`` on ``k_norm``: every head shrinks by at least its own ``eta``).
  A gain of the form ``1 + weight`` (Gemma's RMSNorm) is scaled as a gain:
  ``weight <- c * (1 + weight) - 1``.

The frozen :class:`ClipPlan` is taken at the start of ``opt.step()``. Owners scale their fp32
masters (:meth:`ClipPlan.scale_master`, safe on a worker thread); every rank scales its local
piece of every other tensor at its global rows (:meth:`ClipPlan.scale_others`).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from dmuon.owners.attention import AttentionLayout, WeightRef
from dmuon.owners.slices import local_rows, local_tensor

# ``(1 + self.weight`` / ``(1.0 + self.weight`` or ``self.weight... + 1)``: Gemma's RMSNorm family
_ONE_PLUS = re.compile(r"\(\s*1(?:\.0*)?\s*\+\s*self\.weight\b|self\.weight(?:\.\w+\(\))*\s*\+\s*1(?:\.0*)?\s*\)")
_TIMES_WEIGHT = re.compile(r"\bself\.weight\b")


@dataclass(frozen=True, slots=True, kw_only=True)
class Gain:
    """What multiplies a QK-norm's normalized output, for QK-clip to scale.

    Attributes:
        fqn: the norm's name (``"model.layers.0.self_attn.q_norm"``).
        module: the norm.
        attrs: its parameters to scale: ``("weight",)``, or ``("weight", "bias")`` for a
            ``LayerNorm`` with a bias (``y = n(x) * w + b`` scales by ``c`` when both do).
        per_head: the weight covers every head (``[heads * head_dim]``, one slice per head);
            ``False``: one ``[head_dim]`` weight shared by all heads.
        offset: 1.0 where the gain is ``1 + weight`` (Gemma's RMSNorm), else 0.0.
    """

    fqn: str
    module: nn.Module
    attrs: tuple[str, ...]
    per_head: bool
    offset: float = 0.0


def norm_gain(which: str, layout: AttentionLayout, norm: nn.Module, heads: int) -> Gain:
    """The gain of ``layout``'s ``which`` norm (``"q_norm"`` / ``"k_norm"``) over ``heads`` heads
    of ``layout.head_dim``.

    Whether the gain is ``weight`` or ``1 + weight`` (``Gemma*RMSNorm``) is read from
    ``torch.nn``'s types or from the norm class's ``forward`` source.

    Raises:
        ValueError: naming ``which`` and the module: no weight, a weight not ``[head_dim]`` or
            ``[heads * head_dim]``, a norm shared by ``q`` and ``k``, or an unreadable gain.
    """
    fqn = f"{layout.name}.{which}" if layout.name else which
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
        return Gain(fqn=fqn, module=norm, attrs=("weight", *others), per_head=per_head)
    if others:
        raise refuse(f"has parameters {others} besides its weight (dmuon cannot tell how they "
                     f"enter its output)")
    try:
        source = inspect.getsource(type(norm).forward)
    except (OSError, TypeError):
        raise refuse("has no Python source to read its gain from") from None
    if _ONE_PLUS.search(source):
        return Gain(fqn=fqn, module=norm, attrs=("weight",), per_head=per_head, offset=1.0)
    if _TIMES_WEIGHT.search(source):
        return Gain(fqn=fqn, module=norm, attrs=("weight",), per_head=per_head)
    raise refuse("does not read self.weight in its forward (dmuon cannot tell its gain)")


@dataclass(frozen=True, slots=True, eq=False)
class RowScale:
    """A tensor that is not a dedicated matrix (a bias, a gain, a projection left to AdamW),
    scaled along its dim 0 by every rank on its local piece.

    Attributes:
        fqn: the parameter's name (for messages).
        module, attr: where it lives (``module._parameters[attr]``, read when scaled).
        factors: ``[rows]`` fp32 CPU, one factor per row of the *full* tensor.
        offset: ``x <- factor * (x + offset) - offset`` (1.0 for a ``1 + weight`` gain).
    """

    fqn: str
    module: nn.Module
    attr: str
    factors: Tensor
    offset: float = 0.0


@torch.no_grad()
def scale_rows_(param: Tensor, factors: Tensor, offset: float = 0.0) -> None:
    """Scale ``param``'s local piece in place by ``factors`` (``[full rows]`` fp32) at its
    global rows (:func:`dmuon.owners.slices.local_rows`; a plain tensor: every row); ``offset``
    as :class:`RowScale`'s."""
    local = local_tensor(param)
    if local.numel() == 0:
        return
    f = factors.index_select(0, local_rows(param).to(factors.device)).to(local.device)
    f = f.view(-1, *([1] * (local.dim() - 1)))
    if offset:
        local.copy_(((local.float() + offset) * f - offset).to(local.dtype))
    else:
        local.mul_(f.to(local.dtype))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ClipPlan:
    """What one step's QK-clip scales (built by :meth:`dmuon.qk_clip.QKClip.prepare`).

    Attributes:
        tau: the threshold (a logit); alpha: the query's share.
        masters: ``{id(record): [rows of this rank's master] fp32}`` on the master's device,
            for every dedicated matrix this rank owns that has rows to scale.
        records: those records, for :meth:`scale_all`.
        others: the non-dedicated tensors to scale, on every rank.
        clipped_heads: query heads in clipped groups; max_logit: the largest finite reduced max.
    """

    tau: float
    alpha: float
    masters: Mapping[int, Tensor] = field(default_factory=lambda: MappingProxyType({}))
    records: tuple[Any, ...] = ()
    others: tuple[RowScale, ...] = ()
    clipped_heads: int = 0
    max_logit: float = float("-inf")

    @torch.no_grad()
    def scale_master(self, rec: Any, master: Tensor) -> bool:
        """Scale ``master`` (``rec``'s fp32 ``[rows, cols]``, or this TP rank's rows; mutated) by
        the plan's row factors; ``False`` when the plan has none for ``rec``."""
        rows = self.masters.get(id(rec))
        if rows is None or master.numel() == 0:
            return False
        master.mul_(rows.to(master.device, master.dtype).view(-1, *([1] * (master.dim() - 1))))
        return True

    def scale_others(self) -> None:
        """Scale the biases, gains and non-dedicated projections, each rank its local piece."""
        for item in self.others:
            param = item.module._parameters.get(item.attr)
            if param is not None:
                scale_rows_(param, item.factors, item.offset)

    def scale_all(self) -> None:
        """:meth:`scale_master` on every owned master of the plan, then :meth:`scale_others`."""
        for rec in self.records:
            self.scale_master(rec, rec.master.data)
        self.scale_others()


def group_etas(maxima: Tensor, nan: Tensor, num_kv_heads: int, tau: float) -> tuple[Tensor, Tensor]:
    """Per key/value group ``eta`` and whether the group was skipped.

    Args:
        maxima: ``[heads]`` fp32 reduced per-query-head max logits (``-inf``: none seen).
        nan: ``[heads]`` bool: some rank saw a NaN max for the head.
        num_kv_heads: groups (query head ``h`` is in group ``h // (heads / num_kv_heads)``).
        tau: the threshold.

    Returns:
        ``eta`` ``[num_kv_heads]`` fp64 (``tau / S_g`` where ``S_g`` is finite and ``> tau``,
        else 1) and ``skipped`` ``[num_kv_heads]`` bool (``S_g`` is ``-inf``, ``+inf`` or NaN).
    """
    s = maxima.double().view(num_kv_heads, -1).amax(dim=1)
    skipped = nan.view(num_kv_heads, -1).any(dim=1) | ~torch.isfinite(s)
    clip = ~skipped & (s > tau)
    return torch.where(clip, tau / torch.where(clip, s, torch.ones_like(s)), torch.ones_like(s)), skipped


def _head_factors(rows: int, ref: WeightRef, per_head: Tensor) -> Tensor:
    """``[rows]`` fp64: ``per_head[i]`` on head ``i``'s ``head_dim`` rows of ``ref``, 1 elsewhere."""
    out = torch.ones(rows, dtype=torch.float64)
    for first, factor in zip(ref.head_rows, per_head.tolist()):
        out[first: first + ref.head_dim] = factor
    return out


def plan_rows(layout: AttentionLayout, eta: Tensor, alpha: float, gains: Sequence[Gain | None],
              rows_of: Callable[[nn.Module, str], int | None]) -> list[tuple[nn.Module, str, Tensor, float]]:
    """The row factors of one layout's clip: ``(module, attr, [rows] fp64, offset)`` per tensor
    to scale (a fused weight appears once per side; the caller multiplies them).

    Args:
        eta: ``[num_kv_heads]`` fp64 from :func:`group_etas` (some ``< 1``).
        gains: ``(q gain, k gain)``, ``None`` where that side has no QK-norm.
        rows_of: ``(module, attr) -> full rows`` (a dedicated record's full shape; else the
            tensor's), ``None`` where the module has no such tensor.
    """
    out = []
    q_eta, eta_min = eta.repeat_interleave(layout.group), float(eta.min())
    for ref, gain, per_head, power in ((layout.q, gains[0], q_eta, alpha), (layout.k, gains[1], eta, 1 - alpha)):
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
        for attr in (ref.attr, ref.bias):
            rows = rows_of(ref.module, attr) if attr is not None else None
            if rows is not None:
                out.append((ref.module, attr, _head_factors(rows, ref, factors), 0.0))
    return out
