"""GPU tests (``pytest -m gpu``): the Triton kernels on CUDA and dmuon over NCCL at world size 1.

Every test here carries the ``gpu`` marker and is skipped without CUDA, so CI (CPU) collects
and skips them; ``bench/gpu_suite.py`` runs them first on a GPU. References are independent of
the code under test: float64 products and a float64 Newton-Schulz iteration
(``bench/gpu_sections.py``), and single-process ``torch.optim.Muon`` + ``AdamW`` on the CPU.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="the GPU tests time and check compiled kernels, not the interpreter")]

# Awkward shapes and one shape of each launch-table bucket from the inventories (the suite's
# correctness section checks every inventory shape).
_SHAPES = [(1, 4096), (4096, 1), (257, 1000), (1000, 257), (1153, 4303), (4, 300, 700), (3, 517, 517),
           (256, 2048), (2048, 16384), (3584, 18944)]


@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_syrk_and_gram_ns_on_cuda_match_float64(shape):
    import gpu_sections

    res = gpu_sections.check_shape(list(shape), torch.device("cuda"), ("muon", "polar_express"), seed=1)
    failed = {k: res["errors"] for k, ok in res["checks"].items() if not ok}
    assert not failed, failed


def test_every_candidate_launch_config_is_correct():
    """A config that launches must compute the right product (tiles, masks and the mirror
    store on real hardware); one that cannot launch is skipped by the tuner, not wrong."""
    import tune_kernels

    from dmuon.kernels.launch_configs import LaunchConfig
    from dmuon.kernels.triton_syrk import triton_sym_mm

    torch.manual_seed(0)
    X = torch.randn(3, 300, 700, device="cuda", dtype=torch.float16) / 700**0.5
    ref = X.double() @ X.double().mT
    bad = []
    for cand in tune_kernels.CANDIDATES:
        cfg = LaunchConfig(**cand)
        try:
            S = triton_sym_mm(X, X.mT, config=cfg)
            P = triton_sym_mm(S, S, S, alpha=0.5, beta=-1.0, config=cfg)
        except Exception as exc:  # out of resources for this config: the tuner records it
            print(f"{cand}: not launchable ({type(exc).__name__})")
            continue
        torch.cuda.synchronize()
        err = ((S.double() - ref).norm() / ref.norm()).item()
        p_ref = 0.5 * ref @ ref - ref
        p_err = ((P.double() - p_ref).norm() / p_ref.norm()).item()
        if not (torch.equal(S, S.mT) and err < 2e-3 and p_err < 2e-3):
            bad.append((cand, err, p_err))
    assert not bad, bad


def test_dmuon_world_size_1_over_nccl_matches_torch_muon():
    """FSDP2 + dmuon on one GPU over NCCL (the ``_coalescing_manager`` group-call path) vs
    single-process torch.optim.Muon + AdamW on the CPU, fp32 Newton-Schulz, 4 steps."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from tests import models

    steps = 4
    ref_params, ref_losses, _ = models.run_reference(1, steps)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        model = models.make_model().cuda()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        dmuon.dedicate_params(model, mesh, group_cost=0.0)
        opt = dmuon.Muon(model, lr=0.02, adamw_lr=0.01, weight_decay=0.1, ns_method="standard",
                         ns_dtype=torch.float32, ns_coefficients="muon")
        losses = []
        for step in range(steps):
            idx, y = models.local_batch(step, 0, 1)
            loss = models.loss_fn(model, idx.cuda(), y.cuda())
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        got = {rec.fqn: rec.master.detach().cpu() for rec in model._dmuon_state.records}
        for name, p in model.named_parameters():
            if name not in got:
                got[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
    finally:
        dist.destroy_process_group()
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert set(got) == set(ref_params)
    for name, ref in ref_params.items():
        err = ((got[name].double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < 1e-4, (name, err)
