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
    if name in ("pi0", "pi05"):  # issue 46: units in the order LeRobot runs them, VLM and
        # expert layers interleaved (registration order had every VLM layer first)
        for o in out:
            units = o["units"]
            vlm1 = units.index(next(u for u in units if "language_model.layers.1.self_attn.q_proj" in u))
            expert0 = units.index(next(u for u in units if "gemma_expert.model.layers.0.self_attn.q_proj" in u))
            assert expert0 < vlm1, units


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


@pytest.mark.parametrize("name, alpha, overrides", [
    ("pi0", 0.5, {}),
    ("smolvla", 0.5, {"train_expert_only": False}),
    ("smolvla", 1.0, {}),  # SmolVLA's default: the VLM is frozen
    # every layer cross-attention: a trained VLM's prefix attention whose keys the expert reads
    ("smolvla", 0.5, {"train_expert_only": False, "self_attn_every_n_layers": -1}),
], ids=["pi0", "smolvla-all-trained", "smolvla-expert-only", "smolvla-cross"])
def test_qk_clip_bounds_the_decoder_logits_lerobot_computes(dist_pool, name, alpha, overrides):
    """Issue 45: pi0 / SmolVLA compute their decoder attention outside the attention modules'
    forward; fully_shard_policy records it where LeRobot computes it. A clip-only step at tau =
    half the smallest max logit leaves the max logit of every decoder attention block whose
    queries train <= tau on the same batch (each layer on the hidden states of the step), on
    every rank, read from LeRobot's own softmax input, not from dmuon; the largest over ranks
    is tau itself, as the clip scales those logits exactly (a joint attention of trained models:
    both models' q and k rows take the layer's eta; SmolVLA's VLM prefix attention in a
    cross-attention layer: one eta for all heads; next to a frozen VLM, qk_clip_alpha=1: all of
    eta on the expert's queries), except the expert's cross-attention (bounded, its keys also
    shrink with the VLM's). A frozen VLM's own logits do not change."""
    out = dist_pool.run(2, "tests.lerobot_cases:qk_clip_run",
                        dict(name=name, alpha=alpha, **overrides), timeout_s=300)
    tau, blocks = out[0]["tau"], out[0]["blocks"]
    assert all([(b["layer"], b["kind"]) for b in o["blocks"]] == [(b["layer"], b["kind"]) for b in blocks]
               for o in out)
    assert len(blocks) == 4  # 2 layers x (VLM, expert) query rows
    lines, units = [], {}
    for i, block in enumerate(blocks):
        before = max(max(o["blocks"][i]["before"]) for o in out)
        after = max(max(o["blocks"][i]["after"]) for o in out)
        what = f"layer {block['layer']} {('VLM', 'expert')[block['model']]} {block['kind']}"
        lines.append(f"{name} {what}: max logit {before:.4g} -> {after:.4g}")
        if not block["trains"]:
            for o in out:
                np.testing.assert_allclose(o["blocks"][i]["after"], o["blocks"][i]["before"], rtol=1e-6)
            continue
        for o in out:
            assert max(o["blocks"][i]["after"]) <= tau * (1 + 1e-5), (what, o["blocks"][i]["after"], tau)
        if block["kind"] != "cross":
            # one eta per clip unit: a joint layer of trained models (both models' rows), else
            # each model's own rows; the unit's largest logit over ranks lands on tau
            joint = block["kind"] == "joint" and all(b["trains"] for b in blocks
                                                     if b["layer"] == block["layer"])
            unit = units.setdefault((block["layer"], None if joint else block["model"]), [])
            unit.append((before, after))
    for key, unit in units.items():
        assert max(b for b, _ in unit) > tau, key
        assert max(a for _, a in unit) == pytest.approx(tau, rel=1e-5), (key, unit, tau)
    print(f"tau {tau:.4g} alpha {alpha}\n" + "\n".join(lines))
