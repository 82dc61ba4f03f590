"""bench/rank_view.py in CI (issue 25): rank R of an 8-rank FSDP2 job played in one process.

One subprocess (the fake process group must not meet the test pool's) runs three quick rank
views on CPU: the tiny policy at N = 8, and two inventory-shaped models with the same units and
twice the matrices per unit. About 15 s on 2 shared cores.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
sys.path.insert(0, "bench")
import rank_view
quick = dict(world=8, rounds=1, block_steps=1)
out = {"tiny": rank_view.run(rank_view.ViewConfig(model="tiny", **quick))}
for k in (2, 4):  # same 4 units, 2x the matrices per unit
    out[f"blocks{k}"] = rank_view.run(rank_view.ViewConfig(model=f"blocks{k}", blocks=4, width=64,
                                                          variants=("adamw", "dmuon"), **quick))
out["no_ns"] = rank_view.run(rank_view.ViewConfig(model="pi0", scale=32, layers=2, variants=(
    "adamw", "dmuon", "dmuon-no-ns", "dmuon-overlap-forward"), **quick))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def views() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_rank_view_plays_the_busiest_owner_with_peers_switched_off(views):
    tiny = views["tiny"]
    loads = tiny["plan"]["loads"]
    assert tiny["world"] == 8 and len(loads) == 8
    assert tiny["rank"] == tiny["busiest_rank"] and loads[tiny["rank"]] == max(loads)
    assert any("step check" in o for o in tiny["offline"]) and any("plan broadcast" in o for o in tiny["offline"])
    assert "flush_denormal" in tiny["uninitialised_buffers"]
    assert set(tiny["variants"]) == {"adamw", "dmuon", "vanilla"}


def test_rank_view_reports_phases_hooks_ops_and_memory(views):
    v = views["tiny"]["variants"]
    for name, s in v.items():
        for phase in ("forward", "backward", "step", "total"):
            assert s[phase]["median_s"] > 0, (name, phase)
        assert s["resident_bytes"] > 0
        assert s["per_step"]["fsdp_hooks_cpu_s"] > 0 and s["per_step"]["fsdp_aten_ops"] > 0, name
    d = v["dmuon"]
    assert d["per_step"]["dmuon_hooks_cpu_s"] > 0 and d["per_step"]["dmuon_aten_ops"] > 0
    assert v["adamw"]["per_step"]["dmuon_hooks_cpu_s"] == 0  # only dmuon's labels count
    assert d["profiled"]["forward"]["dmuon_hook_calls"]["dmuon::pre_forward"] == views["tiny"]["dmuon_units"]
    assert d["per_step"]["dmuon_aten_ops_per_unit"] == d["per_step"]["dmuon_aten_ops"] / views["tiny"]["dmuon_units"]
    assert views["tiny"]["ratios"]["dmuon_hooks_over_fsdp_hooks_in_adamw"] > 0


def test_dmuon_ops_per_step_do_not_grow_with_matrices_per_unit(views):
    two, four = views["blocks2"], views["blocks4"]
    assert two["dmuon_units"] == four["dmuon_units"] == 4
    assert four["plan"]["owned_by_rank"] > two["plan"]["owned_by_rank"]  # the owner has more, too
    ops = [x["variants"]["dmuon"]["per_step"]["dmuon_aten_ops"] for x in (two, four)]
    owned = [x["plan"]["owned_by_rank"] for x in (two, four)]
    # Per unit, not per matrix, except the gradient presentation (dmuon/comm/owned_grad.py,
    # issue 31): each gradient the owner holds is shown to third-party code as an OwnedGrad, one
    # metadata-only aten::alias per owned matrix per step (placeholders cost nothing per step)
    assert ops[1] - ops[0] == owned[1] - owned[0], (ops, owned)
    # FSDP2's own hooks do grow with the parameters of a group (reference)
    fsdp = [x["variants"]["adamw"]["per_step"]["fsdp_aten_ops"] for x in (two, four)]
    assert fsdp[1] > fsdp[0], fsdp


def test_exposed_newton_schulz_against_the_no_ns_variant(views):
    """issue 46: ``dmuon-no-ns`` runs dmuon without Newton-Schulz (a norm division stands in),
    the JSON gives each dmuon variant's exposed NS against it and the measured rank's FLOPs."""
    v = views["no_ns"]
    exposed = v["ratios"]["exposed_ns_s"]
    assert set(exposed) == {"dmuon", "dmuon-overlap-forward"}
    base, off = (v["variants"][k]["total"]["median_s"] for k in ("dmuon-no-ns", "dmuon"))
    assert exposed["dmuon"] == pytest.approx(off - base)
    flops = v["flops"]
    assert flops["ns_flops"] > 0 and flops["fwd_bwd_matmul_flops"] > 0 and flops["matrices_owned"] > 0
