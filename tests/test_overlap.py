"""Muon(overlap=...) (issue 39): Newton-Schulz behind the next forward ("forward"), and started
at the end of the last backward ("backward"), against single-process torch.optim.Muon + AdamW
on the global batch. The mesh, pipeline and expert-parallel cases are parametrized over the
mode in their own files (test_meshes, test_pipeline, test_moe)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dmuon
from tests import models
from tests.test_core import FP32_ATOL, compare

STEPS = 4


def _exact(out: list[dict], world_size: int, **ref_kwargs) -> None:
    ref, ref_losses, ref_norms = models.run_reference(world_size, STEPS, **ref_kwargs)
    compare(out[0]["params"], ref, FP32_ATOL)
    np.testing.assert_allclose(np.mean([o["losses"] for o in out], axis=0), ref_losses, rtol=1e-5)
    if ref_kwargs.get("clip") is not None:
        np.testing.assert_allclose(out[0]["norms"], ref_norms, rtol=1e-5)


def _exact_params(out: list[dict], world_size: int, steps: int, **ref_kwargs) -> None:
    ref, _, _ = models.run_reference(world_size, steps, **ref_kwargs)
    compare(out[0]["params"], ref, FP32_ATOL)


@pytest.mark.parametrize("world_size,mode,overlap", [
    pytest.param(4, "fsdp", "forward", marks=pytest.mark.compat),
    (4, "fsdp", "backward"),
    pytest.param(2, "replicated", "forward", marks=pytest.mark.compat),
    (2, "replicated", "backward")])
def test_overlap_matches_reference(dist_pool, world_size, mode, overlap):
    out = dist_pool.run(world_size, "tests.overlap_cases:train", dict(mode=mode, overlap=overlap, steps=STEPS),
                        timeout_s=120)
    _exact(out, world_size)
    stats = out[0]["stats"]
    # no clipping, nothing touches the gradients: every speculative result is kept
    assert stats == ({"kept": 0, "recomputed": 0} if overlap == "forward"
                     else {"kept": stats["kept"], "recomputed": 0}) and (overlap == "forward" or stats["kept"] > 0)
    if overlap == "backward" and mode == "fsdp":  # one bucket per FSDP2 block: the owners of the
        # blocks reduced first start their Newton-Schulz during the rest of the backward
        assert sum(o["started_early"] for o in out) > 0, [o["started_early"] for o in out]


def test_accumulation_scheduler_eval_and_state_dict_between_step_and_forward(dist_pool):
    """Gradient accumulation (dmuon.no_sync), an lr scheduler stepped between backward() and
    step(), an eval forward and torch's full state dict between step() and the next forward:
    all see the new weights (the jobs are slowed down by 20 ms each)."""
    out = dist_pool.run(2, "tests.overlap_cases:train",
                        dict(overlap="backward", steps=STEPS, micro_batches=3, lr_gamma=0.5, readers=True),
                        timeout_s=120)
    # one batch of 2 ranks x 3 micro-batches of 1 (as test_core's accumulation test)
    ref, _, _ = models.run_reference(2, STEPS, lr_gamma=0.5)
    compare(out[0]["params"], ref, FP32_ATOL)
    compare(out[0]["sd_params"], ref, FP32_ATOL)  # read right after the last step()
    for o in out:  # the eval forward right after step() saw the weights of the one after waiting
        assert len(o["eval_losses"]) == STEPS - 1
        for first, settled in o["eval_losses"]:
            assert first == settled, o["eval_losses"]
    # lr changes only after Newton-Schulz: the speculation stays valid
    assert out[0]["stats"]["recomputed"] == 0 and out[0]["stats"]["kept"] > 0


@pytest.mark.compat
@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_scheduler_after_step_then_ema_after_wait_pending(dist_pool, overlap):
    """The loop order most training code has: ``opt.step(); scheduler.step()`` (the lr halves
    every step), then ``opt.wait_pending()`` and an EMA of the weights, read directly from the
    owners' masters and through torch's full state dict. The jobs start 50 ms late, so the
    scheduler has always run before them: a job reading the live param group would take the
    next step's learning rate (issue 45: 0.11-0.16 off after 5 steps)."""
    out = dist_pool.run(2, "tests.overlap_cases:train",
                        dict(overlap=overlap, steps=STEPS, lr_gamma=0.5, sched_after_step=True, ema_decay=0.5,
                             delay_s=0.05), timeout_s=120)
    extra: dict = {}
    ref, ref_losses, _ = models.run_reference(2, STEPS, lr_gamma=0.5, ema_decay=0.5, out=extra)
    compare(out[0]["params"], ref, FP32_ATOL)
    np.testing.assert_allclose(np.mean([o["losses"] for o in out], axis=0), ref_losses, rtol=1e-5)
    compare(out[0]["sd_ema"], extra["ema"], FP32_ATOL)
    masters = {k: v for o in out for k, v in o["ema"].items()}
    assert masters, "no rank owns a matrix"
    compare(masters, {k: extra["ema"][k] for k in masters}, FP32_ATOL)


