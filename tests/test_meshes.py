"""HSDP, TP and FSDP x TP against single-process torch.optim.Muon + AdamW (fp32 exact mode).

The test model's fc1 (hidden 7, 20, 13) is column-parallel and fc2 row-parallel, so TP slices
are uneven (7 and 13 over 2 ranks); the head ([1, 12]) and the embedding stay whole: a model
mixing TP and non-TP matrices.
"""

from __future__ import annotations

import pytest
import torch

from tests import models
from tests.test_core import compare

STEPS = 5
ATOL = 1e-5


@pytest.mark.parametrize("layout,world_size,overlap", [
    ("hsdp", 4, "off"), ("fsdp-tp", 4, "off"), ("tp", 2, "off"),
    pytest.param("hsdp-tp", 8, "off", marks=pytest.mark.slow),
    ("hsdp", 4, "forward"), ("fsdp-tp", 4, "backward")])  # Muon(overlap=...): dmuon.owners.overlap
def test_mesh_matches_single_process_reference(dist_pool, layout, world_size, overlap):
    out = dist_pool.run(world_size, "tests.mesh_cases:train", dict(layout=layout, steps=STEPS, overlap=overlap),
                        timeout_s=240, fresh=True)
    ref, _, _ = models.run_reference(out[0]["dp_count"], STEPS)
    compare(out[0]["params"], ref, ATOL)
    # overlap cannot take effect under TP (collective Newton-Schulz): said once, by name
    says = [w for w in out[0]["warnings"] if "has no effect" in w]
    assert len(says) == (1 if overlap != "off" and "tp" in layout else 0), out[0]["warnings"]


@pytest.mark.parametrize("mode", ["compute", "broadcast"])
def test_hsdp_replica_modes_are_both_exact(dist_pool, mode):
    out = dist_pool.run(4, "tests.mesh_cases:train", dict(layout="hsdp", steps=3, replicate_mode=mode),
                        timeout_s=120, fresh=True)
    ref, _, _ = models.run_reference(out[0]["dp_count"], 3)
    compare(out[0]["params"], ref, ATOL)
    n = len(models.matrix_names(models.make_model()))
    per_replica = [sum(o["ns_counts"][0] for o in out if o["replicate_rank"] == r) for r in (0, 1)]
    # NS at most once per matrix per replica group; "broadcast" runs it on replica 0 only.
    assert per_replica == ([n, n] if mode == "compute" else [n, 0])


@pytest.mark.parametrize("layout,world_size", [("fsdp-tp", 4), ("hsdp", 4)])
def test_clip_grad_norm_on_meshes(dist_pool, layout, world_size):
    out = dist_pool.run(world_size, "tests.mesh_cases:train", dict(layout=layout, steps=3, clip=0.05),
                        timeout_s=120, fresh=True)
    ref, _, ref_norms = models.run_reference(out[0]["dp_count"], 3, clip=0.05)
    for o in out:
        torch.testing.assert_close(torch.tensor(o["norms"]), torch.tensor(ref_norms), rtol=1e-6, atol=0)
    compare(out[0]["params"], ref, ATOL)


def test_tp_orthogonalizes_each_matrix_once(dist_pool):
    out = dist_pool.run(4, "tests.mesh_cases:train", dict(layout="fsdp-tp", steps=2), timeout_s=120, fresh=True)
    n = len(models.matrix_names(models.make_model()))
    assert [sum(o["ns_counts"][s] for o in out) for s in range(2)] == [n, n]


def test_unsupported_placement_names_parameter(dist_pool):
    out = dist_pool.run(2, "tests.mesh_cases:unsupported_placement", {}, timeout_s=60, fresh=True)
    for message in out:
        assert "head.weight" in message and "Partial" in message, message
