"""QK-clip does what it says on the attention users have (issue 45), against references written
from the formulas in tests/qk_clip_cases.py:

* a clip-only step (every learning rate and weight decay 0) brings the same batch's max logit to
  tau, whatever sits between the projection and the logits: nothing (Llama), q/k biases (Qwen2,
  ``nn.MultiheadAttention``), a QK-norm (Qwen3 per head dim, OLMo 2 over all heads, Gemma 3 with
  its ``1 + weight`` gain);
* Kimi K2's rule acts only where a group's max S is finite and above tau (S <= 0 gave NaN
  weights, S = -inf zeroed rows);
* a threshold on a model whose attention records nothing is an error on every rank, before any
  parameter moves; ``per_head`` with no attention is an error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests import qk_clip_cases as qc

pytest.importorskip("transformers")


def _check_clip_only(out: list[dict]) -> None:
    for rank_out in out:
        assert rank_out["nonfinite"] == [], rank_out["nonfinite"]
    first = out[0]
    before, after, tau = np.array(first["before"]), np.array(first["after"]), first["tau"]
    assert before.max() > tau and before.max(axis=1).min() > tau  # every layer had to clip
    assert after.max() <= tau * (1 + qc.TAU_RTOL), (after.max(), tau)
    # and not more than that: the largest group lands on tau (its logits scale by exactly eta)
    assert after.max() >= tau * (1 - 1e-4), (after.max(), tau)
    for rank_out in out[1:]:  # the maxima are MAX-reduced: every rank saw the same
        assert rank_out["after"] == first["after"]


@pytest.mark.compat
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mha"])
def test_clip_only_step_reaches_tau_under_fsdp2(dist_pool, kind):
    out = dist_pool.run(2, "tests.qk_clip_cases:clip_only", dict(kind=kind), timeout_s=180)
    _check_clip_only(out)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mha", "olmo2", "gemma3"])
def test_clip_only_step_reaches_tau_on_one_rank(dist_pool, kind):
    """One rank, the plain replicated path (biases and gains are plain tensors there)."""
    out = dist_pool.run(1, "tests.qk_clip_cases:clip_only", dict(kind=kind, fsdp=False, alpha=0.3),
                        timeout_s=180)
    _check_clip_only(out)


@pytest.mark.compat
@pytest.mark.parametrize("world_size,fsdp", [(2, True), (1, False)])
def test_groups_at_or_below_zero_and_at_minus_inf_are_left_alone(dist_pool, world_size, fsdp):
    """KV group 0's max is < 0, group 1's is -inf (masked everywhere), group 2's is large:
    only group 2's q/k rows and biases move, by exactly eta ** alpha / eta ** (1 - alpha)."""
    out = dist_pool.run(world_size, "tests.qk_clip_cases:degenerate_groups", dict(fsdp=fsdp),
                        timeout_s=180)
    first = out[0]
    maxima = np.array(first["maxima"])
    assert (maxima[:, :2] < 0).all() and np.isneginf(maxima[:, 2:4]).all()
    assert (maxima[:, 4:].max(axis=1) > first["tau"]).all()
    for name, want in first["want"].items():
        got = first["after"][name]
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)
    # the groups at <= 0 and -inf: bit for bit as before
    for layer in range(2):
        q = f"layers.{layer}.self_attn.q_proj.weight"
        k = f"layers.{layer}.self_attn.k_proj.weight"
        np.testing.assert_array_equal(first["after"][q][:4 * qc.HEAD_DIM], first["before"][q][:4 * qc.HEAD_DIM])
        np.testing.assert_array_equal(first["after"][k][:2 * qc.HEAD_DIM], first["before"][k][:2 * qc.HEAD_DIM])
        assert not np.array_equal(first["after"][q], first["before"][q])  # group 2 clipped
    assert any("-inf" in m and "layers.0.self_attn" in m for m in first["messages"]), first["messages"]


@pytest.mark.compat
def test_nothing_recorded_is_an_error_on_every_rank(dist_pool):
    """Attention computed outside the attention module's forward (LeRobot pi0's VLM layers):
    every rank raises in the first step, before any parameter moves, naming the layers and
    dmuon.qk_clip.observe; with observe() called where the logits are computed, it clips."""
    out = dist_pool.run(2, "tests.qk_clip_cases:nothing_recorded", {}, timeout_s=120)
    for rank_out in out:
        assert rank_out["error"] is not None
        assert "'layers.0.attn'" in rank_out["error"] and "'layers.1.attn'" in rank_out["error"]
        assert "dmuon.qk_clip.observe" in rank_out["error"]
        assert rank_out["changed"] == []
    out = dist_pool.run(2, "tests.qk_clip_cases:nothing_recorded", dict(observe=4), timeout_s=120)
    for rank_out in out:
        assert rank_out["error"] is None
        assert "layers.0.attn.q_proj.weight" in rank_out["changed"]
    # rank 0 alone observes 3 maxima of 4 heads: every rank raises, none moves
    out = dist_pool.run(2, "tests.qk_clip_cases:nothing_recorded", dict(observe=3), timeout_s=120)
    for rank_out in out:
        assert "recorded a number of head maxima" in rank_out["error"], rank_out["error"]
        assert "'layers.0.attn'" in rank_out["error"] and rank_out["changed"] == []


