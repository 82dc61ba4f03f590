"""The profile CLI, the NS profiler cache and the batched-cost fit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dmuon.balance import makespan_lower_bound, profiler, solve
from dmuon.balance.cost import fit_batch_costs, ns_flops
from dmuon.balance.inventories import inventory
from dmuon.owners.plan import OwnerPlan
from dmuon.profile import main, model_inventory


def test_cli_pi0_tiny_writes_valid_plan_and_chart(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["--model", "pi0-tiny", "--nodes", "2", "--gpus-per-node", "4", "--out", str(out),
               "--time-limit-s", "1", "--measure", "no", "--cache", str(tmp_path / "c.json")])
    assert rc == 0
    plan = OwnerPlan.load(out)
    inv = dict(inventory("pi0-tiny"))
    plan.check_matches(inv, 8)  # every matrix assigned, shapes and world size match
    # Loads recomputed from the plan's own matrices agree with its makespan.
    loads = [0.0] * 8
    for m in plan.matrices:
        loads[m.owner] += m.cost
    assert max(loads) == pytest.approx(plan.makespan)
    assert plan.makespan >= plan.lower_bound
    assert (tmp_path / "plan.png").stat().st_size > 1000
    table = capsys.readouterr().out
    assert "makespan" in table and len(table.splitlines()) >= 9 + 1


def test_cli_without_matplotlib_writes_the_plan_and_says_how_to_get_the_chart(tmp_path):
    """Issue 33: the README's ``python -m dmuon.profile`` on a plain install (no matplotlib,
    blocked here by a ``sys.modules`` entry of None in a fresh interpreter) writes the plan,
    says in one line how to get the chart, and exits 0; ``--no-plot`` says nothing of it."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runner = ("import runpy, sys; sys.modules['matplotlib'] = None; "
              "sys.argv = ['dmuon.profile'] + sys.argv[1:]; "
              "runpy.run_module('dmuon.profile', run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    for extra in ([], ["--no-plot"]):
        out = tmp_path / f"plan{len(extra)}.json"
        proc = subprocess.run(
            [sys.executable, "-c", runner, "--model", "pi0-tiny", "--nodes", "1", "--gpus-per-node", "4",
             "--out", str(out), "--time-limit-s", "1", "--measure", "no",
             "--cache", str(tmp_path / "c.json"), *extra],
            capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        OwnerPlan.load(out).check_matches(dict(inventory("pi0-tiny")), 4)
        hint = [line for line in proc.stdout.splitlines() if "chart" in line]
        assert not (tmp_path / f"plan{len(extra)}.png").exists()
        if extra:
            assert hint == [] and "Traceback" not in proc.stderr
        else:
            assert len(hint) == 1 and "matplotlib is not installed" in hint[0], proc.stdout
            assert "pip install 'dmuon[plot]'" in hint[0]
            assert "Traceback" not in proc.stderr, proc.stderr


def test_cli_pi0_on_4x8_is_solved_by_the_milp(tmp_path, capsys):
    """Issue 28's crashing command (Pi0 inventory, 4 nodes x 8 GPUs, FLOP model): CBC aborted
    in its RINS heuristic once warm-started. Now CBC itself returns the plan: no failure, no
    retry, no fallback (1 s time limit to stay fast; at 10 s it is the same plan)."""
    out = tmp_path / "plan.json"
    rc = main(["--model", "pi0", "--nodes", "4", "--gpus-per-node", "8", "--out", str(out),
               "--time-limit-s", "1", "--measure", "no", "--no-plot",
               "--cache", str(tmp_path / "c.json")])
    assert rc == 0
    plan = OwnerPlan.load(out)
    plan.check_matches(dict(inventory("pi0")), 32)
    assert plan.method == "milp" and plan.extra["detail"] == "cbc"
    assert plan.extra["milp_status"] in ("optimal", "time limit")  # not "failed", not "retried"
    loads = [0.0] * 32
    for m in plan.matrices:
        loads[m.owner] += m.cost
    assert max(loads) == pytest.approx(plan.makespan)
    costs = [m.cost for m in plan.matrices]
    assert plan.extra["proven_bound"] >= max(sum(costs) / 32, max(costs)) * (1 - 1e-12)
    assert plan.extra["proven_bound"] <= plan.makespan
    assert plan.makespan <= solve(costs, 32, method="greedy").makespan  # never worse than LPT
    text = capsys.readouterr().out
    assert "plan by milp/cbc (MILP" in text and "gap" in text


def test_cli_names_the_fallback_and_its_cause(tmp_path, capsys, caplog):
    """A CBC that crashes: the CLI still writes the plan, says it is the greedy fallback and
    why, in the summary (stdout) and in one warning line (the log; stderr without handlers)."""
    from tests.solver_cases import CRASH_TEXT, stub_cbc

    out = tmp_path / "plan.json"
    with stub_cbc("raise") as stub:
        rc = main(["--model", "pi0", "--nodes", "4", "--gpus-per-node", "8", "--out", str(out),
                   "--time-limit-s", "1", "--measure", "no", "--no-plot",
                   "--cache", str(tmp_path / "c.json")])
    assert rc == 0 and stub.calls == [True, False]
    plan = OwnerPlan.load(out)
    assert plan.method == "greedy" and plan.extra["milp_status"].startswith("failed: CBC crashed")
    captured = capsys.readouterr()
    assert f"(greedy fallback after the MILP failed: CBC crashed: PulpSolverError: {CRASH_TEXT}" \
        in captured.out
    warning = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warning) == 1 and "owner MILP failed" in warning[0] and CRASH_TEXT in warning[0]


