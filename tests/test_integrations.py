"""dmuon from 🤗 Accelerate and the transformers ``Trainer`` (issue 32), on 2 gloo ranks, against
single-process ``torch.optim.Muon`` + ``AdamW`` (``tests/integrations_cases.py``).

Each test: a tiny HF Llama, 4 steps with gradient accumulation 2 and active clipping through
the trainer's own calls, within 1e-5 of the reference (weights, losses, the clip's norms); a
resume from the trainer's own checkpoint that continues bitwise; the trainer's own full-weight
export. The tests force Accelerate's state to FSDP2 on CPU (see the cases module); on GPUs
the plugin / ``TrainingArguments(fsdp=...)`` alone does it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import integrations_cases as cases
from tests.test_core import FP32_ATOL, compare

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


def _np(d: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in d.items()}


def test_accelerate_loop_matches_reference_resumes_and_exports(dist_pool, tmp_path):
    out = dist_pool.run(2, "tests.integrations_cases:accelerate_run",
                        dict(ckpt_dir=str(tmp_path / "ckpt")), timeout_s=180)
    # Accelerate's scheduler steps num_processes times per optimizer step (its own rule).
    ref, ref_losses, ref_norms = cases.reference(2, scheduler_steps_per_step=2)
    rank0 = out[0]
    assert out[1]["exported"] == {}  # as FSDP2's full state dict: rank 0 only
    worst = compare(rank0["exported"], ref, FP32_ATOL)
    print(f"accelerate: max |diff| {worst:.3g}, norms {rank0['norms']} vs {ref_norms}")
    np.testing.assert_allclose(rank0["losses"], ref_losses, rtol=1e-5)
    # accelerator.clip_grad_norm_ returns the true global norm, the same on every rank
    for o in out:
        np.testing.assert_allclose(o["norms"], ref_norms, rtol=1e-5)
    assert min(ref_norms) > 10 * cases.MAX_NORM  # the clip is active at every step
    # load_state resumes exactly: the same weights, losses and learning rates
    assert set(rank0["resumed"]) == set(rank0["exported"])
    for name, value in rank0["exported"].items():
        np.testing.assert_array_equal(rank0["resumed"][name], value, err_msg=name)
    assert rank0["resumed_losses"] == rank0["losses"][cases.SAVE_AFTER:]
    assert rank0["resumed_lrs"] == rank0["lrs"]


def test_trainer_matches_reference_resumes_and_exports(dist_pool, tmp_path):
    out = dist_pool.run(2, "tests.integrations_cases:trainer_run",
                        dict(out_dir=str(tmp_path / "run")), timeout_s=240)
    ref, ref_losses, ref_norms = cases.reference(2, schedule="linear")
    rank0 = out[0]
    assert rank0["kinds"] == ["muon", "adamw"]  # the trainer's optimizer is dmuon.Muon
    worst = compare(rank0["exported"], ref, FP32_ATOL)  # save_model(): full weights
    print(f"trainer: max |diff| {worst:.3g}, logged grad_norm {rank0['norms']} vs {ref_norms}, "
          f"loss {rank0['losses']} vs {ref_losses}")
    compare(rank0["checkpoint"], ref, FP32_ATOL)  # the save_steps checkpoint's weights too
    # the logged grad_norm is the true global norm (max_grad_norm clips every step)
    np.testing.assert_allclose(rank0["norms"], ref_norms, rtol=1e-5)
    assert min(ref_norms) > 10 * cases.MAX_NORM
    np.testing.assert_allclose(rank0["losses"], ref_losses, rtol=1e-5)
    # train(resume_from_checkpoint=checkpoint-2) continues exactly
    for name, value in rank0["exported"].items():
        np.testing.assert_array_equal(rank0["resumed"][name], value, err_msg=name)
    assert rank0["resumed_norms"] == rank0["norms"][cases.SAVE_AFTER:]
    assert rank0["resumed_losses"] == rank0["losses"][cases.SAVE_AFTER:]
    assert rank0["resumed_lrs"] == rank0["lrs"]
