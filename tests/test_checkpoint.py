"""DCP checkpoints of dmuon (issue 8, item 1): continue bitwise, reshard to another world size.

Rank functions: ``tests/ckpt_cases.py``. Every step uses one fixed global batch (4 ranks'
worth) split over the data-parallel ranks that run, and a StepLR schedule whose state is
checkpointed too. Meshes: 1-D FSDP2, a plain replicated module, HSDP 2x2 ("replicate",
"shard") in both replicate modes, FSDP x TP 2x2 ("dp", "tp"; fc1 column- and fc2 row-parallel
with uneven slices), built by ``tests/mesh_cases.py``. Restores cross layouts both ways: 2x2
meshes onto 1-D FSDP2, 1-D FSDP2 onto every 2x2 mesh, HSDP "broadcast" <-> "compute" and
FSDP x TP onto HSDP; every HSDP replica must then hold what replica 0 holds. HSDP "auto" runs
with both modes in use (``mesh_cases.mixed_auto_kwargs``): saved and restored on "compute"
and on HSDP 2x1 / 1x2 (2 ranks), and restored from "broadcast"; HSDP 2x1 is restored on 2x2.
"""

from __future__ import annotations


import numpy as np
import pytest

from tests import ckpt_cases, models

FIRST, THEN = 4, 4
MESH_FIRST, MESH_THEN = 2, 2  # a fresh 4-rank mesh world costs ~3 s on 2 cores, steps ~0.1 s
FP32_ATOL = 1e-5
# (layout, replicate_mode): HSDP "compute" (every replica's owner steps) and "broadcast"
# (replica 0 steps and broadcasts; the others hold no momentum), FSDP x TP.
MESHES = [("hsdp", "compute"), ("hsdp", "broadcast"), ("fsdp-tp", "auto")]


@pytest.fixture(scope="module")
def saved_4rank(dist_pool, tmp_path_factory):
    """A 4-rank FSDP2 job: 4 steps, save, 4 more steps (shared by the tests below)."""
    path = str(tmp_path_factory.mktemp("dcp") / "step4")
    out = dist_pool.run(4, "tests.ckpt_cases:train_save_continue",
                        dict(path=path, first=FIRST, then=THEN), timeout_s=120)
    return path, out[0]


def test_uninterrupted_run_matches_single_process_reference(saved_4rank):
    """Guard for the tests below: the run they compare with is itself right."""
    _, out = saved_4rank
    ref, _, _ = models.run_reference(4, FIRST + THEN, lr_gamma=0.9)
    for name, value in ref.items():
        np.testing.assert_allclose(out["final"][name], value.numpy(), rtol=0, atol=FP32_ATOL,
                                   err_msg=name)


def test_checkpoint_has_metadata_and_no_placeholders(saved_4rank):
    import torch.distributed.checkpoint as dcp

    path, out = saved_4rank
    meta = dcp.FileSystemReader(path).read_metadata()
    for name in models.matrix_names(models.make_model()):
        entry = meta.state_dict_metadata[f"model.{name}"]
        assert tuple(entry.size) == out["saved"][name].shape, name  # full matrix, not [0]
        assert f"optim.state.{name}.momentum_buffer" in meta.state_dict_metadata
    assert "optim.state.emb.weight.exp_avg_sq" in meta.state_dict_metadata


def test_restore_same_world_size_continues_bitwise(dist_pool, saved_4rank):
    path, out = saved_4rank
    got = dist_pool.run(4, "tests.ckpt_cases:load_continue",
                        dict(path=path, first=FIRST, then=THEN), timeout_s=120)[0]
    for name in out["final"]:
        np.testing.assert_array_equal(got["loaded"][name], out["saved"][name], err_msg=name)
        np.testing.assert_array_equal(got["final"][name], out["final"][name], err_msg=name)


def test_restore_4rank_checkpoint_on_2_ranks(dist_pool, saved_4rank):
    path, out = saved_4rank
    got = dist_pool.run(2, "tests.ckpt_cases:load_continue",
                        dict(path=path, first=FIRST, then=THEN), timeout_s=120)
    owned = [set(g["owned"]) for g in got]
    assert owned[0] and owned[1] and not owned[0] & owned[1]  # a new plan over 2 owners
    for name in out["final"]:
        np.testing.assert_array_equal(got[0]["loaded"][name], out["saved"][name], err_msg=name)
        np.testing.assert_allclose(got[0]["final"][name], out["final"][name], rtol=0,
                                   atol=FP32_ATOL, err_msg=name)


