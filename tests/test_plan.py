"""The one plan author (:func:`dmuon.owners.plan.build_plan`): HSDP replicate modes in the plan
and its digest, the XOR layout under TP, and the one-way imports of ``dmuon/balance``.

Single process, no pool: about a second in all.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

import dmuon
from dmuon.balance import evaluate
from dmuon.balance.cost import NS_FLOPS_PER_S, REPLICA_BYTES_PER_S, ReplicaCost
from dmuon.balance.inventories import inventory, layer_groups
from dmuon.owners.plan import MatrixSpec, OwnerPlan, build_plan

BALANCE = pathlib.Path(dmuon.__file__).parent / "balance"


def _gram_seconds(rows: int, cols: int, flops_per_s: float) -> float:
    """DESIGN.md's Gram count for 5 steps, 1 restart, non-square: 8 p^2 q + 28 p^3 FLOPs."""
    p, q = sorted((rows, cols))
    return (8.0 * p * p * q + 28.0 * p ** 3) / flops_per_s


@pytest.mark.parametrize("shape", [(1, 12), (512, 4096), (2048, 8192), (3000, 5000), (4096, 14336)])
@pytest.mark.parametrize("flops_per_s", [NS_FLOPS_PER_S, 1.5e12])
def test_replica_cost_picks_the_cheaper_mode(shape, flops_per_s):
    """``ReplicaCost.mode`` against the two costs written out here: NS seconds by DESIGN.md's
    Gram count vs one fp32 master's broadcast at ``REPLICA_BYTES_PER_S``."""
    compute_s = _gram_seconds(*shape, flops_per_s)
    broadcast_s = 4.0 * shape[0] * shape[1] / REPLICA_BYTES_PER_S
    want = "compute" if compute_s <= broadcast_s else "broadcast"
    assert ReplicaCost(ns_flops_per_s=flops_per_s).mode(shape) == want


def test_the_shipped_figures_split_real_shapes():
    """With the shipped figures both modes occur on Qwen2.5-7B (else ``"auto"`` could not be
    told apart from one fixed mode): k/v [512, 3584] compute, the square q/o [3584, 3584]
    (standard NS count, 30 p^3) broadcast."""
    plan = build_plan(inventory("qwen2.5-7b"), 4, method="greedy", replicate_mode="auto")
    modes = {m.fqn.rsplit(".", 2)[-2]: m.replicate_mode for m in plan.matrices}
    assert modes["k_proj"] == "compute" and modes["q_proj"] == "broadcast", modes


def test_replicate_modes_are_in_the_plan_the_digest_and_the_json(tmp_path):
    inv = [("a.weight", (4, 4096)), ("b.weight", (4096, 4096))]
    bare = build_plan(inv, 2, method="greedy")
    assert all(m.replicate_mode is None for m in bare.matrices)
    auto = bare.with_replicate_modes("auto", ReplicaCost(ns_flops_per_s=1e12))
    assert [m.replicate_mode for m in auto.matrices] == ["compute", "broadcast"]
    forced = auto.with_replicate_modes("compute")
    assert [m.replicate_mode for m in forced.matrices] == ["compute", "compute"]
    # "auto" keeps the modes a plan holds (a plan file solved for this cluster wins)
    assert auto.with_replicate_modes("auto") == auto
    # every rank must agree on the modes: they change the collectives
    assert len({bare.digest(), auto.digest(), forced.digest()}) == 3
    auto.save(tmp_path / "plan.json")
    loaded = OwnerPlan.load(tmp_path / "plan.json")
    assert loaded == auto and loaded.digest() == auto.digest()
    assert bare.with_replicate_modes(None) is bare


def test_bad_replicate_modes_raise():
    with pytest.raises(ValueError, match="replicate_mode='sometimes'"):
        MatrixSpec(fqn="w", shape=(2, 3), owner=0, replicate_mode="sometimes")
    plan = build_plan([("w", (2, 3))], 1)
    with pytest.raises(ValueError, match="'auto', 'compute' or 'broadcast'"):
        plan.with_replicate_modes("sometimes")
    with pytest.raises(TypeError, match="ReplicaCost"):
        plan.with_replicate_modes("auto", 1.5e12)
    with pytest.raises(ValueError, match="ns_flops_per_s must be a finite number > 0"):
        ReplicaCost(ns_flops_per_s=0)


def test_xor_layout_under_tp_keeps_the_balanced_loads():
    """One author for TP and the XOR layout: the layout over the (DP owner, TP owner) grid only
    rearranges owners within a shape, so every solver rank keeps the makespan plan's load."""
    inv = inventory("pi0-tiny")
    plain = build_plan(inv, 4, tp_size=2, method="greedy")
    laid = build_plan(inv, 4, tp_size=2, method="greedy", layout=(2, 4), solver_report=True)
    assert sorted(plain.loads()) == pytest.approx(sorted(laid.loads()))
    assert laid.extra["layout"] == "xor" and laid.makespan == pytest.approx(plain.makespan)
    # the layout spreads a layer: its matrices land on more distinct ranks than LPT puts them
    groups = layer_groups([f for f, _ in inv])
    spread = lambda plan: sum(len({(m.owner, m.tp_owner) for g2, m in zip(groups, plan.matrices) if g2 == g})
                              for g in set(groups))
    assert spread(laid) > spread(plain)
    # loads recomputed independently of OwnerPlan.loads
    ranks = [m.owner * 2 + m.tp_owner for m in laid.matrices]
    assert evaluate(ranks, [m.cost for m in laid.matrices], 8) == pytest.approx(laid.loads())
    with pytest.raises(ValueError, match="covers 4 ranks but the plan has world_size \\* tp_size = 8"):
        build_plan(inv, 4, tp_size=2, layout=(1, 4))


def _balance_imports() -> nx.DiGraph:
    """Module-level and function-level imports between ``dmuon/balance`` modules."""
    graph = nx.DiGraph()
    for path in BALANCE.glob("*.py"):
        if path.stem == "__init__":
            continue
        graph.add_node(path.stem)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dmuon.balance."):
                graph.add_edge(path.stem, node.module.split(".")[2])
            elif isinstance(node, ast.ImportFrom) and node.module == "dmuon.balance":
                graph.add_edge(path.stem, "__init__")
    return graph


def test_balance_imports_run_one_way():
    """No import circle in ``balance/``: every solver imports the shared helpers from
    ``assignment.py`` below the orchestrator, never ``solver.py`` (lazy imports included)."""
    graph = _balance_imports()
    assert "solver" in graph and graph.out_degree("solver") >= 4, sorted(graph.edges)
    assert nx.is_directed_acyclic_graph(graph), nx.find_cycle(graph)
    assert not list(graph.predecessors("solver")), sorted(graph.edges)


def test_bucket_path_refuses_options_it_does_not_take():
    """The DDP-style bucket plan is one path of the one author; options of the other paths
    would be silently dropped, so they raise, naming them."""
    inv = inventory("pi0-tiny")
    plan = build_plan(inv, 2, bucket_bytes=2 ** 16)
    assert plan.method == "buckets" and all(m.bucket is not None for m in plan.matrices)
    with pytest.raises(ValueError, match=r"takes no \['tp_size', 'replicate_mode'\]"):
        build_plan(inv, 2, bucket_bytes=2 ** 16, tp_size=2, replicate_mode="auto")
