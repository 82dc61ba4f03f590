"""QK-clip's recorded max logit, cheaper and the same (issue 46).

:func:`dmuon.qk_clip.max_logits` computes the logits a few batch elements (or rows) at a
time; what it records must be what one fp32 ``Q K^T`` over the whole call gave (the recorder
before, e6e933c) and the float64 formula's, both written here. Checked on the chunk layouts
(one chunk, one batch element per chunk with per-batch masks, row chunks), on the recorder over
the main job's model (SDPA: vision heads, a multi-query backbone with an expanded key head, the
expert's bool block mask), on ``nn.MultiheadAttention``, and under activation checkpointing:
non-reentrant checkpointing's recomputation is not recorded a second time, reentrant
checkpointing's (its first forward runs without gradients) is the one recorded.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

import dmuon.qk_clip as qk_clip
from dmuon.owners.attention import find_attention
from dmuon.train.model import Pi0Policy, PolicyConfig


def _keep(mask, is_causal, mask_true_keeps, shape):
    keep = torch.ones(shape, dtype=torch.bool)
    if is_causal:
        keep &= torch.ones(shape[-2:], dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        keep &= mask if mask_true_keeps else ~mask
    return keep


def one_product_max(q, k, *, scale=None, attn_mask=None, is_causal=False, mask_true_keeps=True, dtype=torch.float32):
    """The whole call's logits in one ``Q K^T`` (the key heads repeated), in ``dtype``: fp32
    as the recorder before computed them, float64 as the formula. Scale, then mask (SDPA's
    order), then the max over (batch, rows, keys)."""
    q = q if q.dim() == 4 else q.unsqueeze(0)
    k = k if k.dim() == 4 else k.unsqueeze(0)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q.to(dtype) @ k.to(dtype).transpose(-1, -2)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        s = s * scale + attn_mask.to(dtype)
    elif scale > 0 and dtype == torch.float32:
        s = s.masked_fill(~_keep(attn_mask, is_causal, mask_true_keeps, s.shape), float("-inf"))
        return s.amax(dim=(0, 2, 3)) * scale  # e6e933c's order: the max, then the scale
    else:
        s = s * scale
    return s.masked_fill(~_keep(attn_mask, is_causal, mask_true_keeps, s.shape), float("-inf")).amax(dim=(0, 2, 3))


CASES = ["none", "gqa", "mqa-expanded", "causal", "bool-per-batch", "padding-per-batch",
         "masked-head", "float-per-batch", "3d", "bf16", "negative-scale"]


def _case(name: str):
    g = torch.Generator().manual_seed(CASES.index(name))
    b, h, t, s, d = 5, 6, 7, 9, 8
    q = torch.randn(b, t, h, d, generator=g).transpose(1, 2)  # a strided view, as models pass
    k = torch.randn(b, s, h, d, generator=g).transpose(1, 2)
    kwargs = {"scale": 0.3}
    if name == "gqa":
        k = k[:, :2]
    elif name == "mqa-expanded":
        k = k[:, :1].expand(-1, h, -1, -1)
    elif name == "causal":
        k = k[:, :, :t]
        kwargs["is_causal"] = True
    elif name in ("bool-per-batch", "masked-head"):
        keep = torch.rand(b, 1, t, s, generator=g) > 0.4
        if name == "masked-head":  # head 2 attends nowhere: -inf, as SDPA's logits there
            keep = keep.expand(b, h, t, s).clone()
            keep[:, 2] = False
        kwargs["attn_mask"] = keep
    elif name == "padding-per-batch":  # True marks a masked key (nn.MultiheadAttention's)
        kwargs.update(attn_mask=torch.rand(b, h, t, s, generator=g) > 0.6, mask_true_keeps=False)
    elif name == "float-per-batch":
        kwargs["attn_mask"] = torch.randn(b, 1, t, s, generator=g)
    elif name == "3d":
        q, k = q[0], k[0]
    elif name == "bf16":
        q, k = q.bfloat16(), k.bfloat16()
    elif name == "negative-scale":
        kwargs["scale"] = -0.3
    return q, k, kwargs


@pytest.mark.parametrize("chunks", ["one", "per-batch-element", "rows"])
@pytest.mark.parametrize("name", CASES)
def test_max_logits_in_chunks_is_the_one_product_max(monkeypatch, name, chunks):
    if chunks == "per-batch-element":
        monkeypatch.setattr(qk_clip, "_CACHE_ELEMENTS", 1)
    elif chunks == "rows":  # a batch element (6 heads x 7 rows x 7-9 keys) over the cap: row chunks
        monkeypatch.setattr(qk_clip, "_CHUNK_ELEMENTS", 200)
    q, k, kwargs = _case(name)
    got = qk_clip.max_logits(q, k, **kwargs)
    before = one_product_max(q.float(), k.float(), **kwargs)
    formula = one_product_max(q.float(), k.float(), **kwargs, dtype=torch.float64)
    assert got.dtype == torch.float32 and got.shape == (q.shape[-3],)
    torch.testing.assert_close(got, before, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.double(), formula, rtol=1e-6, atol=1e-7)
    if name == "masked-head":
        assert got[2] == float("-inf") and torch.isfinite(got[[0, 1, 3, 4, 5]]).all()


def test_max_logits_with_nothing_to_attend_is_minus_inf():
    q, k = torch.randn(2, 3, 0, 4), torch.randn(2, 3, 5, 4)
    assert qk_clip.max_logits(q, k).tolist() == [float("-inf")] * 3
    assert qk_clip.max_logits(k, q).tolist() == [float("-inf")] * 3


class _SDPAReference(TorchFunctionMode):
    """The test's own record: every SDPA call's (query, key, mask, causal)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append((args[0].detach(), args[1].detach(), kwargs.get("attn_mask"),
                               kwargs.get("is_causal", False)))
        return func(*args, **kwargs)


