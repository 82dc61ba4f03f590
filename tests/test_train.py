"""Tests of the main job: PushT expert and data, the Pi0-style policy, VanillaMuon, the CLI."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("gym_pusht", reason="the PushT simulator (pip install gym-pusht) is needed")

from dmuon.train.baselines import VanillaMuon  # noqa: E402
from dmuon.train import data as data_mod  # noqa: E402
from dmuon.train import frames as frames_mod  # noqa: E402
from dmuon.train.expert import evaluate_expert  # noqa: E402
from dmuon.train.model import Pi0Policy  # noqa: E402

from tests.train_cases import TINY_DATA, TINY_MODEL, synthetic_batch  # noqa: E402


def test_expert_beats_random_in_the_simulator():
    expert = evaluate_expert("expert", episodes=4, max_steps=120, seed=100)
    rand = evaluate_expert("random", episodes=4, max_steps=120, seed=100)
    # Random targets almost never leave the T on the goal; the expert pushes it most of the way.
    assert expert["final_coverage"] > rand["final_coverage"] + 0.1, (expert, rand)


def test_dataset_is_cached_and_chunks_follow_the_episode(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_CACHE", str(tmp_path))
    path = data_mod.ensure_cached(TINY_DATA, progress=False)
    assert path.parent == tmp_path and path.exists()

    def _no_regeneration(*args, **kwargs):
        raise AssertionError("the cached dataset was regenerated")

    monkeypatch.setattr(data_mod, "generate", _no_regeneration)
    assert data_mod.ensure_cached(TINY_DATA, progress=False) == path
    n = len(data_mod.PushTDemos(TINY_DATA))
    frames_mod.ensure_frames(path, np.arange(n), seed=TINY_DATA.seed, max_steps=TINY_DATA.max_steps,
                             image_size=TINY_DATA.image_size, progress=False)
    demos = data_mod.PushTDemos(TINY_DATA)
    assert demos.images.shape == (n, 3, 16, 16) and demos.images.dtype == np.uint8
    assert demos.actions.shape == (n, 4, 2) and demos.state.shape == (n, 2)
    assert float(demos.actions.abs().max()) <= 1.0
    # A chunk is the next H actions: row i shifted by one equals row i+1 (same episode),
    # and past the episode's end the last action repeats.
    with np.load(path) as f:
        episode = f["episode"]
    for i in range(n - 1):
        if episode[i] == episode[i + 1]:
            torch.testing.assert_close(demos.actions[i, 1:], demos.actions[i + 1, :-1], rtol=0, atol=0)
    last = int(np.flatnonzero(episode == episode[0])[-1])
    assert torch.equal(demos.actions[last], demos.actions[last, :1].expand(4, 2))
    # Another generation parameter is another file.
    other = data_mod.DataConfig(episodes=2, max_steps=12, image_size=16, horizon=4, seed=4)
    assert data_mod.cache_path(other) != path


def _gym_pixels(cfg) -> np.ndarray:
    """The reference frames: gym-pusht's own ``pixels`` observations of ``cfg``'s demonstrations
    (same reset seeds, same expert), row by row as the demonstrations file orders them."""
    from dmuon.train.expert import ScriptedPushExpert, make_env

    env = make_env(cfg.image_size, cfg.max_steps, obs_type="pixels_agent_pos")
    expert, frames = ScriptedPushExpert(), []
    for ep in range(cfg.episodes):
        obs, _ = env.reset(seed=cfg.seed + ep)
        expert.reset()
        episode = []
        for _ in range(cfg.max_steps):
            action = expert(env.unwrapped)
            episode.append(obs["pixels"].transpose(2, 0, 1))
            obs, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                break
        if info["is_success"] or cfg.keep_failed:
            frames.extend(episode)
    env.close()
    return np.stack(frames)


def test_frames_cache_holds_the_drawn_rows_rendered_as_gym_pusht_does(tmp_path, monkeypatch):
    """Issue 33: a run caches the frames of the rows it draws, and nothing else (a 3-step run
    wrote 590 MiB before); each is gym-pusht's own pixel observation of that sample; a longer
    run renders only the rows it adds; DMUON_CACHE_DIR and DataConfig.cache_dir move the files."""
    monkeypatch.delenv("DMUON_CACHE", raising=False)
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path / "env"))
    line = data_mod.ensure_run_data(TINY_DATA, steps=2, global_batch=4, seed=1, progress=False)
    path = data_mod.cache_path(TINY_DATA)
    assert path.parent == tmp_path / "env" and str(path.parent) in line and "MiB" in line
    demos = data_mod.PushTDemos(TINY_DATA)
    drawn = np.unique(np.concatenate([demos.batch(s, 4, 0, 1, seed=1)["images"].numpy().reshape(4, -1)
                                      for s in range(2)], axis=0), axis=0)
    assert len(demos.image_rows) == len(data_mod.drawn_rows(len(demos), 2, 4, seed=1)) < len(demos)
    assert len(demos.image_rows) == len(drawn)  # each cached frame is one some batch used
    reference = _gym_pixels(TINY_DATA)
    assert reference.shape[0] == len(demos)
    np.testing.assert_array_equal(demos.images, reference[demos.image_rows])
    first = set(demos.image_rows.tolist())
    # A longer run: its new rows only are rendered; the earlier ones are kept
    line = data_mod.ensure_run_data(TINY_DATA, steps=5, global_batch=4, seed=1, progress=False)
    demos = data_mod.PushTDemos(TINY_DATA)
    assert first < set(demos.image_rows.tolist())
    assert f"{len(demos.image_rows) - len(first)} rendered now" in line
    np.testing.assert_array_equal(demos.images, reference[demos.image_rows])
    with pytest.raises(RuntimeError, match="no rendered 16 px frame"):
        demos.batch(0, 4, 0, 1, seed=99)
    # DataConfig.cache_dir (--cache-dir) wins over the variable; the state policy's run shares
    # the demonstrations file and renders nothing
    moved = dataclasses.replace(TINY_DATA, cache_dir=str(tmp_path / "flag"))
    data_mod.ensure_run_data(moved, steps=1, global_batch=4, seed=1, progress=False)
    assert data_mod.cache_path(moved) == tmp_path / "flag" / path.name
    state = dataclasses.replace(TINY_DATA, obs="state")
    assert data_mod.cache_path(state) == path
    assert " frames at " not in data_mod.ensure_run_data(state, steps=1, global_batch=4, seed=1, progress=False)


def test_global_batch_is_independent_of_world_size(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_CACHE", str(tmp_path))
    data_mod.ensure_run_data(TINY_DATA, steps=6, global_batch=8, seed=1, progress=False)
    demos = data_mod.PushTDemos(TINY_DATA)
    whole = demos.batch(5, 8, 0, 1, seed=1)
    parts = [demos.batch(5, 8, r, 4, seed=1) for r in range(4)]
    for key, value in whole.items():
        assert torch.equal(value, torch.cat([p[key] for p in parts])), key
    assert float(whole["time"].min()) > 0.0 and float(whole["time"].max()) <= 1.0
    with pytest.raises(ValueError, match="not divisible"):
        demos.batch(0, 6, 0, 4, seed=1)


def test_policy_shapes_flow_matching_loss_and_adamw_fit():
    torch.manual_seed(0)
    model = Pi0Policy(TINY_MODEL)
    b = synthetic_batch(6, TINY_MODEL, seed=1)
    t = b["time"][:, None, None]
    x_t = t * b["noise"] + (1 - t) * b["actions"]
    vel = model.velocity(b["images"], b["state"], b["tokens"], x_t, b["time"])
    assert vel.shape == (6, TINY_MODEL.horizon, 2)
    # Pi0's convention: the target velocity is noise - actions.
    expected = ((vel - (b["noise"] - b["actions"])) ** 2).mean()
    torch.testing.assert_close(model(b), expected)
    shapes = {tuple(p.shape) for p in model.parameters() if p.ndim == 2}
    assert (1, TINY_MODEL.d_vis) in shapes  # the [1, N] pooling score
    assert len(shapes) >= 15

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = model(b).item()
    for _ in range(25):
        opt.zero_grad()
        model(b).backward()
        opt.step()
    assert model(b).item() < 0.5 * first


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    mats = [p for p in model.parameters() if p.ndim == 2 and id(p) not in emb]
    return mats, [p for p in model.parameters() if not (p.ndim == 2 and id(p) not in emb)]


def test_vanilla_matches_torch_muon_and_adamw_on_one_process(monkeypatch):
    import dmuon.train.baselines

    calls = []
    ns = dmuon.train.baselines.newton_schulz

    def counted(*args, **kwargs):  # every rank orthogonalizes every matrix: count them
        calls.append(1)
        return ns(*args, **kwargs)

    monkeypatch.setattr(dmuon.train.baselines, "newton_schulz", counted)
    torch.manual_seed(0)
    model = Pi0Policy(TINY_MODEL)
    ref = copy.deepcopy(model)
    mats, others = _split(ref)
    ref_opts = [
        torch.optim.Muon(mats, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True),
        torch.optim.AdamW(others, lr=3e-3, weight_decay=0.1),
    ]
    # torch.optim.Muon's own iteration: standard, bf16, Keller Jordan's coefficients.
    opt = VanillaMuon(model, lr=0.02, weight_decay=0.1, ns_coefficients="muon",
                      ns_method="standard", ns_dtype=torch.bfloat16, adamw_lr=3e-3)
    for step in range(3):
        b = synthetic_batch(4, TINY_MODEL, seed=10 + step)
        for m, opts in ((model, [opt]), (ref, ref_opts)):
            m(b).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    # Same ops in the same order on the same inputs: the bf16 NS outputs agree bit for bit, so the
    # only allowed difference is none at all (atol 0). A reordering would show up as ~1e-3 (bf16).
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert len(calls) == 3 * len(mats)


def test_cli_end_to_end_two_ranks(tmp_path):
    out = tmp_path / "summary.json"
    env = {**os.environ, "DMUON_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "dmuon.train", "--nproc", "2", "--steps", "3", "--optimizer", "adamw",
         "--episodes", "1", "--batch-size", "8", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
        cwd=pathlib.Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["world_size"] == 2 and summary["optimizer"] == "adamw"
    assert len(summary["losses"]) == 3 and all(np.isfinite(summary["losses"]))
    assert summary["step_s"] > 0 and 0 < summary["optimizer_step_s"] <= max(summary["step_s_all"])
    p = summary["params"]
    assert p["total"] == p["matrix"] + p["other"] and p["matrix"] > 0 and p["other"] > 0
    assert (tmp_path / "summary_loss.png").exists()
    assert "step    3/3" in proc.stdout


def test_cli_without_the_simulator_shows_its_own_error_first(tmp_path):
    """Issue 33: without gym-pusht (blocked here by a package that fails to import), rank 0's
    missing-package message is what the user reads first, not a peer's gloo "Connection closed
    by peer" (2 of 3 runs on the old launcher); the peers' errors follow as consequences."""
    block = tmp_path / "block" / "gym_pusht"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'gym_pusht'\", name='gym_pusht')\n")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "DMUON_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(block.parent), str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "dmuon.train", "--nproc", "4", "--steps", "3"],
                          env=env, capture_output=True, text=True, timeout=240, cwd=root)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert err.startswith("python -m dmuon.train: rank 0 of 4 failed first:"), err[:3000]
    missing = err.index("RuntimeError: dmuon.train: the PushT simulator is missing; install it with "
                        "`pip install 'gym-pusht>=0.1.5'`")
    assert "Connection closed" not in err[:missing] and "failed first" not in err[missing:]
    assert "ModuleNotFoundError: No module named 'gym_pusht'" in err[:missing]  # whole: its cause too


