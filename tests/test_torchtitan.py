"""dmuon as torchtitan 0.3.0's optimizer (issue 32, item 3), on 2 gloo ranks, against
single-process ``torch.optim.Muon`` + ``AdamW`` (``tests/torchtitan_cases.py``).

torchtitan's llama3 debug model, torchtitan's own ``parallelize`` (FSDP2, gradient divide
factor 1.0) and its optimizer container (:class:`dmuon.integrations.torchtitan.
DmuonOptimizersContainer`) on both of dmuon's paths, 4 steps with gradient accumulation 2 and
torchtitan's own clip active at every step; with its ``LRSchedulersContainer`` and its full /
selective activation checkpointing; its ``CheckpointManager`` (save, bitwise resume) and
exports on the hooks path (``tests/torchtitan_ckpt_cases.py``). torchtitan is not in the test
extra (its full install pins other packages): the ``torchtitan_path`` fixture
(``tests/conftest.py``) pip-installs it with ``--no-deps`` into a cache folder when the
environment lacks it, and fails when it cannot (``DMUON_TESTS_OFFLINE=1``: skip instead).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests import torchtitan_cases as cases
from tests.test_core import FP32_ATOL, compare

# (dmuon path, torchtitan's LR scheduler, torchtitan's activation checkpointing)
CASES = [
    ("hooks", False, None),
    ("distributed_config", False, None),
    ("hooks", True, "full"),
    ("distributed_config", True, "selective"),
]


@functools.lru_cache(maxsize=None)
def _reference(lr_schedule: bool, site: str | None):
    return cases.reference(2, lr_schedule=lr_schedule, site=site)


@pytest.mark.slow
@pytest.mark.parametrize("path,lr_schedule,ac", CASES,
                         ids=["hooks", "distributed_config", "hooks-lr-fullAC",
                              "distributed_config-lr-selectiveAC"])
def test_torchtitan_parallelize_and_container_match_reference(dist_pool, torchtitan_path, path,
                                                              lr_schedule, ac):
    out = dist_pool.run(2, "tests.torchtitan_cases:run",
                        dict(site=torchtitan_path, path=path, lr_schedule=lr_schedule, ac=ac),
                        timeout_s=300, fresh=True)
    ref, ref_losses, ref_norms = _reference(lr_schedule, torchtitan_path)
    rank0 = out[0]
    if torchtitan_path is not None:  # the workers imported the copy the fixture installed
        assert rank0["torchtitan_file"].startswith(torchtitan_path), rank0["torchtitan_file"]
    assert rank0["muon_names"] == sorted(cases.matrix_names(cases.build_model(meta=True)))
    worst = compare(rank0["final"], ref, FP32_ATOL)
    print(f"torchtitan {path} lr_schedule={lr_schedule} ac={ac}: max |diff| {worst:.3g}, "
          f"norms {rank0['norms']} vs {ref_norms}, lrs {rank0['lrs']}")
    np.testing.assert_allclose(rank0["losses"], ref_losses, rtol=1e-5)
    # The learning rates each step used: torchtitan's schedule on every group (Muon's lr and
    # AdamW's adamw_lr scaled by the same factor), the reference's by hand.
    factors = cases.LR_FACTORS[:cases.STEPS] if lr_schedule else (1.0,) * cases.STEPS
    base = [cases.MUON_KWARGS["lr"], cases.MUON_KWARGS["adamw_lr"]]
    np.testing.assert_allclose(rank0["lrs"], [[f * b for b in base] for f in factors], rtol=1e-12)
    # torchtitan's clip_grad_norm_ gives the global norm, the same on every rank, here compared
    # with the reference's float64 norm. The hooks path within 1e-5 (dmuon's dedicated
    # gradients report their norms summed in float64). The distributed_config path within 5e-5:
    # its gradients are FSDP2's own DTensors, whose norms torch's CPU kernel accumulates in
    # fp32 (the error grows with the tensor's size): at step 0 the total norm is 2.2e-5 off the
    # float64 one (lm_head's two [1024, 256] shards: 1.0008177 vs 1.0008426), while the
    # gradients themselves equal the single-process ones (total |grad|^2 within 7e-11
    # relative). Every weight stays within 1e-5 either way.
    assert out[0]["norms"] == out[1]["norms"]
    np.testing.assert_allclose(rank0["norms"], ref_norms, rtol=1e-5 if path == "hooks" else 5e-5)
    assert min(ref_norms) > 10 * cases.MAX_NORM  # the clip is active at every step


def test_container_refuses_an_unknown_path(torchtitan_path):
    from dmuon.integrations.torchtitan import DmuonOptimizersContainer

    with pytest.raises(ValueError, match=r"dmuon: DmuonOptimizersContainer\.Config\.path is 'fsdp'"):
        DmuonOptimizersContainer.Config(path="fsdp").build(model_parts=[])


def test_container_distributed_config_path_refuses_hooks_options(torchtitan_path):
    from torch import nn

    from dmuon.integrations.torchtitan import DmuonOptimizersContainer

    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"dedicate_kwargs has \['mesh'\], which only the hooks path"):
        DmuonOptimizersContainer.Config(path="distributed_config", dedicate_kwargs=dict(mesh=None)
                                        ).build(model_parts=[model])
    with pytest.raises(ValueError, match=r"distributed_config is a str; pass a dmuon.DistributedConfig"):
        DmuonOptimizersContainer.Config(path="distributed_config", distributed_config="dtensor"
                                        ).build(model_parts=[model])
    with pytest.raises(ValueError, match=r"asks for 2 row blocks of 'weight'"):
        DmuonOptimizersContainer.Config(path="distributed_config",
                                        dedicate_kwargs=dict(predicate=lambda name, p: 2)
                                        ).build(model_parts=[model])
    with pytest.raises(ValueError, match=r"'bias' of shape \(3,\) is picked for Muon"):
        DmuonOptimizersContainer.Config(path="distributed_config",
                                        dedicate_kwargs=dict(predicate=lambda name, p: True)
                                        ).build(model_parts=[model])


@pytest.mark.slow
@pytest.mark.parametrize("path", ["hooks", "distributed_config"])
def test_torchtitan_checkpoint_manager_resumes_bitwise_and_exports(dist_pool, torchtitan_path, tmp_path, path):
    """torchtitan's own CheckpointManager (model + dmuon's optimizer container + LR scheduler)
    saves at step 2 and a fresh trainer resumes from it bitwise; model.state_dict() (with
    torchtitan's fused-QKV split into wq/wk/wv) and the model-only last-step checkpoint are the
    reference's weights (tests/torchtitan_ckpt_cases.py)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests import torchtitan_ckpt_cases as ckpt

    out = dist_pool.run(2, "tests.torchtitan_ckpt_cases:run_ckpt",
                        {"folder": str(tmp_path), "site": torchtitan_path, "path": path}, timeout_s=600,
                        fresh=True)
    rank0 = out[0]
    ref, ref_losses, _ = _reference(False, torchtitan_path)
    ref_sd = ckpt.reference_state_dict(ref, torchtitan_path)
    assert {"layers.0.attention.qkv_linear.wq.weight", "layers.0.attention.qkv_linear.wv.weight"} <= set(ref_sd)
    # the uninterrupted run: the reference's losses and, exported, its weights (wq/wk/wv split)
    np.testing.assert_allclose(rank0["losses_a"], ref_losses, rtol=1e-5)
    assert sorted(rank0["export"]) == sorted(ref_sd)
    worst = compare(rank0["export"], ref_sd, FP32_ATOL)
    # the resumed run: bitwise the uninterrupted one
    assert rank0["saved"] == [f"step-{ckpt.SAVE_AT}", f"step-{cases.STEPS}"]
    assert [o["last_epoch_b"] for o in out] == [ckpt.SAVE_AT] * 2
    assert rank0["losses_b"] == rank0["losses_a"][ckpt.SAVE_AT:]
    assert sorted(rank0["final_b"]) == sorted(rank0["export"])
    for key, value in rank0["export"].items():
        assert np.array_equal(rank0["final_b"][key], value), key
    # dmuon's own checkpoint (dmuon.state_dict + dcp.save, dmuon.load) of the same step: bitwise too
    # (inside dmuon.state_dict, torchtitan's fused-QKV split hook meets a meta tensor, not a
    # non-owner's zero-size placeholder)
    assert rank0["losses_c"] == rank0["losses_a"][ckpt.SAVE_AT:]
    for key, value in rank0["export"].items():
        assert np.array_equal(rank0["final_c"][key], value), key
    # torchtitan's model-only last-step checkpoint (last_save_model_only, float32)
    torch_path = tmp_path / "last.pt"
    dcp_to_torch_save(str(tmp_path / "checkpoint" / f"step-{cases.STEPS}"), str(torch_path))
    last = torch.load(torch_path, weights_only=True)
    assert sorted(last) == sorted(ref_sd)
    worst_last = compare({k: v.numpy() for k, v in last.items()}, ref_sd, FP32_ATOL)
    # torchtitan's Hugging Face export (last_save_in_hf), mapped back by its llama3 adapter
    hf = ckpt.hf_export_native(str(tmp_path / "hf" / f"step-{cases.STEPS}"))
    assert sorted(hf) == sorted(ref_sd)
    worst_hf = compare({k: v.numpy() for k, v in hf.items()}, ref_sd, FP32_ATOL)
    print(f"torchtitan checkpoint ({path}): export max |diff| {worst:.3g}, last-step checkpoint {worst_last:.3g}, "
          f"HF export {worst_hf:.3g}, "
          f"resumed losses {rank0['losses_b']} == {rank0['losses_a'][ckpt.SAVE_AT:]}")
