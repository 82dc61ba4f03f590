"""dmuon against the *installed* ``torch.optim.Muon``, where torch versions' Muon differ (issue 38).

torch 2.14 added ``adjust_lr_fn="spectral_unclamped"``; torch 2.15 stopped normalizing a bf16
momentum buffer in place with ``nesterov=False`` (``dmuon/owners/torch_muon.py``). Every test
here runs the installed torch's own optimizer, untouched, as the reference, and asks torch (not
dmuon) which ``adjust_lr_fn`` names it has; CI runs the ``compat`` ones on each supported torch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon
from tests import models
from tests.parity_cases import TORCH_NS, bf16_ulps

STEPS = 4


def torch_accepts(adjust_lr_fn: str | None) -> bool:
    """Whether the installed ``torch.optim.Muon`` takes ``adjust_lr_fn`` (asked of torch)."""
    try:
        torch.optim.Muon([torch.zeros(2, 2)], adjust_lr_fn=adjust_lr_fn)
    except ValueError:
        return False
    return True


TORCH_FNS = [fn for fn in (None, "original", "match_rms_adamw", "spectral_unclamped") if torch_accepts(fn)]
#: The newest rule the installed torch has: the multi-rank cases run it.
NEWEST_FN = TORCH_FNS[-1]


def _matrices(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(r, c, generator=g).to(dtype) for r, c in ((9, 5), (5, 9), (6, 6), (1, 8))]


@pytest.mark.compat
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", TORCH_FNS)
def test_single_device_equals_installed_torch_muon(adjust_lr_fn, nesterov, dtype):
    """dmuon.Muon(params) with torch's iteration (standard, bf16, Jordan's coefficients) and
    torch.optim.Muon, 4 steps on the same gradients: parameters and momentum buffers bitwise
    equal (the same ops in the same order: the momentum lerp, the bf16 iteration, and, on torch
    <= 2.14 with a bf16 buffer and nesterov=False, the buffer left divided by its norm)."""
    mats = [nn.Parameter(t.clone()) for t in _matrices(dtype)]
    ref = [nn.Parameter(t.clone()) for t in _matrices(dtype)]
    kwargs = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    opt = dmuon.Muon(mats, **kwargs, **TORCH_NS)
    muon = torch.optim.Muon(ref, ns_coefficients=models.MUON_COEFFICIENTS, **kwargs)
    g = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        for p, r in zip(mats, ref):
            r.grad = torch.randn(p.shape, generator=g).to(dtype) * 3
            p.grad = r.grad.clone()
        opt.step()
        muon.step()
    for i, (p, r) in enumerate(zip(mats, ref)):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0, msg=f"param {i}")
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], muon.state[r]["momentum_buffer"],
                                   rtol=0, atol=0, msg=f"momentum of {i}")
    moved = max(float((p.detach().float() - t.float()).abs().max()) for p, t in zip(mats, _matrices(dtype)))
    assert moved > 0.01  # the optimizers did step


@pytest.mark.compat
def test_spectral_unclamped_follows_installed_torch():
    """Accepted exactly where the installed torch.optim.Muon takes it (both dmuon paths and a
    param group); elsewhere refused at construction, naming the torch release that has it."""
    w = [nn.Parameter(torch.zeros(3, 2))]
    paths = [lambda: dmuon.Muon(w, adjust_lr_fn="spectral_unclamped"),
             lambda: dmuon.Muon([{"params": w, "adjust_lr_fn": "spectral_unclamped"}])]
    for build in paths:
        if torch_accepts("spectral_unclamped"):
            assert build().param_groups[0]["adjust_lr_fn"] == "spectral_unclamped"
        else:
            with pytest.raises(ValueError, match=r"adjust_lr_fn='spectral_unclamped' needs torch>=2\.14"):
                build()
    with pytest.raises(ValueError, match="adjust_lr_fn must be one of"):
        dmuon.Muon(w, adjust_lr_fn="spectral")


@pytest.mark.compat
@pytest.mark.slow
def test_fsdp2_owner_path_equals_installed_torch_muon(dist_pool):
    """4 gloo ranks, FSDP2, dedicate_params: the newest adjust_lr_fn the installed torch has
    (spectral_unclamped from 2.14) without Nesterov, fp32 exact mode, against torch.optim.Muon
    with the same options on the global batch, within 1e-5."""
    opt_kwargs = dict(adjust_lr_fn=NEWEST_FN, nesterov=False)
    out = dist_pool.run(4, "tests.dist_cases:train", dict(mode="fsdp", steps=STEPS, opt_kwargs=opt_kwargs),
                        timeout_s=180)
    ref, _, _ = models.run_reference(4, STEPS, muon_kwargs=opt_kwargs)
    other, _, _ = models.run_reference(4, STEPS, muon_kwargs=dict(nesterov=False))
    assert set(out[0]["params"]) == set(ref)
    worst = max(float((torch.from_numpy(out[0]["params"][n]) - ref[n]).abs().max()) for n in ref)
    assert worst <= 1e-5, worst
    if NEWEST_FN == "spectral_unclamped":  # the test model's wide matrices move less than "original"
        assert max(float((other[n] - ref[n]).abs().max()) for n in ref) > 1e-3


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "plain_fsdp"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_bf16_distributed_config_equals_installed_torch_muon(dist_pool, strategy, nesterov):
    """4 gloo ranks, bf16 matrices (FSDP2 DTensors, or uneven plain row chunks) through the
    distributed_config path vs the installed torch.optim.Muon on the full bf16 matrices, 4 steps.

    Not bitwise: CPU kernels round bf16 ``param.mul_(c)`` / ``add_(u, alpha=a)`` differently in
    their vector body and scalar tail, so a row chunk and the full matrix can differ by one bf16
    ulp per step (seen: <= 1 ulp after 4 steps; 0.5 ulp after one). Bound: one ulp per step.
    Momentum buffers: within 2^-5 of the buffer's largest value (those ulps through
    ``sin(3 p)``). Where torch <= 2.14 leaves a bf16 buffer divided by its norm
    (nesterov=False), leaving that out of dmuon's step fails both bounds (measured on torch
    2.13: parameters 1384 ulps apart)."""
    out = dist_pool.run(4, "tests.parity_cases:bf16_distconfig",
                        dict(strategy=strategy, nesterov=nesterov, adjust_lr_fn=NEWEST_FN), timeout_s=120)
    assert max(o["max_ulps"] for o in out) <= 4, out
    assert max(o["max_buf_rel"] for o in out) <= 2.0 ** -5, out


@pytest.mark.compat
@pytest.mark.parametrize("nesterov", [True, False])
def test_owner_update_of_a_bf16_stack_equals_torch_muon_per_matrix(nesterov):
    """The owner update (``muon_update_``) on a bf16 expert stack ``[2, 5, 9]`` with
    a stack layout: each matrix as torch.optim.Muon steps it as a parameter of its own
    (lr rule of the newest adjust_lr_fn, and on torch <= 2.14 with nesterov=False each
    matrix's buffer left divided by its own norm), 3 steps. Within one bf16 ulp per step, not
    bitwise: the stack's ``mul_``/``add_`` run over 90 elements, torch's over 45, and CPU
    kernels round bf16 differently in their vector body and scalar tail (seen: 1 element of 90,
    1 ulp, on torch 2.14 and 2.15). Buffers within 2^-5 of their largest value; without the
    per-matrix normalization on torch <= 2.14 they differ by the norm's factor."""
    from dmuon.owners.update import MatrixLayout, MuonHyper, muon_update_

    g = torch.Generator().manual_seed(9)
    stack = torch.randn(2, 5, 9, generator=g).to(torch.bfloat16)
    ref = [nn.Parameter(m.clone()) for m in stack.unbind(0)]
    buf = torch.zeros_like(stack)
    muon = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=NEWEST_FN,
                            ns_coefficients=models.MUON_COEFFICIENTS)
    hp = MuonHyper(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, adjust_lr_fn=NEWEST_FN,
                   ns=tuple(sorted(dict(steps=5, coefficients="muon", method="standard", dtype=torch.bfloat16,
                                        eps=1e-7, backend="torch").items())))
    layout = MatrixLayout(full_shape=(2, 5, 9), matrix_shape=(5, 9))
    for _ in range(3):
        grad = (torch.randn(2, 5, 9, generator=g) * 3).to(torch.bfloat16)
        for r, gm in zip(ref, grad.unbind(0)):
            r.grad = gm.clone()
        muon_update_([stack], [grad], [buf], hp, [layout])
        muon.step()
    want_buf = torch.stack([muon.state[r]["momentum_buffer"] for r in ref]).float()
    assert bf16_ulps(stack, torch.stack([r.detach() for r in ref])) <= 3
    assert float((buf.float() - want_buf).abs().max() / want_buf.abs().max()) <= 2.0 ** -5