def test_restore_same_world_size_other_owner_plan(dist_pool, saved_4rank):
    path, out = saved_4rank
    got = dist_pool.run(4, "tests.ckpt_cases:load_continue",
                        dict(path=path, first=FIRST, then=THEN, shift=1), timeout_s=120)
    default = ckpt_cases.rotated_plan(4, 0).owner_by_fqn
    for rank, g in enumerate(got):  # every matrix has moved to another owner
        assert all(default[fqn] != rank for fqn in g["owned"]), (rank, g["owned"])
    got = got[0]
    for name in out["final"]:
        np.testing.assert_array_equal(got["loaded"][name], out["saved"][name], err_msg=name)
        np.testing.assert_allclose(got["final"][name], out["final"][name], rtol=0,
                                   atol=FP32_ATOL, err_msg=name)


def test_replicated_2rank_checkpoint_restored_on_4_ranks(dist_pool, tmp_path):
    """The DDP-style path: plain tensors, deduplicated by DCP on save, read by every rank."""
    path = str(tmp_path / "rep")
    kwargs = dict(path=path, first=2, then=2, mode="replicated")
    ref, _, _ = models.run_reference(4, 4, lr_gamma=0.9)
    dist_pool.run(2, "tests.ckpt_cases:train_save_continue", kwargs, timeout_s=120)
    got = dist_pool.run(4, "tests.ckpt_cases:load_continue", kwargs, timeout_s=120)[0]
    for name, value in ref.items():
        np.testing.assert_allclose(got["final"][name], value.numpy(), rtol=0, atol=FP32_ATOL,
                                   err_msg=name)


def test_load_rejects_state_dict_without_optimizer_entries(dist_pool):
    msgs = dist_pool.run(2, "tests.ckpt_cases:load_incomplete", {}, timeout_s=60)
    for msg in msgs:
        assert msg.startswith("ValueError: dmuon: the checkpoint state dict"), msg
        assert "lacks 'optim' entries" in msg


def test_default_ns_dtype_survives_optimizer_state_dict_round_trip(dist_pool):
    """Every other checkpoint test sets ns_dtype=torch.float32; with the default (None) a
    load_state_dict dropped the key and the next step raised KeyError (found by torchtitan's
    Trainer resuming, bench/torchtitan_trainer.py)."""
    out = dist_pool.run(2, "tests.ckpt_cases:default_ns_dtype_round_trip", {}, timeout_s=120)
    for rank_out in out:
        assert rank_out["error"] == "", rank_out["error"]
        assert rank_out["ns_dtype_after_load"] == ["None"]
    with_trip, without = out[0]["final"]
    assert set(with_trip) == set(without)
    for name, value in without.items():
        np.testing.assert_array_equal(with_trip[name], value, err_msg=name)


# ----------------------------------------------------------------------------- HSDP, FSDP x TP
def _assert_matches_reference(final: dict, steps: int) -> None:
    ref, _, _ = models.run_reference(ckpt_cases.GLOBAL_RANKS, steps, lr_gamma=0.9)
    assert set(final) == set(ref)
    for name, value in ref.items():
        np.testing.assert_allclose(final[name], value.numpy(), rtol=0, atol=FP32_ATOL,
                                   err_msg=name)


@pytest.fixture(scope="module", params=MESHES, ids=["-".join(m) for m in MESHES])
def saved_mesh(dist_pool, tmp_path_factory, request):
    """A 4-rank 2x2-mesh job: 2 steps, save, 2 more (uninterrupted)."""
    layout, replicate_mode = request.param
    path = str(tmp_path_factory.mktemp("dcp") / f"{layout}-{replicate_mode}")
    kwargs = dict(path=path, first=MESH_FIRST, then=MESH_THEN, mode=layout,
                  replicate_mode=replicate_mode)
    out = dist_pool.run(4, "tests.ckpt_cases:train_save_continue", kwargs, timeout_s=120,
                        fresh=True)
    return kwargs, out[0]


def test_mesh_uninterrupted_run_matches_single_process_reference(saved_mesh):
    """Guard for the tests below: the run they compare with is itself right."""
    _, out = saved_mesh
    _assert_matches_reference(out["final"], MESH_FIRST + MESH_THEN)