def _small_policy() -> tuple[Pi0Policy, dict]:
    """dmuon.train's policy, shrunk (its attention as the main job's: 2 vision, 2 backbone with
    one key head, 3 expert blocks with the block mask), and a random batch in its format."""
    torch.manual_seed(0)
    cfg = PolicyConfig(image_size=32, d_vis=64, d_model=64, depth=3, d_act=48, act_heads=3)
    b, h = 4, cfg.horizon
    batch = {"images": torch.rand(b, 3, 32, 32), "state": torch.rand(b, cfg.state_dim) * 2 - 1,
             "tokens": torch.randint(2, cfg.vocab_size, (b, cfg.max_tokens)),
             "actions": torch.rand(b, h, cfg.action_dim) * 2 - 1, "noise": torch.randn(b, h, cfg.action_dim),
             "time": torch.rand(b) * 0.9 + 0.1}
    return Pi0Policy(cfg), batch


def _record(model: nn.Module, run, impl=None) -> list[torch.Tensor]:
    """Run ``run()`` with a recorder (its hooks calling ``impl`` where given); each recognized
    module's recorded maxima."""
    layouts = find_attention(model)
    saved = qk_clip.max_logits
    qk_clip.max_logits = impl or saved
    recorder = qk_clip.LogitRecorder(layouts)
    try:
        run()
    finally:
        recorder.remove()
        qk_clip.max_logits = saved
    return [lay.module.__dict__.pop("_dmuon_max_logits") for lay in layouts]


@pytest.mark.parametrize("per_batch_element", [False, True])
def test_recorder_on_the_main_jobs_model_records_the_one_product_max(monkeypatch, per_batch_element):
    if per_batch_element:
        monkeypatch.setattr(qk_clip, "_CACHE_ELEMENTS", 1)
    model, batch = _small_policy()
    recorded = _record(model, lambda: model(batch).backward())
    reference = _SDPAReference()
    with reference:
        model(batch)
    assert len(recorded) == len(reference.calls) == 7
    for got, (q, k, mask, causal) in zip(recorded, reference.calls):
        before = one_product_max(q, k, attn_mask=mask, is_causal=causal)
        formula = one_product_max(q, k, attn_mask=mask, is_causal=causal, dtype=torch.float64)
        torch.testing.assert_close(got, before, rtol=1e-6, atol=0)
        torch.testing.assert_close(got.double(), formula, rtol=1e-6, atol=0)


@pytest.mark.parametrize("padding", [False, True])
def test_recorder_on_multihead_attention_records_the_one_product_max(monkeypatch, padding):
    """``nn.MultiheadAttention``: q and k recomputed from ``in_proj``; a key padding mask is an
    additive per-batch mask there (batch chunks of one element slice it)."""
    monkeypatch.setattr(qk_clip, "_CACHE_ELEMENTS", 1)
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(3, 20, 32)
    pad = torch.zeros(3, 20, dtype=torch.bool)
    pad[1, 15:] = True
    kwargs = {"key_padding_mask": pad} if padding else {}
    (got,) = _record(nn.ModuleDict({"attn": mha}),
                     lambda: mha(x, x, x, need_weights=False, **kwargs)[0].sum().backward())
    q, k, _ = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    q, k = (t.view(3, 20, 4, 8).transpose(1, 2).detach() for t in (q, k))
    keep = ~pad[:, None, None, :] if padding else None
    before = one_product_max(q, k, attn_mask=keep)
    formula = one_product_max(q, k, attn_mask=keep, dtype=torch.float64)
    torch.testing.assert_close(got, before, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.double(), formula, rtol=1e-6, atol=0)


class _Checkpointed(nn.Module):
    """Runs ``inner`` under ``torch.utils.checkpoint`` (the module itself: its hooks run again
    in the recomputation, as with FSDP2's / torchtitan's checkpoint wrappers)."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, *args):
        return checkpoint(self.inner, *args, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_recorder_under_activation_checkpointing(reentrant):
    """Checkpointed blocks record the same maxima as plain ones (bitwise: the same products on
    the same inputs), once per attention call: non-reentrant checkpointing's recomputation (a
    repeat of a forward already recorded) is skipped; reentrant checkpointing's first forward
    runs without gradients, so its recomputation is the one recorded."""
    model, batch = _small_policy()
    calls = []
    original = qk_clip.max_logits

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    plain = _record(model, lambda: model(batch).backward(), counted)
    assert len(calls) == 7
    for blocks in (model.vision.blocks, model.backbone.blocks, model.expert.blocks):
        for i, block in enumerate(blocks):
            blocks[i] = _Checkpointed(block, reentrant)
    calls.clear()
    wrapped = _record(model, lambda: model(batch).backward(), counted)
    assert len(calls) == 7, f"{len(calls)} recomputations for 7 attention calls"
    for got, want in zip(wrapped, plain):
        assert torch.equal(got, want)
