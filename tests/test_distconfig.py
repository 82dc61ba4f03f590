"""DistributedConfig / dmuon.Muon(params, distributed_config=...): gather and redistribute per
strategy, equivalence with single-process torch.optim.Muon + AdamW, validation, and failure
propagation.

Strategies: FSDP (fully_shard), TP Shard(0)/Shard(1) (distribute_tensor), DDP (plain
replicas), FSDP x TP (parallelize_module + fully_shard: ``_StridedShard``), HSDP
((Replicate, Shard(0))), and plain shards under process groups. References are DTensor's
unsharded seeded tensors (sharded again by torch's own tools for comparison), and ``torch.optim.Muon`` with its iteration run in
fp32 (tests/models.py); tolerance 1e-5 (fp32 exact mode).
"""

from __future__ import annotations

import pytest
import torch

from tests import models
from tests._pool import RankExit, spawn_world

CASES = "tests.distconfig_cases"
STRATEGIES = ["fsdp", "tp0", "tp1", "ddp", "fsdp_tp", "hsdp", "plain_fsdp", "plain_fsdp_tp"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gather_redistribute(dist_pool, strategy):
    """gather_fn: the full tensor on dst, None elsewhere; redistribute_fn: every rank's piece;
    the round exchange dmuon.Muon runs with them (one all_to_all each way) the same."""
    out = dist_pool.run(4, f"{CASES}:gather_redistribute", {"strategy": strategy}, timeout_s=60)
    assert all(r["all_ok"] for r in out)
    assert max(r["max_err"] for r in out) == 0.0
    assert len({tuple(r["owners"]) for r in out}) == 1  # same assignment on every rank
    if strategy == "fsdp_tp":
        assert "_StridedShard" in out[0]["placements"][0]
    if strategy == "hsdp":
        assert "Replicate" in out[0]["placements"][0]


@pytest.mark.parametrize("strategy,async_,prefetch,batched", [
    ("fsdp", True, 1, True), ("fsdp", False, 0, False), ("fsdp", True, 2, False),
    ("tp0", False, 1, True), ("tp1", True, 0, True), ("ddp", True, 1, True),
    ("fsdp_tp", True, 1, True), ("fsdp_tp", False, 2, False), ("hsdp", True, 2, True),
    ("plain_fsdp", True, 1, True), ("plain_fsdp_tp", False, 1, False),
    ("fsdp_tp_dp", True, 1, True), ("hsdp_dp", False, 1, True), ("ddp_dp", True, 1, False),
])
def test_equivalence_with_single_process(dist_pool, strategy, async_, prefetch, batched):
    """3 steps of dmuon.Muon(params, distributed_config=...) equal
    torch.optim.Muon + AdamW on the full tensors within 1e-5, for every schedule."""
    out = dist_pool.run(4, f"{CASES}:equivalence", dict(
        strategy=strategy, async_gpu_parallelism=async_, prefetch_count=prefetch, batched=batched),
        timeout_s=60)
    assert max(r["max_diff"] for r in out) <= 1e-5, out


def test_dp_mesh_dim_names(dist_pool):
    """create_devicemesh_config names dims as dedicate_params does: ("dp", "tp") (the seed's
    FSDP x TP example) and ("dp", "fsdp") (HSDP) need no warning; a lone "dp" still reads plain
    tensors as replicas, with a DeprecationWarning naming the replacements."""
    out = dist_pool.run(4, f"{CASES}:dp_warnings", {}, timeout_s=60)
    for r in out:
        assert r["fsdp_tp_dp"] == [] and r["hsdp_dp"] == [], r
        assert len(r["ddp_dp"]) == 1, r
        assert all(s in r["ddp_dp"][0] for s in ("'replicate'", "'fsdp'", "dedicate_params")), r


def test_fsdp_training_matches_reference(dist_pool):
    """tests.models.Net under fully_shard with a real backward vs run_reference (global batch)."""
    out = dist_pool.run(4, f"{CASES}:fsdp_training", {"steps": 3}, timeout_s=60)
    ref, _, _ = models.run_reference(4, 3)
    for name, value in ref.items():
        got = torch.from_numpy(out[0][name])
        torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind,needle", [("missing", "no rank to parameter indices [2]"),
                                         ("out_of_range", "outside [0, 2)"),
                                         ("negative", "outside [0, 2)")])
def test_invalid_assignments_raise_value_error(dist_pool, kind, needle):
    out = dist_pool.run(2, f"{CASES}:bad_assignment", {"kind": kind}, timeout_s=30)
    assert all(needle in msg for msg in out), out


@pytest.mark.parametrize("where,needle", [("gather", "expected the full matrix of shape (7, 6)"),
                                          ("redistribute", "expected this rank's local piece")])
def test_shape_mismatch_raises_runtime_error(dist_pool, where, needle):
    out = dist_pool.run(1, f"{CASES}:shape_mismatch", {"where": where}, timeout_s=30)
    assert needle in out[0], out


def test_communication_failure_propagates():
    """Rank 1's gather_fn raises: rank 1 fails with that error, the others' collectives fail
    (gloo: peer closed) instead of hanging or retrying."""
    out = spawn_world(3, f"{CASES}:comm_failure", timeout_s=60)
    assert isinstance(out[1], RankExit) and "injected failure" in (out[1].traceback or "")
    for r in (0, 2):
        assert isinstance(out[r], dict) and out[r]["raised"] is not None, out


