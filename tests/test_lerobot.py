"""dmuon with LeRobot's policies (issue 41): ``dmuon.integrations.lerobot.fully_shard_policy``
+ ``dedicate_params`` + ``dmuon.Muon`` on 2 gloo ranks against single-process
``torch.optim.Muon`` + ``AdamW`` (``tests/lerobot_cases.py``), for tiny pi0, pi05, SmolVLA and
ACT (and diffusion where ``diffusers`` is installed) built by LeRobot 0.6.1's own classes (random weights, no hub).

Each: the default call (``dedicate_params(policy, mesh)`` without ``predicate=``, issue 45),
3 steps, gradient accumulation 2, clipping active at every step; every parameter within
1e-5 of the reference except the noise-driven entries (``lerobot_cases.noise_driven``: attention
key biases and ACT's first decoder self-attention's query/key rows, whose true gradient is ~0),
which are only bounded by the optimizer's largest step; no ``lm_head`` is dedicated and each
rank stores between 0.4 and 0.6 of the parameters. Skipped where LeRobot is not installed (the Python 3.11 CI job).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("lerobot")
from tests import lerobot_cases as cases  # noqa: E402 - after the skip

pytestmark = [pytest.mark.lerobot, pytest.mark.slow]

FP32_ATOL = 1e-5


@pytest.mark.parametrize("name", ["pi0", "pi05", "smolvla", "act", "diffusion"])
def test_fully_shard_policy_matches_reference(dist_pool, name):
    if name == "diffusion":
        pytest.importorskip("diffusers")  # lerobot[diffusion]
    out = dist_pool.run(2, "tests.lerobot_cases:dmuon_run", dict(name=name), timeout_s=300)
    ref, ref_losses, ref_norms = cases.reference(name, 2)
    torch.manual_seed(0)
    noisy = cases.noise_driven(cases.build(name))
    got = out[0]["params"]
    assert set(got) == set(ref)
    worst, worst_noisy = 0.0, 0.0
    for n, value in ref.items():
        diff = np.abs(got[n] - value)
        if n in noisy:
            worst_noisy = max(worst_noisy, float(diff[noisy[n]].max()))
            diff[noisy[n]] = 0.0
        worst = max(worst, float(diff.max()))
        assert diff.max() <= FP32_ATOL, (n, float(diff.max()))
    # noise-driven entries: no more than the optimizer's largest possible move in STEPS steps
    # (AdamW: adamw_lr per step; Muon: lr * sqrt(max(1, rows/cols)) <= lr * sqrt(3))
    assert worst_noisy <= cases.STEPS * 2 * cases.OPT_KWARGS["lr"]
    print(f"{name}: max |diff| {worst:.3g} (noise-driven entries {worst_noisy:.3g}), "
          f"local fractions {[o['local_fraction'] for o in out]}")
    np.testing.assert_allclose(out[0]["losses"], ref_losses, rtol=1e-5)
    for o in out:  # the stock clip returns the global norm on every rank
        np.testing.assert_allclose(o["norms"], ref_norms, rtol=1e-5)
    assert min(ref_norms) > cases.MAX_NORM  # the clip is active at every step
    assert out[0]["dedicated"] == sorted(cases.matrix_names(cases.build(name)))
    # each rank holds about half the parameters: the default dedicate_params call leaves the
    # lm_heads to FSDP2 (issue 45: without the declared predicate one pi0 rank held 0.99)
    for o in out:
        assert 0.4 < o["local_fraction"] < 0.6, [o["local_fraction"] for o in out]
        for n, share in o["lm_head_shares"].items():  # sharded, not held whole by an owner
            assert abs(share - 1 / len(out)) < 0.01, (n, share)


def test_unknown_policy_type_is_refused_by_name():
    from dmuon.integrations import lerobot as dl

    class VQBeTPolicy(torch.nn.Module):
        name = "vqbet"

    with pytest.raises(ValueError, match="dmuon: .*'vqbet'.*Shard it by hand"):
        dl.fully_shard_policy(VQBeTPolicy(), mesh=None)


def test_units_are_the_modules_lerobot_calls():
    """pi0's units: per decoder layer (PaliGemma's and the expert's) q/k/v/o and the MLP, per
    SigLIP layer the layer; never a decoder layer itself (its pre-forward hook never fires)."""
    from dmuon.integrations import lerobot as dl

    torch.manual_seed(0)
    policy = cases.build("pi0")
    names = {m: n for n, m in policy.named_modules()}
    units = [names[u] for u in dl.fsdp_units(policy)]
    # 2 + 2 decoder layers x 5, 1 vision layer
    assert len(units) == 21
    assert not any(u.endswith(("layers.0", "layers.1")) and "vision" not in u for u in units)
    assert "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp" in units


def test_dmuon_options_are_split_from_lerobot_arguments():
    from dmuon.integrations.lerobot.train import DmuonArgs, split_argv

    rest, args = split_argv(["--policy.type=pi0", "--dmuon.lr=0.05", "--steps=3",
                             "--dmuon.param_dtype=bfloat16"])
    assert rest == ["--policy.type=pi0", "--steps=3"]
    assert args == DmuonArgs(lr=0.05, param_dtype="bfloat16")
    with pytest.raises(ValueError, match="dmuon: unknown or valueless option '--dmuon.lrr=1'"):
        split_argv(["--dmuon.lrr=1"])
    with pytest.raises(ValueError, match="--dmuon.param_dtype='fp8'; use float32 or bfloat16"):
        split_argv(["--dmuon.param_dtype=fp8"])
