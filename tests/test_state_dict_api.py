"""torch's state-dict and DCP APIs on the hooks path see what FSDP2 alone would (issue 31,
items 4 and 6): ``model.state_dict()`` shows each dedicated matrix as a DTensor laid out like
FSDP2's sharded parameter holding the owner's weights (full tensors on the replicated path, as
DDP); ``get_model_state_dict`` / ``get_optimizer_state_dict`` (sharded, full, cpu_offload) and
``set_*`` work; a generic ``dcp.save(get_state_dict(...))`` resumes exactly in a fresh job
(with and without activation checkpointing); a damaged checkpoint changes nothing live.

Every number is compared with single-process ``torch.optim.Muon`` + ``AdamW`` (fp32 iteration)
on the same global batches. Rank functions: ``tests/sd_cases.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import models, sd_cases

ATOL = 1e-5
FIRST, THEN = 2, 2


def _assert_reference(params: dict, steps: int) -> float:
    ref, _ = sd_cases.reference_with_state(steps)
    assert set(params) == set(ref)
    worst = 0.0
    for name, value in ref.items():
        np.testing.assert_allclose(params[name], value.numpy(), rtol=0, atol=ATOL, err_msg=name)
        worst = max(worst, float(np.abs(params[name] - value.numpy()).max()))
    return worst


def _assert_values_match_reference(o: dict, ref: dict, ref_state: dict) -> None:
    """Rank ``o``'s sharded entries (full-tensored), full state dict and full optimizer state
    equal the single-process reference's parameters and Muon/AdamW state within ``ATOL``."""
    for name, value in ref.items():
        np.testing.assert_allclose(o["values"][name], value.numpy(), rtol=0, atol=ATOL, err_msg=name)
        np.testing.assert_allclose(o["full"][name], value.numpy(), rtol=0, atol=ATOL, err_msg=name)
        for key, expected in ref_state[name].items():
            np.testing.assert_allclose(np.asarray(o["full_optim"][name][key]), expected.numpy(), rtol=0,
                                       atol=ATOL, err_msg=f"{name}/{key}")