def test_transposed_shapes_share_one_milp_class():
    """``[18944, 3584]`` and ``[3584, 18944]`` cost the same FLOPs and bytes: one MILP class.
    Qwen2.5-7B on 32 ranks is then proven optimal in ~0.2 s (2-core dev machine); with one
    class per shape CBC did not prove it within 5 s (issue 28)."""
    named = inventory("qwen2.5-7b")
    shapes = [s for _, s in named]
    costs = [float(ns_flops(*s, method="gram")) for s in shapes]
    res = solve(costs, 32, classes=shapes, method="milp", time_limit_s=5)
    assert res.optimal and res.method == "milp" and res.milp_status == "optimal"
    # an optimum, checked against the pigeonhole bound and an independent load recount
    loads = [sum(c for c, r in zip(costs, res.owners) if r == k) for k in range(32)]
    assert max(loads) == pytest.approx(res.makespan)
    assert res.makespan >= makespan_lower_bound(costs, 32) * (1 - 1e-12)


def test_cli_group_cost_keeps_layers_on_fewer_owners(tmp_path, capsys):
    """``--group-cost auto`` on CPU prices each (layer, owner) publication as gloo does; the
    plan then has fewer pairs than the XOR plan, counted here from the plan's own owners."""
    from dmuon.balance.inventories import layer_groups

    plans = {}
    for cost in ("0", "auto"):
        out = tmp_path / f"plan_{cost}.json"
        rc = main(["--model", "pi0-tiny", "--gpus-per-node", "4", "--out", str(out),
                   "--time-limit-s", "1", "--measure", "no", "--no-plot", "--group-cost", cost,
                   "--cache", str(tmp_path / "c.json")])
        assert rc == 0
        plans[cost] = OwnerPlan.load(out)
    fqns = [m.fqn for m in plans["0"].matrices]
    groups = layer_groups(fqns)
    pairs = {c: len({(g, m.owner) for g, m in zip(groups, p.matrices)}) for c, p in plans.items()}
    assert pairs["auto"] < pairs["0"]
    assert plans["auto"].extra["publish_pairs"] == pairs["auto"]
    assert plans["auto"].extra["layout"] == "none" and plans["0"].extra["layout"] == "xor"
    assert main(["--model", "pi0-tiny", "--gpus-per-node", "2", "--group-cost", "-1",
                 "--measure", "no", "--no-plot", "--out", str(tmp_path / "x.json")]) == 2
    assert "group_cost" in capsys.readouterr().err


def test_cli_infeasible_memory_cap_exits_with_message(tmp_path, capsys):
    rc = main(["--model", "pi0-tiny", "--gpus-per-node", "2", "--memory-cap-gb", "1e-6",
               "--out", str(tmp_path / "p.json"), "--measure", "no", "--no-plot"])
    assert rc == 2
    assert "smallest feasible cap" in capsys.readouterr().err


