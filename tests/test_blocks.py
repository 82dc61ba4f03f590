"""Per-head Muon and QK-clip (issue 40) against single-process references written in
tests/attention_models.py: ``torch.optim.Muon`` on every head block as a parameter of its own,
and Kimi's MuonClip with Megatron's GQA rule from the logits the reference model records."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon
from dmuon.owners.attention import find_attention
from dmuon.owners.blocks import Split, per_head_splits
from tests import attention_models as am
from tests.test_core import FP32_ATOL, compare

STEPS = 3


def _ref(world_size, **kwargs):
    return am.run_reference(world_size, STEPS, **kwargs)


@pytest.mark.compat
def test_per_head_fsdp_matches_torch_muon_on_head_blocks(dist_pool):
    out = dist_pool.run(4, "tests.blocks_cases:train", dict(layout="fsdp", steps=STEPS), timeout_s=180)
    ref, _ = _ref(4, per_head=True)
    compare(out[0]["params"], ref, FP32_ATOL)
    # and it is not whole-matrix Muon: the q/k/v weights differ from that reference
    whole, _ = _ref(4, per_head=False)
    assert (torch.from_numpy(out[0]["params"]["blocks.1.attn.wqkv.weight"])
            - whole["blocks.1.attn.wqkv.weight"]).abs().max() > 1e-3


def test_per_head_and_qk_clip_under_fsdp_x_tp(dist_pool):
    """TP shards q/k/v by heads (colwise) and the fused wqkv by KV groups, on head boundaries:
    each TP rank orthogonalizes the heads it holds, without a TP exchange. QK-clip (gain 3 at
    init, tau 0.3: heads clip every step): each TP rank records its local heads' max logits at
    their global indices, the MAX-reduce spans DP and TP, and each slice's owner scales its rows."""
    out = dist_pool.run(4, "tests.blocks_cases:train", dict(layout="fsdp-tp", steps=STEPS, tau=0.3, gain=3.0),
                        timeout_s=180)
    ref, clipped = _ref(2, per_head=True, tau=0.3, gain=3.0)
    assert clipped[0] > 0 and clipped[-1] > 0, clipped
    assert out[0]["clipped"] == [c * am.GROUP for c in clipped]
    compare(out[0]["params"], ref, FP32_ATOL)
    assert out[0]["local_tp"] == sorted(am.head_rows()), out[0]["local_tp"]
    unclipped, _ = _ref(2, per_head=True, gain=3.0)  # the clip changed the weights
    for name in ("blocks.0.attn.k_proj.weight", "blocks.1.attn.wqkv.weight"):
        assert (unclipped[name] - torch.from_numpy(out[0]["params"][name])).abs().max() > 1e-3, name


@pytest.mark.compat
def test_per_head_and_qk_clip_under_a_pipeline_schedule(dist_pool):
    """pp 2 x dp 2, 1F1B, 4 micro-batches: each stage's QK-clip records its own attention
    modules over the micro-batches and MAX-reduces over the stage's data-parallel ranks (no
    other stage computes those heads), against the single-process reference on the global batch."""
    out = dist_pool.run(4, "tests.blocks_cases:pipeline", dict(schedule="1f1b", steps=STEPS, tau=0.3, gain=3.0),
                        timeout_s=240, fresh=True)
    from tests.pp_cases import MICRO_BATCHES

    ref, clipped = _ref(MICRO_BATCHES * out[0]["dp"], per_head=True, tau=0.3, gain=3.0)
    assert clipped[0] > 0 and clipped[1] > 0, clipped
    # ranks 0, 1: stage 0 (block 0); ranks 2, 3: stage 1 (block 1)
    assert [a + b for a, b in zip(out[0]["clipped"], out[2]["clipped"])] == [c * am.GROUP for c in clipped]
    assert out[0]["clipped"][0] > 0 and out[2]["clipped"][0] > 0
    compare(out[0]["params"], ref, FP32_ATOL)
    unclipped, _ = _ref(MICRO_BATCHES * out[0]["dp"], per_head=True, gain=3.0)
    for name in ("blocks.0.attn.q_proj.weight", "blocks.1.attn.wqkv.weight"):
        assert (unclipped[name] - torch.from_numpy(out[0]["params"][name])).abs().max() > 1e-3, name