def test_config_fields_as_the_seed_gives_them():
    """DistributedConfig(assign_fn, gather_fn, redistribute_fn, state) positionally, the seed's
    defaults (async on, prefetch 1), and the checks of each field."""
    import dmuon

    def fn(*args):
        return None

    cfg = dmuon.DistributedConfig(fn, fn, fn, {"pg": None})
    assert (cfg.state, cfg.async_gpu_parallelism, cfg.prefetch_count) == ({"pg": None}, True, 1)
    for bad, needle in [(dict(gather_fn=3), "gather_fn must be callable"),
                        (dict(state=[]), "state must be a dict"),
                        (dict(prefetch_count=-1), "prefetch_count must be an int >= 0"),
                        (dict(async_gpu_parallelism=1), "async_gpu_parallelism must be a bool")]:
        with pytest.raises(ValueError, match=needle):
            dmuon.DistributedConfig(**{**dict(assign_fn=fn, gather_fn=fn, redistribute_fn=fn), **bad})


def test_single_device_matches_torch_muon():
    """distributed_config=None: plain Muon + AdamW groups equal torch.optim.Muon + AdamW."""
    import dmuon

    model = models.make_model()
    names = set(models.matrix_names(model))
    mats = [p for n, p in model.named_parameters() if n in names]
    rest = [p for n, p in model.named_parameters() if n not in names]
    opt = dmuon.Muon([{"params": mats}, {"params": rest, "use_muon": False}], lr=0.02, adamw_lr=0.01,
                     weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32,
                     ns_coefficients="muon")
    for step in range(3):
        idx, y = models.global_batch(step, 1)
        models.loss_fn(model, idx, y).backward()
        opt.step()
        opt.zero_grad()
    ref, _, _ = models.run_reference(1, 3)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp", "fsdp_tp", "tp0", "ddp"])
def test_checkpoint_roundtrip(dist_pool, tmp_path, strategy):
    """dmuon.state_dict / dmuon.load on the distributed_config path: save after 2 steps, load
    into a fresh model and optimizer (other weights, other lr), 2 more steps equal an
    uninterrupted run (bitwise: same world size and kernels) and the saved lr is restored."""
    out = dist_pool.run(4, f"{CASES}:checkpoint_roundtrip",
                        {"strategy": strategy, "path": str(tmp_path / "ckpt")}, timeout_s=90)
    assert all(r["error"] is None for r in out), out
    assert max(r["max_diff"] for r in out) == 0.0, out
    assert all(r["lr"] == 0.013 for r in out), out


def test_checkpoint_refuses_plain_shards(dist_pool, tmp_path):
    """Plain sharded matrices cannot be placed by DCP: ValueError naming the matrix."""
    out = dist_pool.run(4, f"{CASES}:checkpoint_roundtrip",
                        {"strategy": "plain_fsdp", "path": str(tmp_path / "ckpt")}, timeout_s=60)
    assert all("Muon matrix 'mats.0' is a plain tensor sharded" in (r["error"] or "") for r in out), out


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp", "fsdp_tp", "tp1", "ddp", "plain_fsdp", "plain_fsdp_tp"])
def test_clip_grad_norm_matches_torch(dist_pool, strategy):
    """dmuon.clip_grad_norm_(opt) with a distributed_config, for the 2-, inf- and 1-norm: the
    total norm and every clipped piece equal torch.nn.utils.clip_grad_norm_ on the full
    single-process gradients."""
    out = dist_pool.run(4, f"{CASES}:clip", {"strategy": strategy, "norm_types": [2.0, float("inf"), 1.0]},
                        timeout_s=60)
    for per_rank in out:
        for r in per_rank:
            assert r["total"] == pytest.approx(r["ref_total"], rel=1e-5), out
            assert r["total"] > 1.0, out  # the clip is active
            assert r["max_diff"] <= 1e-6, out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_parallel_matches_reference(dist_pool, schedule):
    """tests.models.Net cut in 2 pipeline stages over ("pp", "dp") = (2, 2), FSDP2 within each
    stage, 4 micro-batches, 3 steps; each stage's dmuon.Muon with explicit param groups and
    create_devicemesh_config(mesh, ["pp", "fsdp"]): every parameter equals single-process
    torch.optim.Muon + AdamW on the global batch within 1e-5."""
    from tests import distconfig_pp_cases as pp

    out = dist_pool.run(4, "tests.distconfig_pp_cases:pipeline_training",
                        {"schedule": schedule, "steps": 3}, timeout_s=120)
    ref, _, _ = models.run_reference(pp.GLOBAL, 3)
    got = {}
    for r in out:
        got.update(r["params"])
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    moved = max(float((ref[n] - models.make_model().state_dict()[n]).abs().max()) for n in ref)
    assert moved > 1e-3  # the reference moved: equality is not "nothing changed"
    for name, value in ref.items():
        torch.testing.assert_close(torch.from_numpy(got[name]), value, rtol=1e-5, atol=1e-5, msg=name)