def test_cli_meshes_train_the_same_as_fsdp(tmp_path):
    """--mesh hsdp:2x2 (HSDP), --mesh fsdp-tp:2x2 (TP MLPs + FSDP2) and --mesh replicate (dmuon's
    DDP-style path) follow the 1-D FSDP run of the same global batch. (The baselines under torch DDP are covered by
    tests/test_bench.py::test_bench_step_replicate_mode, without another 4-rank launch.)"""
    env = {**os.environ, "DMUON_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    losses = {}
    meshes = ("fsdp", "hsdp:2x2", "fsdp-tp:2x2", "replicate")
    for mesh, optimizer in ((mesh, "dmuon") for mesh in meshes):
        out = tmp_path / f"{mesh.replace(':', '_')}_{optimizer}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "dmuon.train", "--nproc", "4", "--mesh", mesh, "--steps", "3",
             "--optimizer", optimizer, "--ns-dtype", "float32", "--episodes", "1", "--batch-size", "8",
             "--no-plot", "--out", str(out)],
            env=env, capture_output=True, text=True, timeout=240,
            cwd=pathlib.Path(__file__).resolve().parents[1],
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads(out.read_text())
        assert summary["mesh"] == mesh and summary["world_size"] == 4
        losses[(mesh, optimizer)] = summary["losses"]
    reference = losses[("fsdp", "dmuon")]
    for key in ((mesh, "dmuon") for mesh in meshes[1:]):
        np.testing.assert_allclose(losses[key], reference, rtol=1e-4, err_msg=str(key))
    assert reference[0] != reference[-1]


