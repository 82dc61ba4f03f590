"""Clipping by third-party code on a dmuon model (issue 31, item 7): torch's
``clip_grad_norm_(model.parameters())`` (per-tensor and foreach), Accelerate 1.15's
``Accelerator.clip_grad_norm_`` (its ``MULTI_CPU`` and, state forced, its FSDP2 branch), the
transformers ``Trainer``'s ``_clip_grad_norm`` and torchtitan 0.3.0's
``dist_utils.clip_grad_norm_``, each between backward and step with a threshold well below the
true norm, on the FSDP2 path and the replicated path, against single-process
``torch.nn.utils.clip_grad_norm_`` + ``torch.optim.Muon`` + ``AdamW`` (``tests/clip_cases.py``):
every rank reports the single-process norm, and the parameters end where the reference's do.

Before dmuon.comm.owned_grad (main at a8f9066, 2 ranks, step 0, true norm 1.4990): FSDP2 path,
torch / torchtitan raised ``aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor``,
Accelerate and the Trainer returned 1.3518 on rank 0 and 0.7530 on rank 1; replicated path,
every consumer returned 1.3395 / 0.7746.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import clip_cases
from tests.test_core import FP32_ATOL, compare

STEPS, MAX_NORM = 3, 0.05
NEEDS = {"accelerate": "accelerate", "accelerate-fsdp2": "accelerate", "trainer": "transformers"}


def _needs(request: pytest.FixtureRequest, consumer: str) -> dict:
    """Skip without ``consumer``'s package; torchtitan is installed by the test if absent
    (``torchtitan_path`` fixture): returns the ``site`` argument for ``clip_train``."""
    if consumer == "torchtitan":
        return dict(site=request.getfixturevalue("torchtitan_path"))
    if consumer in NEEDS:
        pytest.importorskip(NEEDS[consumer])
    return {}


@pytest.mark.parametrize("mode,consumer,world_size", [
    ("fsdp", "torch", 2),
    ("fsdp", "torch-foreach", 2),
    ("fsdp", "accelerate", 2),
    ("fsdp", "accelerate-fsdp2", 4),
    ("fsdp", "trainer", 2),
    ("fsdp", "torchtitan", 2),
    ("replicated", "torch", 3),
    ("replicated", "accelerate", 2),
    ("replicated", "trainer", 2),
    ("replicated", "torchtitan", 2),
])
def test_third_party_clip_matches_single_process(dist_pool, request, mode, consumer, world_size):
    site = _needs(request, consumer)
    out = dist_pool.run(world_size, "tests.clip_cases:clip_train",
                        dict(mode=mode, consumer=consumer, steps=STEPS, max_norm=MAX_NORM, **site),
                        timeout_s=180)
    ref, ref_norms = clip_cases.reference_norms(world_size, STEPS, MAX_NORM)
    assert min(ref_norms) > 4 * MAX_NORM, "the clip must bite for the test to mean anything"
    assert [o["error"] for o in out] == [None] * world_size, out[0]["error"]
    for rank, o in enumerate(out):  # the single-process norm, on every rank
        np.testing.assert_allclose(o["norms"], ref_norms, rtol=1e-5, err_msg=f"rank {rank}")
    worst = compare(out[0]["params"], ref, FP32_ATOL)
    print(f"{consumer} on the {mode} path, {world_size} ranks: norms {out[0]['norms']}, max |diff| {worst:.3g}")


@pytest.mark.parametrize("mode,consumer", [("fsdp", "torchtitan"), ("replicated", "accelerate")])
def test_third_party_clip_with_a_matrix_no_rank_uses(dist_pool, request, mode, consumer):
    """A matrix without a gradient on any rank: its owner shows absent zeros (every rank must
    hold a gradient for the same parameters), which the norm adds nothing for and dmuon's
    step skips, as ``torch.optim.Muon`` skips ``grad=None``."""
    site = _needs(request, consumer)
    out = dist_pool.run(2, "tests.clip_cases:clip_train", dict(mode=mode, consumer=consumer, steps=STEPS,
                                                               max_norm=MAX_NORM, variant="unused", **site),
                        timeout_s=180)
    ref, ref_norms = clip_cases.reference_norms(2, STEPS, MAX_NORM, variant="unused")
    assert [o["error"] for o in out] == [None, None], out[0]["error"]
    for o in out:
        np.testing.assert_allclose(o["norms"], ref_norms, rtol=1e-5)
    compare(out[0]["params"], ref, FP32_ATOL)


@pytest.mark.parametrize("layout,consumer,replicate_mode", [
    ("hsdp", "torch", "compute"),
    ("hsdp", "accelerate", "broadcast"),
    ("fsdp-tp", "accelerate", "auto"),
])
def test_third_party_clip_on_meshes(dist_pool, request, layout, consumer, replicate_mode):
    """HSDP (replicas' equal copies counted once; "broadcast" matrices held on replica 0 only)
    and FSDP x TP (a TP-split matrix's slices on their TP ranks), 4 ranks. torch's own
    ``clip_grad_norm_`` cannot span FSDP x TP's two meshes (the head is on the "dp" sub-mesh)
    without dmuon either; Accelerate norms per mesh."""
    _needs(request, consumer)
    out = dist_pool.run(4, "tests.clip_cases:mesh_clip_train",
                        dict(layout=layout, consumer=consumer, steps=STEPS, max_norm=MAX_NORM,
                             replicate_mode=replicate_mode), timeout_s=180, fresh=True)
    assert [o["error"] for o in out] == [None] * 4, out[0]["error"]
    ref, ref_norms = clip_cases.reference_norms(out[0]["dp_count"], STEPS, MAX_NORM)
    for rank, o in enumerate(out):
        np.testing.assert_allclose(o["norms"], ref_norms, rtol=1e-5, err_msg=f"rank {rank}")
    worst = compare(out[0]["params"], ref, FP32_ATOL)
    print(f"{consumer} on {layout} ({replicate_mode}): max |diff| {worst:.3g}")


def test_owned_grad_answers_whole_norms_and_refuses_partial_ones():
    """Single process (no group): an OwnedGrad's whole-tensor norms are torch's on the tensor
    (the p-norms of the pieces behind it), a clip scales the pieces, and a norm over some dims,
    or a matrix norm, raises naming dmuon (the rows live on the owner only)."""
    import torch

    from dmuon.comm.owned_grad import OwnedGrad, plain

    g = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    owned = g.clone().as_subclass(OwnedGrad)
    owned.dmuon_pieces, owned.dmuon_counts, owned.dmuon_group, owned.dmuon_absent = [plain(owned)], True, None, False
    for p in (1.0, 2.0, 3.0, float("inf")):
        want = torch.linalg.vector_norm(g, p)
        for got in (torch.linalg.vector_norm(owned, p), owned.norm(p), torch._foreach_norm([owned], p)[0]):
            assert type(got) is torch.Tensor and torch.allclose(got, want, rtol=1e-6), (p, got, want)
    param = torch.nn.Parameter(torch.zeros(5, 3))
    param.grad = owned
    total = torch.nn.utils.clip_grad_norm_([param], 0.5)
    assert torch.allclose(total, g.norm()) and torch.allclose(plain(owned), g * (0.5 / (g.norm() + 1e-6)))
    for bad in (lambda: owned.norm(dim=0), lambda: torch.linalg.vector_norm(owned, 2, 1),
                lambda: torch.linalg.norm(owned, ord=2)):
        with pytest.raises(RuntimeError, match="^dmuon: .*dmuon.clip_grad_norm_"):
            bad()


def test_third_party_norm_counts_every_range_of_a_split_expert_stack(dist_pool):
    """Hugging Face Qwen3-MoE with each expert stack split into owner ranges (the module shows
    only the first range's parameter): torch's ``clip_grad_norm_`` reports the single-process
    norm, every range counted (the norm of a stack range is in the shown gradient's pieces)."""
    import torch

    from tests import moe_cases

    out = dist_pool.run(2, "tests.clip_cases:split_stack_norms", dict(steps=2), timeout_s=180)
    assert out[0]["split_records"] > 0, "the plan must split a stack for the test to mean anything"
    ref, _ = moe_cases.reference("hf-qwen3-moe", 2, steps=1)  # the parameters after step 0
    want = []
    for step, initial in ((0, None), (1, ref)):
        model = moe_cases.build("hf-qwen3-moe")
        if initial is not None:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(torch.as_tensor(initial[n]))
        moe_cases.CASES["hf-qwen3-moe"].loss(model, *moe_cases.CASES["hf-qwen3-moe"].batch(
            step, moe_cases.LOCAL_BATCH * 2)).backward()
        want.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
    for o in out:
        np.testing.assert_allclose(o["norms"], want, rtol=1e-5)


@pytest.mark.parametrize("consumer", ["accelerate", "trainer"])
def test_third_party_norm_under_expert_parallelism(dist_pool, request, consumer):
    """Experts over ("efsdp", "ep") = (2, 2), dense matrices over all 4 ranks, each expert
    stack split into owner ranges: Accelerate and the Trainer (one norm per DTensor mesh, plain
    gradients as replicas) report the single-process norm on every rank, each expert once."""
    _needs(request, consumer)
    from tests import ep_cases

    out = dist_pool.run(4, "tests.clip_cases:expert_parallel_norm", dict(consumer=consumer), timeout_s=180,
                        fresh=True)
    want = ep_cases.reference_grad_norm("ep-moe", 4)
    np.testing.assert_allclose(out, [want] * 4, rtol=1e-5)