@pytest.mark.compat
def test_gradient_written_through_data_discards_the_speculation(dist_pool):
    """``p.grad.data.mul_(-0.5)`` between backward() and step() (older training code; raw
    pointer writes by other libraries do the same): ``.data`` does not bump the version
    counter, so only a comparison by value can see that the speculation's input is stale
    (issue 45: kept, 3e-2 off the reference). The write comes 100 ms after backward, when the
    speculative jobs (not slowed here) have read the gradients."""
    out = dist_pool.run(2, "tests.overlap_cases:train",
                        dict(overlap="backward", steps=STEPS, grad_scale=-0.5, delay_s=0.0, pause_s=0.1),
                        timeout_s=120)
    _exact(out, 2, grad_scale=-0.5)
    assert all(o["stats"]["kept"] == 0 for o in out), [o["stats"] for o in out]
    assert sum(o["stats"]["recomputed"] for o in out) > 0


def test_grad_scaler_unscale_between_backward_and_step(dist_pool):
    """FSDP2's ``ShardedGradScaler`` (scale 2^10: scaling and unscaling are exact) around
    ``opt.step()``: its unscale reaches the owners' gradients (it used to fail on the mix of
    DTensor and plain gradients), the weights equal the unscaled reference, and the
    speculations, started from the scaled gradients, are all recomputed."""
    out = dist_pool.run(2, "tests.overlap_cases:train", dict(overlap="backward", steps=STEPS, scaler=True),
                        timeout_s=120)
    _exact(out, 2)
    assert all(o["stats"]["kept"] == 0 for o in out), [o["stats"] for o in out]


@pytest.mark.compat
def test_backward_speculation_survives_a_clip_that_does_not_bind(dist_pool):
    """A clip whose threshold the norm stays under multiplies every gradient by exactly 1.0:
    the gradients keep their bits, so every speculation is kept (the version counter, bumped
    by the clip, decides nothing)."""
    out = dist_pool.run(2, "tests.overlap_cases:train", dict(overlap="backward", steps=STEPS, clip=1e6),
                        timeout_s=120)
    _exact(out, 2, clip=1e6)
    for o in out:
        assert o["stats"]["recomputed"] == 0, o["stats"]
    assert sum(o["stats"]["kept"] for o in out) > 0


@pytest.mark.parametrize("overlap,tau", [("forward", None), ("backward", None), ("forward", 0.3),
                                         ("backward", 0.3)])
def test_per_head_muon_and_qk_clip_overlap(dist_pool, overlap, tau):
    """Per-head Muon and QK-clip go through the overlapped job like any matrix (they used to
    step synchronously whatever ``overlap`` said; the clip's frozen plan scales the new rows in
    the job): equal to torch.optim.Muon on every head block, clipped by Kimi's rule (gain 3,
    tau 0.3: heads clip every step)."""
    from tests import attention_models as am

    gain = 1.0 if tau is None else 3.0
    out = dist_pool.run(4, "tests.blocks_cases:train", dict(layout="fsdp", steps=3, overlap=overlap, tau=tau,
                                                            gain=gain), timeout_s=180)
    ref, clipped = am.run_reference(4, 3, per_head=True, tau=tau, gain=gain)
    compare(out[0]["params"], ref, FP32_ATOL)
    assert all(o["scheduled"] > 0 for o in out if o["owns"]), out
    if tau is not None:
        assert clipped[0] > 0 and out[0]["clipped"] == [c * am.GROUP for c in clipped], (clipped, out[0]["clipped"])