@pytest.mark.parametrize("mode,world_size", [("fsdp", 4), ("replicated", 2), ("hsdp", 4)])
def test_model_state_dict_is_fsdp2_layout_with_owner_values(dist_pool, mode, world_size):
    out = dist_pool.run(world_size, "tests.sd_cases:model_state_dict_view", dict(mode=mode),
                        timeout_s=180, fresh=mode == "hsdp")
    ref, ref_state = sd_cases.reference_with_state(2)
    names = models.matrix_names(models.make_model())
    for rank, o in enumerate(out):
        for name in names:
            kind, shape, local, placements = o["entries"][name]
            assert shape == tuple(ref[name].shape), (rank, name, shape)  # never (0,)
            if mode == "replicated":  # DDP's view: the full tensor on every rank
                assert kind == "Tensor" and local == shape, (rank, name, kind, local)
            else:  # FSDP2's sharded parameter: Shard(0) rows over the shard ranks
                shard = world_size if mode == "fsdp" else world_size // 2
                rows = -(-shape[0] // shard)
                fsdp2_own = o["entries"]["emb.weight"][3]  # a 2-D parameter FSDP2 manages itself
                assert kind == "DTensor" and placements == fsdp2_own and placements[-1] == "S(0)", \
                    (rank, name, placements)
                assert local[0] <= rows and local[1] == shape[1], (rank, name, local)
            assert o["momentum_kind"][name] == ("Tensor" if mode == "replicated" else "DTensor")
    o = out[0]
    _assert_values_match_reference(o, ref, ref_state)
    for group in o["groups"]:  # plain values only, and the parameters' names
        assert group["param_names"] == group["params"], group
        for key, value in group.items():
            assert isinstance(value, (int, float, str, bool, tuple, list, type(None))), (key, value)
    assert o["groups"][0]["ns_dtype"] == "float32"


@pytest.mark.parametrize("how,ac", [("dcp", False), ("dcp", True), ("full", False), ("module", False)])
def test_torch_state_dict_roundtrip_resumes_exactly(dist_pool, tmp_path, how, ac):
    out = dist_pool.run(4, "tests.sd_cases:dcp_roundtrip",
                        dict(path=str(tmp_path / "ckpt"), ac=ac, first=FIRST, then=THEN, how=how),
                        timeout_s=240)[0]
    for name in out["saved"]:
        np.testing.assert_array_equal(out["loaded"][name], out["saved"][name], err_msg=name)
    worst = _assert_reference(out["final"], FIRST + THEN)
    print(f"{how} ac={ac}: resumed run vs single-process reference, max |diff| {worst:.3g}")


def test_dcp_roundtrip_hsdp(dist_pool, tmp_path):
    out = dist_pool.run(4, "tests.sd_cases:dcp_roundtrip",
                        dict(path=str(tmp_path / "ckpt"), mode="hsdp", first=FIRST, then=THEN),
                        timeout_s=240, fresh=True)[0]
    _assert_reference(out["final"], FIRST + THEN)


def test_optimizer_state_init_changes_no_parameter(dist_pool):
    out = dist_pool.run(2, "tests.sd_cases:init_state_changes_nothing", {}, timeout_s=120)[0]
    for name, value in out["before"].items():
        np.testing.assert_array_equal(out["after"][name], value, err_msg=name)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_damaged_checkpoint_changes_nothing_live(dist_pool, tmp_path, damage):
    out = dist_pool.run(2, "tests.sd_cases:failed_load",
                        dict(path=str(tmp_path / "ckpt"), damage=damage), timeout_s=120)
    for rank, o in enumerate(out):
        assert o["error"].startswith("RuntimeError: dmuon: loading checkpoint"), (rank, o["error"])
        assert o["compared"] > 10 and o["changed"] == [], (rank, o["changed"])


def test_damaged_checkpoint_through_torch_api_leaves_dedicated_state(dist_pool, tmp_path):
    out = dist_pool.run(2, "tests.sd_cases:failed_load",
                        dict(path=str(tmp_path / "ckpt"), damage="missing", api="torch"), timeout_s=120)
    for rank, o in enumerate(out):
        assert o["error"] != "no error", rank
        assert o["compared"] > 5 and o["changed"] == [], (rank, o["changed"])


def test_bad_entry_on_one_rank_fails_every_rank_before_writing(dist_pool):
    out = dist_pool.run(2, "tests.sd_cases:bad_load_state_dict", {}, timeout_s=120)
    for rank, o in enumerate(out):
        assert o["error"].startswith("ValueError: dmuon: the state dict does not fit"), (rank, o["error"])
        assert "rank 1" in o["error"] and "blocks.1.fc1.weight" in o["error"], o["error"]
        assert o["changed"] == [], (rank, o["changed"])


def test_keys_are_canonical_under_checkpoint_wrapper_and_compile(dist_pool):
    """``_checkpoint_wrapped_module.`` and ``_orig_mod.`` never reach a checkpoint key: dmuon's
    and torch's state dicts name every parameter as the plain model does."""
    out = dist_pool.run(2, "tests.sd_cases:canonical_keys", {}, timeout_s=180)
    names = sorted(n for n, _ in models.make_model().named_parameters())
    for rank, keys in enumerate(out):
        assert any("_checkpoint_wrapped_module" in f for f in keys["fqns"]), keys["fqns"]  # the case
        assert any("_orig_mod" in f for f in keys["fqns"]), keys["fqns"]
        assert keys["torch_model"] == names, (rank, keys["torch_model"])
        assert set(keys["dmuon_model"]) <= set(names), (rank, keys["dmuon_model"])  # masters: owners only
        assert set(keys["torch_optim"]) == set(names)
        assert set(keys["dmuon_optim"]) <= set(names), (rank, keys["dmuon_optim"])
    assert sorted(set().union(*(k["dmuon_model"] for k in out))) == names


def test_dmuon_checkpoint_with_activation_checkpointing_resumes(dist_pool, tmp_path):
    out = dist_pool.run(4, "tests.sd_cases:dmuon_checkpoint_with_ac",
                        dict(path=str(tmp_path / "ckpt"), first=FIRST, then=THEN), timeout_s=240)[0]
    _assert_reference(out["final"], FIRST + THEN)


def test_torch_checkpoint_reshards_4_ranks_to_2(dist_pool, tmp_path):
    """DCP reshards what torch's API saved: 4 FSDP2 ranks -> 2 (another owner plan)."""
    path = str(tmp_path / "ckpt")
    saved = dist_pool.run(4, "tests.sd_cases:torch_save", dict(path=path, first=FIRST), timeout_s=180)[0]
    got = dist_pool.run(2, "tests.sd_cases:torch_load_continue", dict(path=path, first=FIRST, then=THEN),
                        timeout_s=180)[0]
    for name, value in saved["saved"].items():
        np.testing.assert_array_equal(got["loaded"][name], value, err_msg=name)
    _assert_reference(got["final"], FIRST + THEN)


@pytest.mark.parametrize("how", ["dcp"])
def test_tensor_parallel_roundtrip(dist_pool, tmp_path, how):
    """FSDP x TP 2x2 (fc1 column-, fc2 row-parallel, uneven slices): torch's API shows each
    matrix as FSDP2 x TP lays it out and resumes exactly. (``how="full"`` is not run: torch's
    ``set_model_state_dict(full_state_dict=True)`` fails in ``distribute_tensor`` on FSDP2's own
    uneven ``_StridedShard`` biases of this model, with or without dmuon.)"""
    out = dist_pool.run(4, "tests.sd_cases:dcp_roundtrip",
                        dict(path=str(tmp_path / "ckpt"), mode="fsdp-tp", first=FIRST, then=THEN, how=how),
                        timeout_s=240, fresh=True)[0]
    for name in out["saved"]:
        np.testing.assert_array_equal(out["loaded"][name], out["saved"][name], err_msg=name)
    _assert_reference(out["final"], FIRST + THEN)


def test_tensor_parallel_full_export(dist_pool):
    out = dist_pool.run(4, "tests.sd_cases:model_state_dict_view", dict(mode="fsdp-tp"), timeout_s=240,
                        fresh=True)
    ref, ref_state = sd_cases.reference_with_state(2)
    for name in models.matrix_names(models.make_model()):
        for o in out:
            kind, shape, _, placements = o["entries"][name]
            assert kind == "DTensor" and shape == tuple(ref[name].shape), (name, kind, shape)
            assert len(placements) == (2 if ".fc" in name else 1), (name, placements)  # (dp, tp) for TP
    o = out[0]
    _assert_values_match_reference(o, ref, ref_state)


def test_split_expert_stacks_refused_by_name(dist_pool):
    out = dist_pool.run(2, "tests.sd_cases:split_stack_refused", {}, timeout_s=180)
    for rank, o in enumerate(out):
        assert o["split"], rank  # the case: a stack cut into owner ranges
        for what in ("model", "optim"):
            assert o[what].startswith("RuntimeError: dmuon: model.state_dict()/load_state_dict() cannot "
                                      "show dedicated matrix"), (rank, what, o[what])
            assert "dmuon.state_dict(model, opt)" in o[what]
        assert o["dmuon"] > 0


def test_parent_module_hooks_see_fsdp2_view(dist_pool):
    """A parent module's state-dict hooks that rewrite its child's dedicated entry (torchtitan's
    fused-QKV split/merge, here fc1.weight <-> fc1.a/fc1.b; tests/sd_hook_order_cases.py) see
    FSDP2's view: the split halves are the reference's rows, submodule.state_dict() and
    submodule.load_state_dict() translate, a bad merged entry on one rank raises on every rank
    naming dmuon before that matrix is written, and a full load restores the model bitwise."""
    out = dist_pool.run(2, "tests.sd_hook_order_cases:parent_hooks", {}, timeout_s=180)
    ref, _ = sd_cases.reference_with_state(2)
    for rank, o in enumerate(out):
        assert "blocks.0.fc1.a" in o["keys"] and "blocks.0.fc1.weight" not in o["keys"], (rank, o["keys"])
        assert "fc1.a" in o["sub_keys"] and o["sub_differs"] == [], (rank, o["sub_keys"], o["sub_differs"])
        assert o["sub_loaded_differs"] == [], (rank, o["sub_loaded_differs"])
        assert o["bad_error"].startswith("ValueError: dmuon: the state dict does not fit"), (rank, o["bad_error"])
        assert "blocks.1.fc1.weight" in o["bad_error"] and "rank 1" in o["bad_error"], o["bad_error"]
        assert not o["bad_changed"], rank
        assert o["loaded_differs"] == [], (rank, o["loaded_differs"])
        assert o["losses"][0] == o["losses"][1], (rank, o["losses"])
    values = out[0]["values"]
    for name, value in ref.items():
        if name.endswith("fc1.weight"):
            half = value.shape[0] // 2
            got = np.concatenate([values[name[:-len("weight")] + "a"], values[name[:-len("weight")] + "b"]])
            assert values[name[:-len("weight")] + "a"].shape[0] == half
        else:
            got = values[name]
        np.testing.assert_allclose(got, value.numpy(), rtol=0, atol=ATOL, err_msg=name)