@pytest.mark.parametrize("through", [pytest.param("state_dict", marks=pytest.mark.compat), "dcp"])
def test_qk_clip_with_accumulation_and_resume_matches_formula(dist_pool, tmp_path, through):
    """Logits driven above tau (gain 3 at init, tau 0.3): the clip scales heads every step;
    2 micro-batches; the run is cut after step 1 and resumed from state dicts (built with tau 1e9:
    the clip of step 2 happens only if the loaded param group brings tau 0.3 back)."""
    kwargs = dict(layout="fsdp", steps=STEPS, tau=0.3, gain=3.0, micro_batches=2)
    dcp_path = str(tmp_path / "ckpt") if through == "dcp" else None
    out = dist_pool.run(4, "tests.blocks_cases:train", dict(kwargs, resume_at=1, dcp_path=dcp_path),
                        timeout_s=180)
    ref, clipped = _ref(4, per_head=True, tau=0.3, gain=3.0, micro_batches=2)
    assert clipped[0] > 0 and clipped[1] > 0, clipped  # the clip acted before and after the cut
    assert out[0]["clipped"] == [c * am.GROUP for c in clipped]  # heads of the clipped groups
    compare(out[0]["params"], ref, FP32_ATOL)
    assert out[0]["tau"] == 0.3  # the loaded param group brought tau back
    unclipped, _ = _ref(4, per_head=True, gain=3.0, micro_batches=2)
    assert (unclipped["blocks.0.attn.q_proj.weight"]
            - torch.from_numpy(out[0]["params"]["blocks.0.attn.q_proj.weight"])).abs().max() > 1e-3


@pytest.mark.parametrize("layout,world_size,per_head", [("hsdp", 4, True), ("replicated", 2, True),
                                                        ("replicated", 2, False)])
def test_per_head_and_qk_clip_on_hsdp_and_replicated(dist_pool, layout, world_size, per_head):
    # one HSDP call per session: a second 2 x 2 ("replicate", "shard") mesh in the same pool
    # workers met a destroyed process group in bind's redistribute (torch's mesh caching)
    out = dist_pool.run(world_size, "tests.blocks_cases:train",
                        dict(layout=layout, steps=STEPS, tau=0.3, gain=3.0, per_head=per_head), timeout_s=180)
    ref, clipped = am.run_reference(world_size, STEPS, per_head=per_head, tau=0.3, gain=3.0)
    assert out[0]["clipped"] == [c * am.GROUP for c in clipped] and clipped[0] > 0
    compare(out[0]["params"], ref, FP32_ATOL)


def test_recognizes_the_attention_layouts_users_have():
    mha = nn.MultiheadAttention(12, 4)
    found = find_attention(nn.ModuleDict({"a": mha}))
    assert [(f.num_heads, f.num_kv_heads, f.head_dim) for f in found] == [(4, 4, 3)]
    assert found[0].k.head_rows == (12, 15, 18, 21)
    assert per_head_splits(mha)[(id(mha), "in_proj_weight")] == Split(sizes=(3,) * 12)
    model = am.make_model()
    layouts = find_attention(model)
    assert [lay.name for lay in layouts] == ["blocks.0.attn", "blocks.1.attn"]
    fused = layouts[1]
    # group-major: [q0 q1 k0 v0 | q2 q3 k1 v1], 3 rows each
    assert fused.q.head_rows == (0, 3, 12, 15) and fused.k.head_rows == (6, 18)
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=8, num_hidden_layers=1, vocab_size=10)
    llama = transformers.LlamaForCausalLM(cfg)
    (lay,) = find_attention(llama)
    assert (lay.num_heads, lay.num_kv_heads, lay.head_dim) == (4, 2, 4)


def test_split_and_option_errors_name_the_object():
    with pytest.raises(ValueError, match="Split.sizes"):
        Split(sizes=(3, 0))
    with pytest.raises(ValueError, match="'w'.*add up to 9"):
        Split.heads(3, 3).check("w", (12, 5))
    assert Split.fused(Split.heads(2, 3), 6).sizes == (3, 3, 6)
    with pytest.raises(ValueError, match="dedicate_params"):
        dmuon.Muon([nn.Parameter(torch.ones(3, 3))], per_head=True)
    with pytest.raises(ValueError, match="qk_clip_alpha"):
        dmuon.Muon([nn.Parameter(torch.ones(3, 3))], qk_clip_alpha=2.0)


def test_observe_and_recompute_max_logits():
    q, k = torch.randn(2, 4, 5, 3), torch.randn(2, 2, 5, 3)
    got = dmuon.qk_clip.max_logits(q, k, is_causal=True)
    assert torch.allclose(got, am.causal_logits(q, k).amax(dim=(0, 2, 3)))
    m = nn.Linear(2, 2)
    dmuon.qk_clip.observe(m, torch.tensor([1.0, 5.0]))
    dmuon.qk_clip.observe(m, torch.tensor([2.0, 3.0]))
    assert m._dmuon_max_logits.tolist() == [2.0, 5.0]


def test_train_cli_flags_reach_the_optimizer():
    from dmuon.train.launch import parse_args
    from dmuon.train.loop import TrainConfig

    cfg, _ = parse_args(["--steps", "3", "--per-head", "--qk-clip", "2.5", "--nproc", "1",
                         "--overlap", "backward", "--clip-grad-norm", "1.0"])
    assert cfg.per_head is True and cfg.qk_clip == 2.5
    assert cfg.overlap == "backward" and cfg.clip == 1.0
    with pytest.raises(ValueError, match="--optimizer dmuon"):
        TrainConfig(optimizer="adamw", per_head=True)