def test_sinusoidal_time_matches_openpi_posemb_sincos():
    """openpi's ``posemb_sincos(pos, dim, min_period=4e-3, max_period=4.0)``, written out in numpy."""
    from dmuon.train.model import sinusoidal_time

    t = np.array([0.001, 0.25, 0.5, 1.0])
    dim = 64
    fraction = np.linspace(0.0, 1.0, dim // 2)
    period = 4e-3 * (4.0 / 4e-3) ** fraction
    angle = t[:, None] / period[None, :] * 2 * np.pi
    ref = np.concatenate([np.sin(angle), np.cos(angle)], axis=1)
    got = sinusoidal_time(torch.tensor(t, dtype=torch.float64), dim).numpy()
    np.testing.assert_allclose(got, ref, atol=1e-9)
    odd = sinusoidal_time(torch.tensor(t, dtype=torch.float64), dim + 1).numpy()
    assert odd.shape == (4, dim + 1) and np.all(odd[:, -1] == 0)


def test_state_features_read_the_pose_off_the_keypoints():
    """Block pose, agent in block frame and goal error from keypoints == from the simulator's body."""
    from dmuon.train.expert import COG_LOCAL, make_env

    env = make_env(16, 10, obs_type="environment_state_agent_pos")
    obs, _ = env.reset(seed=11)
    u = env.unwrapped
    f = data_mod.state_features(obs["environment_state"], obs["agent_pos"]).astype(np.float64)
    cog = np.array(u.block.local_to_world(COG_LOCAL))
    np.testing.assert_allclose((f[18:20] + 1) * 256, cog, atol=1e-3)
    np.testing.assert_allclose(f[20:22], [np.cos(u.block.angle), np.sin(u.block.angle)], atol=1e-6)
    agent_local = np.array(u.block.world_to_local(tuple(obs["agent_pos"]))) - np.array(COG_LOCAL)
    np.testing.assert_allclose(f[22:24] * 100, agent_local, atol=1e-3)
    goal_cog = np.array(u.get_goal_pose_body(u.goal_pose).local_to_world(COG_LOCAL))
    goal_local = np.array(u.block.world_to_local(tuple(goal_cog))) - np.array(COG_LOCAL)
    np.testing.assert_allclose(f[24:26] * 100, goal_local, atol=1e-3)
    dth = u.goal_pose[2] - u.block.angle
    np.testing.assert_allclose(f[26:28], [np.sin(dth), np.cos(dth)], atol=1e-6)
    env.close()


def test_state_batches_stack_history_and_delta_actions(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_CACHE", str(tmp_path))
    from tests.train_cases import TINY_STATE_DATA

    data_mod.ensure_cached(TINY_STATE_DATA, progress=False)
    demos = data_mod.PushTDemos(TINY_STATE_DATA)
    b = demos.batch(0, 16, 0, 1, seed=0)
    assert b["env_state"].shape == (16, 2, 28) and "images" not in b
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(len(demos), (16,), generator=gen)
    with np.load(data_mod.cache_path(TINY_STATE_DATA)) as f:
        step, kps, agent, actions = f["step"], f["keypoints"], f["agent_pos"], f["actions"]
    for row, i in enumerate(idx.tolist()):
        prev = i - 1 if step[i] > 0 else i
        np.testing.assert_allclose(b["env_state"][row, 0], data_mod.state_features(kps[prev], agent[prev]))
        np.testing.assert_allclose(b["env_state"][row, 1], data_mod.state_features(kps[i], agent[i]))
        target_px = (actions[i] + 1) * 256  # absolute normalized -> pixels
        np.testing.assert_allclose(b["actions"][row].numpy() * data_mod.DELTA_PX, target_px - agent[i], atol=1e-3)


def test_lr_factor_warms_up_then_decays_by_cosine():
    from dmuon.train.loop import TrainConfig, lr_factor

    cfg = TrainConfig(steps=110, warmup=10, schedule="cosine")
    assert [lr_factor(cfg, s) for s in (0, 9)] == [0.1, 1.0]
    assert lr_factor(cfg, 60) == pytest.approx(0.5)  # halfway through the 100 decay steps
    assert lr_factor(cfg, 109) == pytest.approx(0.5 * (1 + np.cos(np.pi * 0.99)))
    assert lr_factor(TrainConfig(steps=110, warmup=10), 109) == 1.0


def test_preset_pusht_state_quick_run(tmp_path):
    """A quick run of --preset pusht-state on 2 ranks: state data, training, closed-loop eval."""
    out = tmp_path / "summary.json"
    env = {**os.environ, "DMUON_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "dmuon.train", "--preset", "pusht-state", "--nproc", "2", "--steps", "40",
         "--batch-size", "64", "--warmup", "5", "--episodes", "2", "--eval-episodes", "2",
         "--eval-max-steps", "30", "--no-plot", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
        cwd=pathlib.Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(out.read_text())
    d, m = s["config"]["data"], s["config"]["model"]
    assert (d["obs"], d["history"], d["action_mode"], d["max_steps"]) == ("state", 2, "delta", 300)
    assert (m["obs"], m["history"], s["config"]["schedule"]) == ("state", 2, "cosine")
    assert s["dataset"]["expert_success"] == 1.0  # seeds 0 and 1: both demonstrations kept
    assert np.mean(s["losses"][-5:]) < 0.8 * s["losses"][0], s["losses"]
    ev = s["eval"]
    assert ev["policy"]["summary"]["episodes"] == 2 and ev["expert"]["summary"]["episodes"] == 2
    ref = evaluate_expert("expert", episodes=2, max_steps=30, seed=ev["seeds"][0])
    assert ev["expert"]["summary"]["final_coverage"]["mean"] == pytest.approx(ref["final_coverage"], abs=1e-9)