def test_mesh_checkpoint_stores_full_matrices_in_tp_slices(saved_mesh):
    """Every dedicated matrix and its momentum are stored at their full shape; under FSDP x TP
    the column-parallel fc1 / row-parallel fc2 as two ``torch.chunk`` slices at their offsets."""
    import torch.distributed.checkpoint as dcp

    kwargs, out = saved_mesh
    meta = dcp.FileSystemReader(kwargs["path"]).read_metadata().state_dict_metadata
    for name in models.matrix_names(models.make_model()):
        shape = out["saved"][name].shape
        offsets = [(0, 0)]
        if kwargs["mode"] == "fsdp-tp" and name.endswith(("fc1.weight", "fc2.weight")):
            dim = 0 if name.endswith("fc1.weight") else 1
            second = [0, 0]
            second[dim] = -(-shape[dim] // 2)  # ceil: torch.chunk over 2 TP ranks
            offsets.append(tuple(second))
        for key in (f"model.{name}", f"optim.state.{name}.momentum_buffer"):
            assert tuple(meta[key].size) == shape, key
            got = sorted(tuple(c.offsets) for c in meta[key].chunks)
            assert got == offsets, (key, got)
            assert sum(int(np.prod(c.sizes)) for c in meta[key].chunks) == int(np.prod(shape)), key


def test_mesh_restore_same_mesh_continues_bitwise(dist_pool, saved_mesh):
    kwargs, out = saved_mesh
    got = dist_pool.run(4, "tests.ckpt_cases:load_continue", kwargs, timeout_s=120, fresh=True)[0]
    for name in out["final"]:
        np.testing.assert_array_equal(got["loaded"][name], out["saved"][name], err_msg=name)
        np.testing.assert_array_equal(got["final"][name], out["final"][name], err_msg=name)
    _assert_matches_reference(got["final"], MESH_FIRST + MESH_THEN)


def test_mesh_checkpoint_restored_on_2_rank_fsdp(dist_pool, saved_mesh):
    """Resharding: HSDP / FSDP x TP shards and TP slices read back on a 1-D FSDP2 mesh."""
    kwargs, out = saved_mesh
    got = dist_pool.run(2, "tests.ckpt_cases:load_continue", dict(kwargs, mode="fsdp"),
                        timeout_s=120)[0]  # a 1-D mesh: the pool's world can be reused
    for name in out["final"]:
        np.testing.assert_array_equal(got["loaded"][name], out["saved"][name], err_msg=name)
    _assert_matches_reference(got["final"], MESH_FIRST + MESH_THEN)


def test_async_save_while_training_restores_saved_values(dist_pool, tmp_path):
    """``dcp.async_save`` on 1-D FSDP2 (gloo, thread executor, a FileSystemWriter as its
    stager): its writes wait until two more steps have changed every parameter in place, yet
    the checkpoint holds the values at the call, and a restore continues bitwise. A stager
    that does not copy fails here (checked by hand: max difference 1.7e-2)."""
    kwargs = dict(path=str(tmp_path / "async"), first=2, then=2)
    out = dist_pool.run(2, "tests.ckpt_cases:train_save_continue", dict(kwargs, async_save=True),
                        timeout_s=120)[0]
    got = dist_pool.run(2, "tests.ckpt_cases:load_continue", kwargs, timeout_s=120)[0]
    for name in out["final"]:
        np.testing.assert_array_equal(got["loaded"][name], out["saved"][name], err_msg=name)
        np.testing.assert_array_equal(got["final"][name], out["final"][name], err_msg=name)
    _assert_matches_reference(got["final"], 4)


# ----------------------------------------------------------------------------- across layouts
def _assert_replicas_agree(got: list[dict]) -> None:
    """Every HSDP replica holds what replica 0 holds (``ckpt_cases.replica_state`` per rank),
    right after loading and at the end: owners' masters and ``"compute"``-mode momentum
    (same FQN and TP slice, one copy per replica), and the other parameters. A replica that
    loaded nothing or a stale buffer drifts from replica 0 here, where ``full_params``
    (replica 0's values) sees it at most through one averaged gradient."""
    replicas = len({g["replica_loaded"]["replicate_rank"] for g in got})
    for when in ("replica_loaded", "replica_final"):
        seen: dict[tuple, list[tuple[int, np.ndarray]]] = {}
        for rank, g in enumerate(got):
            view = g[when]
            for kind in ("masters", "momentum"):
                for fqn, value in view[kind].items():
                    seen.setdefault((kind, fqn, view["tp_rank"]), []).append((rank, value))
            for fqn, value in view["dense"].items():
                seen.setdefault(("dense", fqn), []).append((rank, value))
        for key, copies in seen.items():
            if key[0] != "dense":
                assert len(copies) == replicas, (when, key, [r for r, _ in copies])
            for rank, value in copies[1:]:
                np.testing.assert_array_equal(
                    value, copies[0][1], err_msg=f"{when} {key}: rank {rank} vs {copies[0][0]}")


# (layout, replicate_mode) of a 2x2 job restoring the 1-D FSDP2 checkpoint of ``saved_4rank``.
FROM_1D = [("hsdp", "compute"), ("hsdp", "broadcast"), ("fsdp-tp", "auto")]


@pytest.mark.parametrize("target", FROM_1D, ids=["-".join(m) for m in FROM_1D])
def test_1d_fsdp_checkpoint_restored_on_2x2_mesh(dist_pool, saved_4rank, target):
    """Resharding the other way: 1-D FSDP2 shards and whole owner masters read into HSDP
    (every replica's owner, or replica 0's only for the momentum in ``"broadcast"``) and into
    FSDP x TP (masters and momentum read as uneven TP slices)."""
    path, out = saved_4rank
    layout, replicate_mode = target
    got = dist_pool.run(4, "tests.ckpt_cases:load_continue",
                        dict(path=path, first=FIRST, then=THEN, mode=layout,
                             replicate_mode=replicate_mode), timeout_s=120, fresh=True)
    for name in out["final"]:
        np.testing.assert_array_equal(got[0]["loaded"][name], out["saved"][name], err_msg=name)
    _assert_matches_reference(got[0]["final"], FIRST + THEN)
    _assert_replicas_agree(got)


# A 2x2 checkpoint (key of ``saved_mesh``) restored on another 2x2 layout: HSDP across the two
# replicate modes both ways, and FSDP x TP slices gathered into HSDP's whole masters.
# "auto" with mixed_auto=True: blocks.1-2 "broadcast", head and blocks.0 "compute" (MIXED).
OTHER_2X2 = {("hsdp", "compute"): [dict(mode="hsdp", replicate_mode="broadcast")],
             ("hsdp", "broadcast"): [dict(mode="hsdp", replicate_mode="compute"),
                                     dict(mode="hsdp", replicate_mode="auto", mixed_auto=True)],
             ("fsdp-tp", "auto"): [dict(mode="hsdp", replicate_mode="compute")]}
MIXED = {name: "broadcast" if name.startswith(("blocks.1.", "blocks.2.")) else "compute"
         for name in models.matrix_names(models.make_model())}


def _assert_restored(got: list[dict], out: dict, steps: int) -> None:
    """Right after loading, the saved parameters exactly; at the end, the reference; and
    every HSDP replica agrees with replica 0."""
    for name in out["final"]:
        np.testing.assert_array_equal(got[0]["loaded"][name], out["saved"][name], err_msg=name)
    _assert_matches_reference(got[0]["final"], steps)
    _assert_replicas_agree(got)


def test_mesh_checkpoint_restored_on_other_2x2_layout(dist_pool, saved_mesh):
    """``"broadcast"`` -> ``"compute"``: replica 1's owners, which never stepped and saved no
    momentum, must read replica 0's; ``"compute"`` -> ``"broadcast"``: replica 0's owners read
    the momentum every replica saved; ``"broadcast"`` -> mixed ``"auto"``: replica 1's owners
    of the ``"compute"`` matrices read replica 0's momentum, the others keep none."""
    kwargs, out = saved_mesh
    for target in OTHER_2X2[(kwargs["mode"], kwargs["replicate_mode"])]:
        got = dist_pool.run(4, "tests.ckpt_cases:load_continue", dict(kwargs, **target),
                            timeout_s=120, fresh=True)
        if target.get("mixed_auto"):
            assert got[0]["modes"] == MIXED, got[0]["modes"]
        _assert_restored(got, out, MESH_FIRST + MESH_THEN)


# ----------------------------------------------------------------------------- HSDP "auto", 2 <-> 4 ranks
@pytest.fixture(scope="module")
def saved_auto(dist_pool, tmp_path_factory):
    """HSDP 2x2 in ``"auto"`` mode with both modes in use (``mesh_cases.mixed_auto_kwargs``;
    with the shipped cost constants every matrix of the test model picks ``"compute"``):
    2 steps, save, 2 more."""
    path = str(tmp_path_factory.mktemp("dcp") / "hsdp-auto")
    kwargs = dict(path=path, first=MESH_FIRST, then=MESH_THEN, mode="hsdp",
                  replicate_mode="auto", mixed_auto=True)
    out = dist_pool.run(4, "tests.ckpt_cases:train_save_continue", kwargs, timeout_s=120,
                        fresh=True)
    return kwargs, out[0]


def test_auto_run_mixes_modes_and_matches_reference(saved_auto):
    """Guard for the tests below: both modes are in use, and the run is itself right."""
    _, out = saved_auto
    assert out["modes"] == MIXED, out["modes"]
    _assert_matches_reference(out["final"], MESH_FIRST + MESH_THEN)


# Targets of the mixed "auto" 2x2 checkpoint: "compute" on the same mesh (replica 1's owners
# must read the momentum of the "broadcast" matrices, saved by replica 0 only), and HSDP on 2
# ranks: 2 replicas of one rank each (every matrix owned by rank 0 of its replica) or one
# replica of two ranks.
FROM_AUTO = [dict(mode="hsdp", replicate_mode="compute", world_size=4),
             dict(mode="hsdp-2x1", replicate_mode="auto", mixed_auto=True, world_size=2),
             dict(mode="hsdp-1x2", replicate_mode="auto", mixed_auto=True, world_size=2)]


@pytest.mark.parametrize("target", FROM_AUTO, ids=["hsdp-compute", "hsdp-2x1", "hsdp-1x2"])
def test_auto_checkpoint_restored_on_other_hsdp(dist_pool, saved_auto, target):
    kwargs, out = saved_auto
    target = dict(target)
    world_size = target.pop("world_size")
    got = dist_pool.run(world_size, "tests.ckpt_cases:load_continue", dict(kwargs, **target),
                        timeout_s=120, fresh=True)
    if target.get("mixed_auto"):
        assert got[0]["modes"] == MIXED, got[0]["modes"]
    _assert_restored(got, out, MESH_FIRST + MESH_THEN)


def test_2rank_hsdp_checkpoint_restored_on_4_ranks(dist_pool, tmp_path):
    """HSDP 2x1 (mixed ``"auto"``) saved, restored on HSDP 2x2: each 1-rank replica's whole
    masters are read by 2 owners per replica, the FSDP2 shards resharded from 1 to 2."""
    kwargs = dict(path=str(tmp_path / "hsdp-2x1"), first=MESH_FIRST, then=MESH_THEN,
                  mode="hsdp-2x1", replicate_mode="auto", mixed_auto=True)
    out = dist_pool.run(2, "tests.ckpt_cases:train_save_continue", kwargs, timeout_s=120,
                        fresh=True)[0]
    assert out["modes"] == MIXED, out["modes"]
    _assert_matches_reference(out["final"], MESH_FIRST + MESH_THEN)
    got = dist_pool.run(4, "tests.ckpt_cases:load_continue", dict(kwargs, mode="hsdp"),
                        timeout_s=120, fresh=True)
    assert got[0]["modes"] == MIXED, got[0]["modes"]
    _assert_restored(got, out, MESH_FIRST + MESH_THEN)


def test_state_dict_refuses_a_module_with_extra_state_by_name():
    """``dmuon.state_dict`` saves parameters and persistent buffers only: a module with
    ``get_extra_state`` (e.g. an FP8 module's scaling state) is refused by name, not dropped
    silently. Single device (``dmuon.Muon(params)``), no process group."""
    import torch
    from torch import nn

    import dmuon

    class WithExtra(nn.Linear):
        def get_extra_state(self):
            return {"scale": 2.0}

        def set_extra_state(self, state):
            pass

    model = nn.Sequential(nn.Linear(4, 4), WithExtra(4, 4))
    opt = dmuon.Muon(list(model.parameters()))
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert sorted(dmuon.state_dict(plain, dmuon.Muon(list(plain.parameters())))["model"]) == sorted(
        plain.state_dict())
    with pytest.raises(ValueError, match=r"^dmuon: module '1' \(WithExtra\) has extra state"):
        dmuon.state_dict(model, opt)
