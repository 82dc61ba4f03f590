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