def test_per_head_with_no_attention_is_an_error():
    from dmuon.owners.blocks import resolve_splits
    from tests import models

    with pytest.raises(ValueError, match=r"per_head=True.*Net.*split="):
        resolve_splits(models.make_model(), [], per_head=True, split=None)


def test_qk_norm_without_a_gain_is_refused_by_name():
    """A QK-norm with no weight (``elementwise_affine=False``) has nothing to scale after the
    norm: refused at construction, naming q_norm and the module."""
    from types import SimpleNamespace

    from dmuon.qk_clip import QKClip

    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(hidden_size=32, intermediate_size=16, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, num_hidden_layers=1, vocab_size=10)
    model = transformers.Qwen3ForCausalLM(cfg)
    model.model.layers[0].self_attn.q_norm = nn.RMSNorm(8, elementwise_affine=False)
    ctx = SimpleNamespace(records=[], roles=SimpleNamespace(tp=None, world=None))
    with pytest.raises(ValueError, match=r"q_norm.*'model.layers.0.self_attn'"):
        QKClip(model, ctx)
    model.model.layers[0].self_attn.q_norm = nn.RMSNorm(8)
    clip = QKClip(model, ctx)  # nn.RMSNorm with a weight is fine
    clip.recorder.remove()


def test_local_rows_are_the_rows_fsdp2_and_tp_pieces_hold(dist_pool):
    """Biases are scaled by every rank on its local piece at the piece's global rows: those rows
    under FSDP2 (``Shard(0)``), TP (``ColwiseParallel``) and FSDP x TP (``_StridedShard``, uneven)."""
    out = dist_pool.run(4, "tests.qk_clip_cases:local_rows_pieces", {}, timeout_s=120, fresh=True)
    assert [o["bad"] for o in out] == [[], [], [], []], out
    assert "_StridedShard" in out[0]["placements"] and "Shard" in out[0]["placements"], out[0]


def test_prepare_gives_a_frozen_plan_a_worker_thread_can_apply(dist_pool):
    """The plan holds what the step decided: the threshold changed after ``prepare`` changes
    nothing, and ``scale_master`` on a worker thread (a copy of the master) gives the formula,
    as ``scale_master`` + ``scale_others`` do on the live master and bias."""
    (out,) = dist_pool.run(1, "tests.qk_clip_cases:plan_is_frozen", {}, timeout_s=120)
    assert out["frozen"] and out["clipped"] == 2 * 2  # group 2 of both layers, 2 query heads each
    np.testing.assert_allclose(out["thread"], out["want"], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out["thread"], out["live"])
    np.testing.assert_allclose(out["full"], out["want_bias"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kv,mask", [(1, "none"), (2, "causal"), (3, "bool"), (6, "float"), (6, "expanded"),
                                     (2, "padding")])
def test_max_logits_equals_the_float64_formula(kv, mask):
    """``max_logits`` (grouped-query products, the scale applied after the max where it
    commutes, masks in place) against ``max over keys of q . k * scale`` computed in float64
    with the key heads repeated and the mask applied as SDPA / nn.MultiheadAttention do."""
    from dmuon.qk_clip import max_logits

    g = torch.Generator().manual_seed(kv * 7 + len(mask))
    b, h, t, s, d = 2, 6, 5, 7, 8
    q = torch.randn(b, h, t, d, generator=g)
    k = torch.randn(b, kv, t if mask == "causal" else s, d, generator=g)
    kwargs: dict = {}
    keep = torch.ones(b, h, t, k.shape[2], dtype=torch.bool)
    add = torch.zeros(b, h, t, k.shape[2], dtype=torch.float64)
    if mask == "causal":
        kwargs["is_causal"] = True
        keep &= torch.ones(t, t, dtype=torch.bool).tril()
    elif mask == "bool":
        m = torch.rand(t, s, generator=g) > 0.3
        kwargs["attn_mask"], keep = m, keep & m
    elif mask == "float":
        m = torch.randn(b, 1, t, s, generator=g)
        kwargs["attn_mask"], add = m, add + m.double()
    elif mask == "padding":  # True marks a masked position (nn.MultiheadAttention's convention)
        m = torch.rand(b, h, t, s, generator=g) > 0.6
        kwargs.update(attn_mask=m, mask_true_keeps=False)
        keep &= ~m
    elif mask == "expanded":
        k = k[:, :1].expand(-1, h, -1, -1)
    kwargs["scale"] = 0.3
    full = k.repeat_interleave(h // k.shape[1], dim=1) if mask != "expanded" else k
    logits = q.double() @ full.double().transpose(-1, -2) * 0.3 + add
    want = logits.masked_fill(~keep, float("-inf")).amax(dim=(0, 2, 3))
    got = max_logits(q, k, **kwargs)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
