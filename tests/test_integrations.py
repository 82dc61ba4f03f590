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
from safetensors.torch import load_file  # noqa: E402 - after the skips
from transformers import AutoModelForCausalLM  # noqa: E402


def _np(d: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in d.items()}


def _by_parameter(weights: dict[str, np.ndarray], case: str) -> dict[str, np.ndarray]:
    """An export keyed as ``named_parameters()``: a tied head is a state-dict key of its own
    (``lm_head.weight``, equal to the embedding) that ``named_parameters()`` lists once."""
    if case != "hf-llama-tied" or "lm_head.weight" not in weights:  # save_pretrained drops it
        return weights
    np.testing.assert_array_equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    return {k: v for k, v in weights.items() if k != "lm_head.weight"}


# Untied head: Accelerate shards [norm, lm_head] as one FSDP2 group, lm_head on Muon. Tied:
# [norm, embed_tokens, lm_head] as one group, both on AdamW. With the trainer's own FSDP2
# activation checkpointing (checkpoint_wrapper around each decoder layer) the checkpoint keys
# are canonical ("_checkpoint_wrapped_module." stripped, issue 31), so the save and resume work.
VARIANTS = [("hf-llama-untied", False), ("hf-llama-tied", False), ("hf-llama-untied", True)]


@pytest.mark.parametrize("case,activation_checkpointing", VARIANTS)
def test_accelerate_loop_matches_reference_resumes_and_exports(dist_pool, tmp_path, case,
                                                               activation_checkpointing):
    out = dist_pool.run(2, "tests.integrations_cases:accelerate_run",
                        dict(ckpt_dir=str(tmp_path / "ckpt"), case=case,
                             activation_checkpointing=activation_checkpointing), timeout_s=180)
    # Accelerate's scheduler steps num_processes times per optimizer step (its own rule).
    ref, ref_losses, ref_norms = cases.reference(2, scheduler_steps_per_step=2, case=case)
    rank0 = out[0]
    assert out[1]["exported"] == {}  # as FSDP2's full state dict: rank 0 only
    worst = compare(_by_parameter(rank0["exported"], case), ref, FP32_ATOL)
    print(f"accelerate {case} ac={activation_checkpointing}: max |diff| {worst:.3g}, norms {rank0['norms']} vs {ref_norms}")
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
    # accelerator.save_model wrote the same full weights
    saved = load_file(str(tmp_path / "ckpt" / "export" / "model.safetensors"))
    compare(_by_parameter(_np(saved), case), ref, FP32_ATOL)


@pytest.mark.parametrize("case,activation_checkpointing", VARIANTS)
def test_trainer_matches_reference_resumes_and_exports(dist_pool, tmp_path, case,
                                                       activation_checkpointing):
    out = dist_pool.run(2, "tests.integrations_cases:trainer_run",
                        dict(out_dir=str(tmp_path / "run"), case=case,
                             activation_checkpointing=activation_checkpointing), timeout_s=240)
    ref, ref_losses, ref_norms = cases.reference(2, schedule="linear", case=case)
    rank0 = out[0]
    assert rank0["kinds"] == ["muon", "adamw"]  # the trainer's optimizer is dmuon.Muon
    worst = compare(_by_parameter(rank0["exported"], case), ref, FP32_ATOL)  # save_model(): full weights
    print(f"trainer {case} ac={activation_checkpointing}: max |diff| {worst:.3g}, logged grad_norm {rank0['norms']} vs {ref_norms}, "
          f"loss {rank0['losses']} vs {ref_losses}")
    compare(_by_parameter(rank0["checkpoint"], case), ref, FP32_ATOL)  # the save_steps checkpoint's weights too
    # the logged grad_norm is the true global norm (max_grad_norm clips every step)
    np.testing.assert_allclose(rank0["norms"], ref_norms, rtol=1e-5)
    assert min(ref_norms) > 10 * cases.MAX_NORM
    np.testing.assert_allclose(rank0["losses"], ref_losses, rtol=1e-5)
    # trainer.evaluate() after training: the reference model's loss on the same batches
    np.testing.assert_allclose(rank0["eval_loss"], cases.reference_eval_loss(ref, 2, case), rtol=1e-5)
    # train(resume_from_checkpoint=checkpoint-2) continues exactly
    for name, value in rank0["exported"].items():
        np.testing.assert_array_equal(rank0["resumed"][name], value, err_msg=name)
    # what save_model() wrote loads with from_pretrained (push_to_hub ready)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "final"))
    compare({n: p.detach().numpy() for n, p in loaded.named_parameters()}, ref, FP32_ATOL)
    assert rank0["resumed_norms"] == rank0["norms"][cases.SAVE_AFTER:]
    assert rank0["resumed_losses"] == rank0["losses"][cases.SAVE_AFTER:]
    assert rank0["resumed_lrs"] == rank0["lrs"]


def test_import_dmuon_imports_no_trainer():
    """``import dmuon`` (and the integrations package) imports neither trainer."""
    import subprocess
    import sys

    code = ("import sys, dmuon, dmuon.integrations, dmuon.integrations.accelerate; "
            "print(sorted(m for m in ('accelerate', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_misuse_is_refused_by_name():
    import types

    import dmuon.integrations.accelerate as dmuon_accelerate
    from dmuon.integrations.transformers import DmuonTrainer

    not_fsdp2 = types.SimpleNamespace(is_fsdp2=False, distributed_type="MULTI_GPU", _models=[])
    with pytest.raises(ValueError, match=r"^dmuon: dmuon.integrations.accelerate.prepare needs "
                                         r"Accelerate's FSDP2 \(got distributed_type MULTI_GPU\)"):
        dmuon_accelerate.prepare(not_fsdp2, torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"^dmuon: DmuonTrainer builds dmuon.Muon itself; drop "
                                         r"\['optimizers'\] and pass its hyper-parameters as muon_kwargs"):
        sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])
        DmuonTrainer(model=torch.nn.Linear(2, 2), optimizers=(sgd, None))
