"""HSDP cross-replica combination: one collective per (mode, dtype) per rank and step, exact.

Each case trains the test model on a 2x2 ("replicate", "shard") gloo mesh, counts the
collectives dmuon issues on its replicate group per step (tests/replica_cases.py), and compares
every parameter, and every replica's owned fp32 masters, with single-process
``torch.optim.Muon`` + ``AdamW`` on the global batch (tests/models.py:run_reference). The old
per-matrix code issued one collective per owned matrix (3-4 per rank here) and fails the count.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from dmuon.comm.collectives import FlatBucket
from dmuon.comm.hsdp_replicas import batches_by_dtype
from tests import models
from tests.test_core import compare

STEPS = 3
ATOL = 1e-5
# op each mode's gradients cross the replicas with, in finish_backward; "broadcast" adds one
# broadcast of the stepped masters per dtype in publish_after_step.
GRAD_OP = {"compute": "all_reduce", "broadcast": "reduce"}


@pytest.mark.parametrize("replicate_mode", ["compute", "broadcast", "auto"])
def test_hsdp_one_collective_per_mode_and_dtype(dist_pool, replicate_mode):
    out = dist_pool.run(4, "tests.replica_cases:train_counting",
                        {"replicate_mode": replicate_mode, "steps": STEPS, "mixed_auto": replicate_mode == "auto"},
                        timeout_s=180, fresh=True)
    ref, _, _ = models.run_reference(out[0]["dp_count"], STEPS)
    compare(out[0]["params"], ref, ATOL)  # replica 0's masters and FSDP2's parameters
    for o in out:  # every replica's owners hold the reference (broadcast copies included)
        compare(o["owned"], {fqn: ref[fqn] for fqn in o["owned"]}, ATOL)

    all_modes = Counter(m for o in out for m in o["modes"].values())
    if replicate_mode == "auto":
        assert set(all_modes) == {"compute", "broadcast"}, all_modes  # the mixed case is exercised
    else:
        assert set(all_modes) == {replicate_mode}, all_modes
    # The per-matrix code would issue > 1 collective of some kind on some rank: make sure the
    # layout gives some rank >= 2 matrices of one mode, or this test could not fail.
    assert max(Counter(o["modes"].values()).most_common(1)[0][1] for o in out if o["modes"]) >= 2

    for rank, o in enumerate(out):
        # averages and masters are fp32: exactly one collective per mode this rank owns
        expected = Counter()
        for mode in set(o["modes"].values()):
            expected[(GRAD_OP[mode], "torch.float32")] += 1
            if mode == "broadcast":
                expected[("broadcast", "torch.float32")] += 1
        for step, log in enumerate(o["per_step"]):
            assert Counter(log) == expected, (
                f"rank {rank} step {step}: replicate-group collectives {log}, expected {dict(expected)} "
                f"for owned modes {o['modes']}")


def test_flat_batch_round_trips_shapes_and_groups_dtypes():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 4, generator=g), torch.randn(1, 12, generator=g, dtype=torch.float64),
               torch.randn(5, 2, generator=g), torch.randn(7, generator=g, dtype=torch.float64)]
    groups = batches_by_dtype(tensors)
    assert [idx for idx, _ in groups] == [[0, 2], [1, 3]]  # float32 before float64, by name
    for idx, members in groups:
        batch = FlatBucket.of(members)
        assert batch.flat.numel() == sum(t.numel() for t in members)
        for t, view in zip(members, batch.views()):
            np.testing.assert_array_equal(view.numpy(), t.numpy())
            assert view.shape == t.shape and view.dtype == t.dtype
        targets = [torch.zeros_like(t) for t in members]
        torch._foreach_copy_(targets, batch.views())  # as broadcast_masters' receivers
        for t, target in zip(members, targets):
            np.testing.assert_array_equal(target.numpy(), t.numpy())
        flagged = FlatBucket.of(members, [2.0] * len(members))  # presence counts after the tensors
        assert flagged.flag_values() == [2.0] * len(members)
        for t, view in zip(members, flagged.views()):
            np.testing.assert_array_equal(view.numpy(), t.numpy())


def test_flat_batch_refuses_mixed_dtypes_and_empty():
    with pytest.raises(ValueError, match="one dtype"):
        FlatBucket.of([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match="at least one tensor"):
        FlatBucket.of([])
    with pytest.raises(ValueError, match="op must be"):
        FlatBucket.of([torch.zeros(2)]).issue("gather", group=None)
