"""What a trainer's order and wrappers do to dmuon (issue 31, items 8 and 9;
``tests/order_cases.py``): ``dmuon.Muon`` built before a later ``fully_shard`` fails by name
on every rank; dmuon's functions take Accelerate's ``AcceleratedOptimizer``; a grouped
``fully_shard([a, b])`` trains as the single-process reference does, with the step check's
guard on the group's FSDP2 pre-forward.

Before (main at a8f9066): the late ``fully_shard`` died in gloo ("Received data size doesn't
match expected size"); ``dmuon.clip_grad_norm_`` refused ``AcceleratedOptimizer``; the guard
wrapped neither ``blocks.2`` nor ``head`` (the grouped hook is wrapped twice).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import models
from tests.test_core import FP32_ATOL, compare

STEPS = 3


@pytest.mark.parametrize("first", ["forward", "step"])
def test_muon_before_fully_shard_is_refused_by_name(dist_pool, first):
    out = dist_pool.run(2, "tests.order_cases:muon_before_fully_shard", dict(first=first), timeout_s=60)
    for rank, msg in enumerate(out):  # every rank, before FSDP2's first collective
        assert msg.startswith(f"RuntimeError: dmuon: rank {rank}: the model was wrapped by FSDP2's "
                              f"fully_shard"), msg
        assert "Call fully_shard (accelerator.prepare(model)) first" in msg, msg


def test_functions_unwrap_accelerated_optimizer(dist_pool):
    pytest.importorskip("accelerate")
    out = dist_pool.run(2, "tests.order_cases:accelerated_optimizer", dict(steps=STEPS, clip=0.05),
                        timeout_s=120)
    ref, _, ref_norms = models.run_reference(2, STEPS, clip=0.05)
    for o in out:
        np.testing.assert_allclose(o["norms"], ref_norms, rtol=1e-5)
    compare(out[0]["params"], ref, FP32_ATOL)
    compare(out[0]["loaded"], ref, FP32_ATOL)  # dcp.save of state_dict, then dmuon.load
    compare(out[0]["loaded_state_dict"], ref, FP32_ATOL)


@pytest.mark.parametrize("world_size", [2, 4])
def test_grouped_fully_shard_matches_reference_and_is_guarded(dist_pool, world_size):
    out = dist_pool.run(world_size, "tests.order_cases:grouped_fully_shard", dict(steps=STEPS), timeout_s=120)
    ref, _, _ = models.run_reference(world_size, STEPS)
    worst = compare(out[0]["params"], ref, FP32_ATOL)
    print(f"grouped fully_shard([blocks.2, head]) on {world_size} ranks: max |diff| {worst:.3g}")
    for o in out:  # FSDP2's pre-forward of every state, the group's two modules included
        assert o["guarded"] == ["", "blocks.0", "blocks.1", "blocks.2", "head"], o["guarded"]
