"""Publication follows the unit that runs (issue 14): a parent reading its child's weight,
activation checkpointing (wrapper before ``fully_shard``, ``torch.utils.checkpoint`` inside a
forward, early stop on and off) and FSDP2 mixed precision, each against an independent
single-process reference, and the placeholder contract after every backward and step.
"""

from __future__ import annotations

import pytest

from tests import unit_cases
from tests.test_core import FP32_ATOL, compare

STEPS = 3


@pytest.mark.parametrize("mode", ["fsdp", "replicated"])
def test_parent_reading_child_weight_is_published(dist_pool, mode):
    """``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``:
    non-owners must still see the full weight (the unit is the FSDP2 block, or the parent)."""
    out = dist_pool.run(2, "tests.unit_cases:train", dict(kind="attention", mode=mode, steps=STEPS),
                        timeout_s=120)
    compare(out[0]["params"], unit_cases.reference("attention", 2, STEPS), FP32_ATOL)
    assert all(all(o["contract"]) for o in out)


@pytest.mark.parametrize("ac,early_stop,world_size,mode", [
    ("wrapper", True, 2, "fsdp"), ("wrapper", False, 2, "fsdp"), ("in-forward", True, 2, "fsdp"),
    ("in-forward", False, 4, "fsdp"), ("wrapper", True, 2, "replicated"), ("in-forward", False, 2, "replicated")])
def test_activation_checkpointing_matches_reference(dist_pool, ac, early_stop, world_size, mode):
    """Recomputation in backward sees the published weights; a forward cut short (early stop)
    leaves no compute copy behind; results equal the run without checkpointing's reference.
    Under FSDP2 and on a plain replicated module (``replicas="keep"``, units are the Linears)."""
    out = dist_pool.run(world_size, "tests.unit_cases:train",
                        dict(ac=ac, early_stop=early_stop, steps=STEPS, mode=mode), timeout_s=180)
    compare(out[0]["params"], unit_cases.reference("plain", world_size, STEPS), FP32_ATOL)
    for rank, o in enumerate(out):
        # FSDP2: three blocks and the root (the head); replicated: the 7 Linears
        assert o["units"] == (4 if mode == "fsdp" else 7)
        assert all(o["contract"]), f"rank {rank}: a module holds a compute copy after backward/step: {o['contract']}"


def test_mixed_precision_policy(dist_pool):
    """bf16 ``param_dtype``: modules compute with bf16 weights, dedicated and FSDP2-managed
    alike; gradients reach the owner in fp32 (``reduce_dtype``); masters stay fp32; the result
    equals FSDP2's mixed-precision semantics emulated in one process with torch's optimizers."""
    out = dist_pool.run(2, "tests.unit_cases:train_mixed_precision", dict(steps=STEPS), timeout_s=120)
    for o in out:
        assert o["seen"] == {"blocks.0.fc1": "torch.bfloat16", "blocks.0.ln": "torch.bfloat16",
                             "head": "torch.bfloat16"}, o["seen"]
        assert o["compute_dtypes"] == ["torch.bfloat16"]
        assert o["reduce_dtypes"] == ["torch.float32"]
        assert o["master_dtypes"] == ["torch.float32"]
    compare(out[0]["params"], unit_cases.mixed_precision_reference(2, STEPS), FP32_ATOL)


def test_unpublishable_param_dtype_is_refused(dist_pool):
    out = dist_pool.run(2, "tests.unit_cases:bad_param_dtype", {}, timeout_s=60)
    for message in out:
        assert "float8_e4m3fn" in message and "param_dtype" in message and "blocks.0" in message, message
