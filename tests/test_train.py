"""Tests of the main job: PushT expert and data, the Pi0-style policy, VanillaMuon, the CLI."""

from __future__ import annotations

import copy
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

from dmuon.baselines import VanillaMuon  # noqa: E402
from dmuon.train import data as data_mod  # noqa: E402
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
    demos = data_mod.PushTDemos(TINY_DATA)
    n = len(demos)
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


def test_global_batch_is_independent_of_world_size(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_CACHE", str(tmp_path))
    data_mod.ensure_cached(TINY_DATA, progress=False)
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


def test_vanilla_matches_torch_muon_and_adamw_on_one_process():
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
    assert opt.ns_calls == 3 * len(mats)


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


def test_cli_meshes_train_the_same_as_fsdp(tmp_path):
    """--mesh fsdp-tp:2x2 (TP MLPs + FSDP2) and --mesh replicate (dmuon's DDP-style path) follow
    the 1-D FSDP run of the same global batch. (The baselines under torch DDP are covered by
    tests/test_bench.py::test_bench_step_replicate_mode, without another 4-rank launch.)"""
    env = {**os.environ, "DMUON_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    losses = {}
    for mesh, optimizer in (("fsdp", "dmuon"), ("fsdp-tp:2x2", "dmuon"), ("replicate", "dmuon")):
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
    for key in (("fsdp-tp:2x2", "dmuon"), ("replicate", "dmuon")):
        np.testing.assert_allclose(losses[key], reference, rtol=1e-4, err_msg=str(key))
    assert reference[0] != reference[-1]