def test_model_factory_on_meta_takes_2d_non_embedding(tmp_path, monkeypatch):
    (tmp_path / "toy_model_for_dmuon.py").write_text(
        "import torch.nn as nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 16), nn.LayerNorm(16),\n"
        "                         nn.Linear(16, 4, bias=False))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = model_inventory("toy_model_for_dmuon:build")
    assert got == [("1.weight", (16, 8)), ("3.weight", (4, 16))]
    with pytest.raises(ValueError, match="neither a known inventory"):
        model_inventory("nonsense")


def test_fit_batch_costs_matches_least_squares():
    ks = np.array([1, 2, 4, 8])
    t = 0.7 + 1.3 * ks + np.array([0.01, -0.02, 0.015, -0.005])
    fixed, marginal = fit_batch_costs(dict(zip(ks.tolist(), t.tolist())))
    ref_slope, ref_fixed = np.polyfit(ks, t, 1)
    assert fixed == pytest.approx(ref_fixed) and marginal == pytest.approx(ref_slope)
    assert fit_batch_costs({4: 8.0}) == (0.0, 2.0)
    with pytest.raises(ValueError):
        fit_batch_costs({})


def test_profiler_caches_by_device_torch_and_shape(tmp_path, monkeypatch):
    calls = []

    def fake_time(shape, batch, **kw):
        calls.append((shape, batch))
        return float(shape[0] * batch)

    monkeypatch.setattr(profiler, "time_ns", fake_time)
    cache = tmp_path / "cache.json"
    got = profiler.profile_shapes([(8, 16), (8, 16), (4, 4)], batch_sizes=(1, 2),
                                  cache_path=cache, progress=False)
    assert got == {(4, 4): {1: 4.0, 2: 8.0}, (8, 16): {1: 8.0, 2: 16.0}}
    assert len(calls) == 4
    keys = json.loads(cache.read_text())
    assert any(k.startswith("cpu|torch ") and "|8x16|b2|s5" in k for k in keys)
    profiler.profile_shapes([(8, 16)], batch_sizes=(1, 2), cache_path=cache, progress=False)
    assert len(calls) == 4  # served from the cache


def test_time_ns_runs_the_real_ns_path():
    ms = profiler.time_ns((16, 24), 2, device="cpu", warmup=1, repeats=2)
    assert ms > 0
    costs, overhead, unit = profiler.profile_costs([(16, 24)], measure=False)
    assert unit == "flops" and costs[0] > 0 and overhead == {}


def test_cli_expert_parallel_plan(tmp_path, capsys):
    """``--ep 8`` on Qwen3-30B-A3B over 2 x 8 ranks: each stack's 16 local experts are balanced
    over the expert group of 2 ranks, the dense matrices over all 16; the plan loads on an
    (efsdp 2, ep 8) layout and nowhere else."""
    out = tmp_path / "plan.json"
    rc = main(["--model", "qwen3-30b-a3b", "--nodes", "2", "--gpus-per-node", "8", "--ep", "8", "--out",
               str(out), "--time-limit-s", "1", "--measure", "no", "--no-plot", "--cache", str(tmp_path / "c.json")])
    assert rc == 0
    plan = OwnerPlan.load(out)
    assert plan.ep_size == 8 and plan.world_size == 16
    inv = inventory("qwen3-30b-a3b")
    stacks = [fqn for fqn, shape in inv if len(shape) == 3]
    local = {fqn: ((shape[0] // 8,) + tuple(shape[1:]) if fqn in stacks else shape) for fqn, shape in inv}
    plan.check_matches(local, 16, ep_size=8, expert_parallel=stacks)
    with pytest.raises(ValueError, match="re-solve"):
        plan.check_matches(dict(inv), 16)
    assert all(m.owner < 2 for m in plan.matrices if m.ep)
    assert plan.makespan == pytest.approx(max(plan.loads())) and plan.makespan <= 1.01 * plan.lower_bound
    rows = capsys.readouterr().out.splitlines()
    # each of the 12,288 experts counted once, on one rank of its group: 16 local experts x 96
    # stacks / 2 group ranks = 768 per rank, plus a share of the 240 dense matrices
    counts = [int(line.split()[-1]) for line in rows[1:17]]
    assert sum(counts) == 12528 and min(counts) >= 768, counts


@pytest.mark.compat
def test_cli_prints_makespan_and_exposed_time_and_minimizes_the_exposed_one(tmp_path, capsys):
    """Issue 39: the summary gives the makespan and the exposed NS time under overlap; with
    ``--objective exposed`` the plan's exposed time, recomputed here by replaying the overlapped
    schedule from the plan file (forward = 2 x tokens x rows x cols per matrix), is no larger
    than the makespan plan's; ``--objective overlap`` (the runtime's objective, issue 46) exposes
    no more than the makespan plan it started from, within 2% of its makespan."""
    from dmuon.balance.inventories import layer_groups
    from dmuon.balance.deadline import MAKESPAN_SLACK

    plans, text = {}, {}
    for objective in ("makespan", "exposed", "overlap"):
        out = tmp_path / f"{objective}.json"
        assert main(["--model", "pi0-tiny", "--gpus-per-node", "4", "--out", str(out),
                     "--time-limit-s", "1", "--measure", "no", "--no-plot", "--tokens", "64",
                     "--objective", objective, "--cache", str(tmp_path / "c.json")]) == 0
        plans[objective] = OwnerPlan.load(out)
        text[objective] = capsys.readouterr().out
    inv = inventory("pi0-tiny")
    unit_of = dict(zip([f for f, _ in inv], layer_groups([f for f, _ in inv])))
    forward = [0.0] * (max(unit_of.values()) + 1)
    for fqn, (r, c) in inv:
        forward[unit_of[fqn]] += 2.0 * 64 * r * c

    def replay(plan):  # every owner runs its NS unit by unit; forward k waits for unit k's NS
        done = {}
        for rank in range(plan.world_size):
            t = 0.0
            for k in range(len(forward)):
                mine = [m.cost for m in plan.matrices if m.owner == rank and unit_of[m.fqn] == k]
                if mine:
                    t += sum(mine)
                    done[k] = max(done.get(k, 0.0), t)
        start = free = 0.0
        for k, f in enumerate(forward):
            start = max(free, done.get(k, 0.0))
            free = start + f
        return start - sum(forward[:-1])

    for objective, plan in plans.items():
        plan.check_matches(dict(inv), 4)
        line = [x for x in text[objective].splitlines() if x.startswith("exposed ")]
        assert len(line) == 1 and f"objective {objective}" in line[0]
        assert any(x.startswith("makespan ") for x in text[objective].splitlines())
        assert float(line[0].split()[1]) == pytest.approx(plan.extra["exposed"] / 1e12, abs=0.6e-4)  # TFLOP, 4 decimals
        assert plan.extra["exposed"] == pytest.approx(replay(plan), rel=1e-9)
    assert plans["exposed"].extra["exposed"] <= plans["makespan"].extra["exposed"] * (1 + 1e-9)
    assert plans["exposed"].extra["objective"] == "exposed"
    assert plans["exposed"].extra["layout"] == "none"
    overlap = plans["overlap"].extra
    assert overlap["objective"] == "overlap" and overlap["layout"] == "none", overlap
    assert overlap["exposed"] <= overlap["makespan_plan_exposed"] * (1 + 1e-9), overlap
    assert plans["overlap"].makespan <= (1 + MAKESPAN_SLACK) * overlap["makespan_plan_makespan"] * (1 + 1e-9)


@pytest.mark.compat
def test_unit_times_flop_model_and_measured_cache(tmp_path, monkeypatch):
    units = [[(8, 16), (4, 4)], [], [(8, 16)]]
    fwd, bwd, unit = profiler.unit_times(units, tokens=3, measure=False)
    assert unit == "flops" and fwd == [2 * 3 * (8 * 16 + 4 * 4), 0.0, 2 * 3 * 8 * 16]
    assert bwd == [2 * f for f in fwd]
    calls = []
    monkeypatch.setattr(profiler, "time_matmul",
                        lambda shape, tokens, **kw: calls.append(shape) or float(shape[0] + tokens))
    cache = tmp_path / "c.json"
    fwd, _, unit = profiler.unit_times(units, tokens=3, measure=True, cache_path=cache)
    assert unit == "ms" and fwd == [11.0 + 7.0, 0.0, 11.0] and sorted(calls) == [(4, 4), (8, 16)]
    profiler.unit_times(units, tokens=3, measure=True, cache_path=cache)
    assert len(calls) == 2  # served from the cache
    assert profiler.time_matmul((4, 6), 5, device="cpu", warmup=0, repeats=1) > 0
    with pytest.raises(ValueError, match="tokens"):
        profiler.unit_times(units, tokens=0, measure=False)
