"""The per-head max attention logit that QK-clip (:mod:`dmuon.qk_clip`) records, recomputed
from an attention call's queries and keys.

For each query head ``h``: the max over (batch, row ``i``, key ``j``) of ``q_i . k_j * scale``
over the kept positions, each logit an fp32 GEMM product, computed a few batch elements at a
time into one cache-sized buffer (docs/history.md, "QK-clip recording cost").
"""

from __future__ import annotations

import math

import torch

#: elements of one chunk of recomputed logits when one batch element alone is larger than this
#: ([batch, heads, rows, keys] fp32): 16 Mi = 64 MiB
_CHUNK_ELEMENTS = 1 << 24
#: logits of one batch chunk: 128 Ki fp32 = 512 KiB, half an EPYC core's 1 MiB L2
_CACHE_ELEMENTS = 1 << 17


def _masked_max_(scores: torch.Tensor, start: int, attn_mask: torch.Tensor | None, is_causal: bool,
                 mask_true_keeps: bool) -> torch.Tensor:
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


def _batch_slice(attn_mask: torch.Tensor | None, first: int, count: int, batch: int) -> torch.Tensor | None:
    """Batch elements ``first: first + count`` of a mask broadcastable to ``[batch, heads,
    rows, keys]`` (a mask without a batch dimension, or with one of size 1, as it is)."""
    if attn_mask is None or attn_mask.dim() < 4 or attn_mask.shape[0] == 1 or count == batch:
        return attn_mask
    return attn_mask[first: first + count]


@torch.no_grad()
def max_logits(query: torch.Tensor, key: torch.Tensor, *, scale: float | None = None,
               attn_mask: torch.Tensor | None = None, is_causal: bool = False,
               mask_true_keeps: bool = True) -> torch.Tensor:
    """Per-query-head max of ``query @ key^T * scale`` over the kept positions, recomputed in
    fp32.

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
    if heads * rows * keys <= _CHUNK_ELEMENTS:
        per = max(1, min(batch, _CACHE_ELEMENTS // max(1, heads * rows * keys)))
        buffer = torch.empty(per, kv, group * rows, keys, device=query.device)
        for first in range(0, batch, per):
            count = min(per, batch - first)
            # grouped-query attention: each key head's query heads in one product, no copy of
            # the keys per query head (query head h reads key head h // group)
            chunk = query[first: first + count].float().reshape(count, kv, group * rows, dim)
            scores = torch.matmul(chunk, key_t[first: first + count], out=buffer[:count])
            scores = scores.view(count, heads, rows, keys)
            if not late:
                scores.mul_(scale)
            mask = _batch_slice(attn_mask, first, count, batch)
            best = torch.maximum(best, _masked_max_(scores, 0, mask, is_causal, mask_true_keeps))
        return best * scale if late else best
    step = max(1, _CHUNK_ELEMENTS // max(1, batch * heads * keys))
    for start in range(0, rows, step):
        chunk = query[:, :, start: start + step].float()
        count = chunk.shape[2]
        scores = torch.matmul(chunk.reshape(batch, kv, group * count, dim), key_t)
        scores = scores.view(batch, heads, count, keys)
        if not late:
            scores.mul_(scale)
        best = torch.maximum(best, _masked_max_(scores, start, attn_mask, is_causal, mask_true_keeps))
    return best * scale if late else best