def test_recorder_sees_hf_llama_sdpa_and_eager_alike():
    """The SDPA recomputation (q k^T * scale with the causal mask) against HF's eager path,
    where the softmax input *is* the masked logits; and nn.MultiheadAttention's recomputation
    against the logits written out here."""
    transformers = pytest.importorskip("transformers")
    from dmuon.qk_clip import LogitRecorder

    seen = {}
    for impl in ("sdpa", "eager"):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=8, num_hidden_layers=2, vocab_size=10,
                                       attn_implementation=impl)
        model = transformers.LlamaForCausalLM(cfg)
        layouts = find_attention(model)
        recorder = LogitRecorder(layouts)
        model(torch.randint(0, 10, (2, 7)))
        seen[impl] = torch.stack([lay.module._dmuon_max_logits for lay in layouts])
        recorder.remove()
    assert seen["sdpa"].shape == (2, 4)
    torch.testing.assert_close(seen["sdpa"], seen["eager"], rtol=1e-5, atol=1e-5)

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(12, 4, batch_first=True)
    recorder = LogitRecorder(find_attention(nn.ModuleDict({"a": mha})))
    x = torch.randn(2, 5, 12)
    mha(x, x, x, need_weights=False)
    q, k, _ = torch.nn.functional.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    q, k = (t.view(2, 5, 4, 3).transpose(1, 2) for t in (q, k))
    want = (q @ k.transpose(-1, -2) / 3 ** 0.5).amax(dim=(0, 2, 3))
    torch.testing.assert_close(mha._dmuon_max_logits, want.detach())
    recorder.remove()


def test_qk_clip_under_tp_refuses_layouts_it_cannot_map(monkeypatch):
    """Under TP the heads a rank computes are read off its slice of the query weight: a query
    projection that is not dedicated, sharded by columns, or cut inside a head is refused by
    name (TP of 3 ranks over 4 heads of 3 rows: slices of 4 rows cut heads 1 and 2)."""
    from types import SimpleNamespace

    from dmuon.qk_clip import QKClip

    model = am.make_model()
    attn0, attn1 = model.blocks[0].attn, model.blocks[1].attn

    def ctx(q_dim, with_q=True):
        recs = [SimpleNamespace(module=attn1.wqkv, attr="weight", fqn="blocks.1.attn.wqkv.weight",
                                full_shape=(24, 12), tp_shard_dim=0)]
        if with_q:
            recs.append(SimpleNamespace(module=attn0.q_proj, attr="weight", fqn="blocks.0.attn.q_proj.weight",
                                        full_shape=(12, 12), tp_shard_dim=q_dim))
        return SimpleNamespace(records=recs, roles=SimpleNamespace(tp=object(), world=None))

    with pytest.raises(ValueError, match="'blocks.0.attn'.*not a dedicated"):
        QKClip(model, ctx(0, with_q=False))
    with pytest.raises(ValueError, match="'blocks.0.attn.q_proj.weight'.*sharded along dim 1"):
        QKClip(model, ctx(1))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 3)
    with pytest.raises(ValueError, match=r"rows 0:4.*cuts query head 1 of 'blocks.0.attn'"):
        QKClip(model, ctx(0))


def test_qk_clip_records_nothing_during_pipelining_metadata_inference():
    """torch.distributed.pipelining (torch >= 2.13) runs each stage once with gradients on, a
    non-first stage on uninitialized inputs, to infer its shapes: those logits are not the
    model's and must not reach QK-clip (they made the pipeline test's clip counts and weights
    random, NaN at times). Inside a frame of that name nothing is recorded; outside, the same
    forward records finite maxima (their values are checked against the reference by the
    pipeline and mesh tests above)."""
    import torch.distributed.pipelining  # noqa: F401  (a stage runs only once it is imported)

    from dmuon.qk_clip import _ATTR, LogitRecorder, observe

    model = am.make_model(gain=3.0)
    layouts = find_attention(model)
    recorder = LogitRecorder(layouts)
    idx, _ = am.global_batch(0, 2)

    def _forward_metadata_inference() -> None:  # the name torch's PipelineStage method has
        model(idx)
        observe(layouts[0].module, torch.full((layouts[0].num_heads,), 1e4))

    _forward_metadata_inference()
    assert all(getattr(lay.module, _ATTR, None) is None for lay in layouts)
    model(idx)
    seen = [getattr(lay.module, _ATTR, None) for lay in layouts]
    recorder.remove()
    assert all(s is not None and torch.isfinite(s).all() and s.max() < 1e4 for s in seen), seen
