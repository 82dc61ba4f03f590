"""dmuon on models nobody in this project wrote (issue 14): torch's ``nn.TransformerEncoder``,
Hugging Face Llama (tied and untied embeddings, activation checkpointing) and ViT, a module
called twice per forward, a block reused across depth. FSDP2 per block + root on gloo ranks,
fp32 exact mode, against single-process ``torch.optim.Muon`` + ``AdamW``
(``tests/thirdparty_cases.py``); and ``default_predicate`` across ``fully_shard``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import thirdparty_cases as cases
from tests.test_core import FP32_ATOL, compare

STEPS = 3


@pytest.mark.parametrize("case,world_size,checkpointing", [
    ("torch-encoder", 2, False),
    ("linear-twice", 3, False),
    ("block-reused", 4, False),
    ("hf-llama-untied", 2, False),
    ("hf-llama-tied", 2, False),
    ("hf-llama-untied", 2, True),
    ("hf-vit", 2, False),
])
def test_thirdparty_model_matches_reference(dist_pool, case, world_size, checkpointing):
    out = dist_pool.run(world_size, "tests.thirdparty_cases:train",
                        dict(case=case, steps=STEPS, checkpointing=checkpointing), timeout_s=120)
    ref, ref_losses = cases.reference(case, world_size, STEPS)
    assert out[0]["dedicated"] == sorted(cases.matrix_names(case, cases.build(case)))
    worst = compare(out[0]["params"], ref, FP32_ATOL)
    print(f"{case} on {world_size} ranks: max |diff| {worst:.3g}")  # for the issue note (-s)
    np.testing.assert_allclose(np.mean([o["losses"] for o in out], axis=0), ref_losses, rtol=1e-5)
    # Outside forward/backward every dedicated parameter is the master or a placeholder.
    assert [o["violations"] for o in out] == [[]] * world_size


@pytest.mark.parametrize("case", ["torch-encoder", "hf-llama-tied"])
def test_default_predicate_built_before_fully_shard(dist_pool, case):
    """Built before ``fully_shard`` (which replaces every parameter object) and used after:
    the same selection as the reference's by-name list; embeddings (and a head tied to one)
    never selected."""
    out = dist_pool.run(2, "tests.thirdparty_cases:predicate_across_fully_shard", dict(case=case),
                        timeout_s=60)
    expected = sorted(cases.matrix_names(case, cases.build(case)))
    assert out == [expected, expected]
    assert not set(cases.CASES[case].embeddings) & set(out[0])


@pytest.mark.parametrize("case,dedicate_first", [("linear-twice", False), ("linear-twice", True),
                                                  ("hf-llama-untied", False)])
def test_meta_device_init_matches_fsdp2_then_reference(dist_pool, case, dedicate_first):
    """Meta build, fully_shard, dedicate_params (or dedicate_params first), to_empty, the
    model's own init (reset_parameters / HF init_weights), Muon: every matrix starts exactly
    where FSDP2 alone starts with the same flow and seed, then trains as the single-process
    reference does."""
    out = dist_pool.run(2, "tests.thirdparty_cases:meta_init_train",
                        dict(case=case, steps=STEPS, dedicate_first=dedicate_first), timeout_s=120)
    fsdp_initial = {n: torch.from_numpy(v) for n, v in out[0]["fsdp_initial"].items()}
    assert compare(out[0]["dmuon_initial"], fsdp_initial, 0.0) == 0.0
    ref, ref_losses = cases.reference(case, 2, STEPS, initial=fsdp_initial)
    print(f"meta init {case}: max |diff| {compare(out[0]['params'], ref, FP32_ATOL):.3g}")
    np.testing.assert_allclose(np.mean([o["losses"] for o in out], axis=0), ref_losses, rtol=1e-5)
    assert [o["violations"] for o in out] == [[], []]


def test_muon_on_meta_parameters_is_refused(dist_pool):
    out = dist_pool.run(2, "tests.thirdparty_cases:meta_muon_too_early", dict(case="linear-twice"),
                        timeout_s=60)
    for msg in out:  # every rank, before any collective
        assert msg.startswith("RuntimeError: dmuon: 5 dedicated matrices are still on the meta device "
                              "('blocks.0.fc.weight', 'blocks.0.out.weight', 'blocks.1.fc.weight' and 2 more)"), msg
        assert "model.to_empty(device=...)" in msg and "then dmuon.Muon(model, ...)" in msg
