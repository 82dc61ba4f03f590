"""torch's state-dict API and DCP on the ``distributed_config`` path (issue 31, item 5).

``dmuon.Muon(params, distributed_config=create_dtensor_config())`` keeps its optimizer state as
DTensors laid out like their parameters, so ``get_state_dict`` / ``set_state_dict`` +
``dcp.save`` / ``dcp.load`` resume exactly and a full optimizer state dict holds the full
momentum. References: single-process ``torch.optim.Muon`` + ``AdamW``
(tests/distconfig_dcp_cases.py:reference), trained straight through; tolerance 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import distconfig_dcp_cases as cases

CASES = "tests.distconfig_dcp_cases"
TOL = 1e-5


def _assert_close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, sorted(got), sorted(want))
    for name, value in want.items():
        torch.testing.assert_close(torch.from_numpy(np.asarray(got[name])), value, rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("layout,world,flatten,named", [
    ("fsdp", 4, False, True), ("fsdp", 2, False, True), ("hsdp", 4, False, True),
    ("fsdp_tp", 4, False, True), ("tp", 4, False, False), ("fsdp", 4, True, True),
])
def test_dcp_resume_matches_reference(dist_pool, tmp_path, layout, world, flatten, named):
    """3 steps, dcp.save(get_state_dict(model, opt)), a fresh model and optimizer (other
    weights) loaded with dcp.load + set_state_dict, 2 more steps: every parameter equals
    torch.optim.Muon + AdamW trained 5 steps straight, and the full optimizer state dict's
    momentum_buffer (exp_avg) equals the reference's. ``flatten``: torchtitan's
    flatten_optimizer_state_dict=True; ``named``: param groups of (fqn, parameter) pairs, which
    then carry param_names (else of parameters)."""
    out = dist_pool.run(world, f"{CASES}:dcp_resume",
                        {"layout": layout, "path": str(tmp_path / "ckpt"), "flatten": flatten, "named": named},
                        timeout_s=180)
    dp = {"fsdp": world, "hsdp": world, "fsdp_tp": 2, "tp": 1}[layout]
    ref = cases.reference(layout, dp, 5)
    for rank, r in enumerate(out):
        _assert_close(r["params"], ref["params"], f"rank {rank} parameter")
        assert r["layout"] == [], (rank, r["layout"])
        assert r["full_error"] is None, r["full_error"]
        _assert_close(r["momentum_buffer"], ref["momentum_buffer"], f"rank {rank} momentum_buffer")
        _assert_close(r["exp_avg"], ref["exp_avg"], f"rank {rank} exp_avg")
        muon_group, adamw_group = r["groups"]
        assert muon_group["ns_dtype"] == "float32", muon_group  # a string: DCP-safe
        assert r["live_ns_dtype"] is torch.float32  # parsed back by set_state_dict
        if named:
            order = list(ref["params"]).index
            assert muon_group["param_names"] == sorted(ref["momentum_buffer"], key=order)
            assert adamw_group["param_names"] == sorted(ref["exp_avg"], key=order)
        else:
            assert "param_names" not in muon_group and "param_names" not in adamw_group


@pytest.mark.parametrize("saved,loaded", [(("fsdp", 4), ("fsdp", 2)), (("fsdp", 4), ("hsdp", 4)),
                                          (("hsdp", 4), ("fsdp", 2))])
def test_dcp_resume_resharded(dist_pool, tmp_path, saved, loaded):
    """Saved on one layout and world size, resumed on another: DCP reshards the optimizer state
    with the parameters; 3 + 2 steps equal the reference run on the same global batches
    (3 steps of the first data-parallel size, 2 of the second) within 1e-5."""
    path = str(tmp_path / "ckpt")
    dist_pool.run(saved[1], f"{CASES}:dcp_save_after", {"layout": saved[0], "path": path}, timeout_s=120)
    out = dist_pool.run(loaded[1], f"{CASES}:dcp_resume_from", {"layout": loaded[0], "path": path},
                        timeout_s=120)
    ref = cases.reference("fsdp", [saved[1]] * 3 + [loaded[1]] * 2, 5)
    for rank, r in enumerate(out):
        _assert_close(r["params"], ref["params"], f"rank {rank} parameter")
        _assert_close(r["momentum_buffer"], ref["momentum_buffer"], f"rank {rank} momentum_buffer")
        assert r["layout"] == [], (rank, r["layout"])


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "fsdp_tp"])
def test_init_optim_state_changes_nothing(dist_pool, layout):
    """get_optimizer_state_dict on a fresh optimizer does not step it (AdamW's step stays 0);
    with its state cleared, DCP's _init_optim_state (a step with zero gradients and lr 0)
    leaves every parameter bitwise unchanged, no gradient behind, the lrs restored and zero
    state laid out like the parameters."""
    out = dist_pool.run(4, f"{CASES}:init_optim_state", {"layout": layout}, timeout_s=90)
    for r in out:
        assert r["steps_after_get"] == [0.0], r
        assert r["changed"] == [] and r["grads"] == [] and r["nonzero"] == [], r
        assert r["lrs"] == [cases.HYPER["lr"], cases.HYPER["adamw_lr"]], r
        assert r["layout"] == [], r
        assert r["stateful"] == r["params"], r


def test_mislaid_state_raises_by_name(dist_pool):
    """A momentum_buffer of another layout given to opt.load_state_dict: RuntimeError on every
    rank naming the matrix, both shapes and set_optimizer_state_dict, not a silent misstep."""
    out = dist_pool.run(2, f"{CASES}:mislaid_state", timeout_s=60)
    for msg in out:
        assert msg.startswith("dmuon: Muon matrix 1 (shape (5, 4))"), msg
        assert "(3, 4)" in msg and "set_optimizer_state_dict" in msg, msg