@pytest.mark.parametrize("overlap", ["off", "forward"])
def test_units_follow_the_first_forwards_order(dist_pool, overlap):
    """A model whose blocks run in another order than they were registered (pi0 and SmolVLA
    interleave their VLM and expert layers): from the first step on, units, prefetch and the
    overlapped jobs follow the order the first forward ran them (issue 46, review finding 4;
    they kept registration order on 586b72b); exact against the reference either way."""
    out = dist_pool.run(2, "tests.overlap_cases:forward_order", dict(overlap=overlap), timeout_s=120)
    ref, _, _ = models.run_reference(2, 3, variant="reversed")
    compare(out[0]["params"], ref, FP32_ATOL)
    for o in out:
        blocks_after = [n for n in o["after"] if n.startswith("blocks.")]
        assert o["ran"] == ["blocks.2", "blocks.1", "blocks.0"], o["ran"]
        assert blocks_after == o["ran"], o
        assert [n for n in o["before"] if n.startswith("blocks.")] == ["blocks.0", "blocks.1", "blocks.2"], o


def test_backward_start_fires_on_a_coalesced_reduce(dist_pool):
    """On NCCL a bucket's reduce-to-owner collectives are one coalesced group call, whose
    manager has no ``is_completed`` of its own: the early start polls each of its works (it
    never fired on NCCL before; issue 46, review finding 2). Gloo cannot coalesce, so the
    buckets' works are wrapped in the same manager type (overlap_cases.coalesced_on_gloo)."""
    out = dist_pool.run(4, "tests.overlap_cases:train", dict(overlap="backward", steps=STEPS, coalesce=True),
                        timeout_s=120)
    _exact(out, 4)
    assert sum(o["started_early"] for o in out) > 0, [o["started_early"] for o in out]


def test_a_binding_clip_does_not_wait_for_the_speculation_it_discards(dist_pool):
    """A clip below its threshold changes every gradient: ``dmuon.clip_grad_norm_`` and
    ``opt.step()`` return without waiting for the (500 ms slow) speculative Newton-Schulz they
    discard (both waited for it on 586b72b; issue 46, review finding 3); exact all the same."""
    out = dist_pool.run(2, "tests.overlap_cases:clip_then_step", {}, timeout_s=120)
    _exact_params(out, 2, steps=3, clip=0.05)
    for o in out:
        assert o["stats"]["kept"] == 0 and o["stats"]["recomputed"] > 0, o["stats"]
        assert max(o["took"][1:]) < 0.3, o["took"]  # step 0 has no momentum: no speculation


@pytest.mark.compat
def test_backward_speculation_rejected_by_clipping(dist_pool):
    out = dist_pool.run(2, "tests.overlap_cases:train", dict(overlap="backward", steps=STEPS, clip=0.05),
                        timeout_s=120)
    _exact(out, 2, clip=0.05)
    for o in out:  # clipping scales every gradient in place: no speculation may be kept
        assert o["stats"]["kept"] == 0, o["stats"]
    assert sum(o["stats"]["recomputed"] for o in out) > 0


def test_resume_from_checkpoint_saved_with_updates_pending(dist_pool, tmp_path):
    out = dist_pool.run(2, "tests.overlap_cases:resume", dict(overlap="forward", path=str(tmp_path / "ckpt")),
                        timeout_s=120)
    for name, value in out[0]["straight"].items():
        np.testing.assert_array_equal(out[0]["resumed"][name], value, err_msg=name)


def test_failure_on_worker_thread_is_raised_by_name(dist_pool):
    (message,) = dist_pool.run(1, "tests.overlap_cases:failing_job", {}, timeout_s=60, fresh=True)
    assert message.startswith("dmuon:") and "worker thread" in message and "FloatingPointError" in message, message


def test_forward_waits_only_for_its_own_units_newton_schulz(dist_pool):
    """Unit 1's job (block 1's matrices) is 400 ms slow, the others are not: ``opt.step()``
    returns at once (it used to wait for unit 0's job), and block 0's forward ends before unit
    1's job, on the rank that runs it (the prefetch of unit 1's publication used to make unit
    0's forward wait for unit 1's Newton-Schulz; issue 46, review finding 1)."""
    out = dist_pool.run(2, "tests.overlap_cases:unit_timeline", {}, timeout_s=120)
    owners = [row for o in out for row in o["rows"] if row["job1_end"] is not None]
    assert owners, out
    for row in owners:
        assert row["block0_end"] < row["job1_end"], row
    for o in out:
        for row in o["rows"]:
            assert row["step_s"] < 0.2, row


@pytest.mark.parametrize("mode", ["fsdp", "replicated"])
def test_failure_on_one_rank_fails_every_rank_at_the_next_check(dist_pool, mode):
    """Rank 1's overlapped jobs fail from step 1 on: rank 1 keeps publishing (its old weights)
    so that no rank waits on it, and every rank raises at the next step check, naming rank 1
    and quoting its error, within the step (not after the process-group timeout)."""
    out = dist_pool.run(2, "tests.overlap_cases:failing_rank", dict(mode=mode), timeout_s=120, fresh=True)
    for rank, o in enumerate(out):
        assert o["error"] is not None, (rank, o)
        assert o["error"].startswith("dmuon: the overlapped owner update failed on rank(s) [1]"), o
        assert "FloatingPointError" in o["error"], o
        assert o["step"] in (1, 2) and o["after_s"] < 5.0, o
    assert len({o["step"] for o in out}) == 1, out  # together


def test_wait_pending_before_reading_masters_directly(dist_pool):
    """opt.wait_pending(): a master read straight after step() (no wait) is still mid-update
    (the control), and equal to its final value after wait_pending()."""
    out = dist_pool.run(2, "tests.overlap_cases:direct_read", {}, timeout_s=120, fresh=True)
    owners = [o for o in out if o["owns"]]
    assert owners, out
    for o in owners:
        assert o["pending"] and not o["left"] and o["waited_equal"], o
        assert not o["raw_equal"], o  # the control: without the wait the read is stale


def test_bad_overlap_value_names_the_choices():
    net = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"overlap must be one of \('off', 'forward', 'backward'\)"):
        dmuon.Muon(net.parameters(), overlap="always")
    with pytest.raises(ValueError, match="owner runtime"):
        dmuon.Muon(net.parameters(), overlap="forward")


@pytest.mark.parametrize("mode,world_size", [pytest.param("fsdp", 4, marks=pytest.mark.compat),
                                             ("replicated", 3)])
def test_runtime_deadline_aware_plan_matches_reference(dist_pool, mode, world_size):
    """Without a plan file ``dedicate_params`` solves the deadline-aware plan
    (:mod:`dmuon.hooks.default_plan`). At 64 tokens per rank (units: FSDP2 blocks, or the leaf
    modules of a plain module with ``replicas="placeholder"``) the plan leaves the makespan plan (``candidate``)
    to expose less NS; runs with it under ``overlap="forward"`` and ``"off"`` equal
    single-process torch.optim.Muon + AdamW."""
    outs = {}
    for overlap in ("forward", "off"):
        outs[overlap] = out = dist_pool.run(
            world_size, "tests.dist_cases:train",
            dict(mode=mode, steps=STEPS, opt_kwargs=dict(overlap=overlap),
                 dedicate_kwargs=dict(forward_tokens=64, **(
                     {"replicas": "placeholder"} if mode == "replicated" else {}))), timeout_s=120)
        _exact_params(out, world_size, STEPS)
    extra = outs["forward"][0]["plan_extra"]
    assert extra["objective"] == "overlap" and extra["forward_tokens"] == 64, extra
    assert extra["candidate"] != "makespan", extra
    assert extra["exposed"] < extra["makespan_plan_exposed"], extra
    assert [o["owned"] for o in outs["off"]] == [o["owned"] for o in outs["forward"]]
