"""Publish-group-aware placement (``solve(groups=..., group_cost=...)``) against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from dmuon.balance import evaluate, solve
from dmuon.balance.cost import GLOO_PAIR_COST_S, default_group_cost, flop_costs
from dmuon.balance.grouping import group_lpt, merge_groups, publish_pairs
from dmuon.balance.inventories import inventory, layer_groups


def true_objective(owners, costs, ranks, groups, alpha, overhead=None, classes=None):
    """makespan + alpha * distinct (group, owner) pairs, computed from scratch."""
    loads = [0.0] * ranks
    batches = set()
    for i, r in enumerate(owners):
        loads[r] += costs[i]
        if overhead and (r, classes[i]) not in batches:
            batches.add((r, classes[i]))
            loads[r] += overhead[classes[i]]
    return max(loads) + alpha * len(set(zip(groups, owners)))


def brute_force(costs, ranks, groups, alpha, *, overhead=None, classes=None, memory=None, cap=None):
    """Optimal objective by enumerating every assignment (independent reference)."""
    best = float("inf")
    for owners in itertools.product(range(ranks), repeat=len(costs)):
        if owners[0] != 0:  # rank symmetry
            continue
        if cap is not None:
            used = [0.0] * ranks
            for m, r in zip(memory, owners):
                used[r] += m
            if max(used) > cap:
                continue
        best = min(best, true_objective(owners, costs, ranks, groups, alpha, overhead, classes))
    return best


def instance(rng, n=7):
    shapes = [rng.choice([(4, 8), (8, 8), (8, 16), (16, 32)]) for _ in range(n)]
    costs = flop_costs(shapes)
    groups = sorted(rng.randrange(3) for _ in range(n))
    return shapes, costs, groups


@pytest.mark.parametrize("seed", range(8))
def test_milp_reaches_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    shapes, costs, groups = instance(rng)
    ranks = rng.choice([2, 3])
    alpha = rng.choice([0.05, 0.3, 1.0, 3.0]) * max(costs)
    kwargs, ref_kwargs = {}, {}
    if seed % 2:  # batched NS: a fixed cost per (rank, shape)
        overhead = {s: 0.2 * max(costs) for s in set(shapes)}
        kwargs = dict(classes=shapes, batch_overhead=overhead)
        ref_kwargs = dict(overhead=overhead, classes=shapes)
    res = solve(costs, ranks, groups=groups, group_cost=alpha, method="milp", **kwargs)
    best = brute_force(costs, ranks, groups, alpha, **ref_kwargs)
    got = true_objective(res.owners, costs, ranks, groups, alpha, **ref_kwargs)
    assert res.optimal and res.method == "milp"
    assert got == pytest.approx(best, rel=1e-9)
    assert res.objective == pytest.approx(got, rel=1e-9)
    assert res.publish_pairs == len(set(zip(groups, res.owners)))


@pytest.mark.parametrize("seed", range(6))
def test_memory_cap_is_kept(seed):
    rng = random.Random(100 + seed)
    shapes, costs, groups = instance(rng, n=6)
    memory = [float(r * c) for r, c in shapes]
    tightest = min(max(sum(m for m, r in zip(memory, o) if r == q) for q in range(2))
                   for o in itertools.product(range(2), repeat=len(memory)))
    cap = max(0.6 * sum(memory), tightest)  # feasible, and forbids one rank owning all
    alpha = 10.0 * max(costs)  # strong pull toward one owner for all
    res = solve(costs, 2, groups=groups, group_cost=alpha, memory=memory, memory_cap=cap,
                method="milp")
    used = [sum(m for m, r in zip(memory, res.owners) if r == q) for q in range(2)]
    assert max(used) <= cap
    best = brute_force(costs, 2, groups, alpha, memory=memory, cap=cap)
    assert true_objective(res.owners, costs, 2, groups, alpha) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_heuristics_never_worse_than_their_starts(seed):
    rng = random.Random(200 + seed)
    shapes, costs, groups = instance(rng, n=9)
    alpha = rng.choice([0.1, 1.0, 5.0]) * max(costs)
    plain = solve(costs, 3, method="greedy").owners
    whole = group_lpt(costs, 3, groups=groups)
    res = solve(costs, 3, groups=groups, group_cost=alpha, method="greedy")
    got = true_objective(res.owners, costs, 3, groups, alpha)
    assert res.method == "greedy"
    assert got <= true_objective(plain, costs, 3, groups, alpha) * (1 + 1e-12)
    assert got <= true_objective(whole, costs, 3, groups, alpha) * (1 + 1e-12)
    assert got >= brute_force(costs, 3, groups, alpha) * (1 - 1e-12)
    merged = merge_groups(plain, costs, 3, groups=groups, group_cost=alpha)
    assert publish_pairs(merged, groups) <= publish_pairs(plain, groups)


def test_group_lpt_gives_each_group_one_owner():
    costs = [5.0, 1.0, 4.0, 4.0, 2.0, 2.0, 3.0]
    groups = [0, 0, 1, 1, 2, 2, 3]
    owners = group_lpt(costs, 2, groups=groups)
    assert publish_pairs(owners, groups) == 4
    # totals 6, 8, 4, 3 by decreasing cost: 8 -> r0, 6 -> r1, 4 -> r1, 3 -> r0: loads 11, 10
    assert sorted(evaluate(owners, costs, 2)) == [10.0, 11.0]
    assert group_lpt(costs, 2, groups=groups, memory=[1.0] * 7, memory_cap=1.5) is None


def test_zero_group_cost_keeps_the_makespan_plan():
    rng = random.Random(7)
    _, costs, groups = instance(rng, n=10)
    assert (solve(costs, 3, groups=groups).owners == solve(costs, 3).owners)
    assert solve(costs, 3, groups=groups).publish_pairs == len(set(zip(groups, solve(costs, 3).owners)))


def test_extreme_group_costs():
    rng = random.Random(11)
    _, costs, groups = instance(rng, n=8)
    huge = solve(costs, 3, groups=groups, group_cost=1e6 * sum(costs), method="milp")
    assert huge.publish_pairs == len(set(groups))
    tiny = solve(costs, 3, groups=groups, group_cost=1e-9 * min(costs), method="milp")
    assert tiny.makespan == pytest.approx(brute_force(costs, 3, groups, 0.0), rel=1e-9)


def test_qwen_at_64_ranks_is_solved_in_time():
    """Qwen2.5-7B, 196 matrices in 28 groups, 64 ranks: above AUTO_MAX_GROUP_VARS the
    heuristics alone run, quickly, and beat the makespan plan on the objective."""
    inv = inventory("qwen2.5-7b")
    fqns = [f for f, _ in inv]
    costs = flop_costs([s for _, s in inv])
    groups = layer_groups(fqns)
    alpha = 0.02 * max(costs)
    plain = solve(costs, 64, method="greedy", time_limit_s=2)
    res = solve(costs, 64, groups=groups, group_cost=alpha, time_limit_s=2)
    assert res.method == "greedy" and res.solve_s < 5
    assert res.objective < true_objective(plain.owners, costs, 64, groups, alpha)


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match="needs groups"):
        solve([1.0, 2.0], 2, group_cost=1.0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        solve([1.0, 2.0], 2, groups=[0, 0], group_cost=-1.0)
    with pytest.raises(ValueError, match="give one of them"):
        solve([1.0] * 4, 4, groups=[0, 0, 1, 1], group_cost=1.0, layout=(2, 2))
    with pytest.raises(ValueError, match="cost_unit"):
        default_group_cost("gloo", "seconds")


def test_default_group_cost_by_backend():
    assert default_group_cost("nccl", "flops") == 0.0
    assert default_group_cost("cpu:gloo,cuda:nccl", "ms") == 0.0
    assert default_group_cost("gloo", "ms") == pytest.approx(GLOO_PAIR_COST_S * 1e3)
    assert default_group_cost("gloo", "flops") > 1e6


def _blocks_of_wrapped_policy(rank: int, world_size: int) -> dict:
    """Wrap the dmuon.train policy as ``python -m dmuon.train`` does; return each matrix's
    FSDP2 publish block (by the runtime's rule) beside its name."""
    import torch

    from dmuon.hooks import fsdp_adapter as fsdp
    from dmuon.hooks.dedicate import default_predicate, select_matrices
    from dmuon.train.model import Pi0Policy, PolicyConfig
    from dmuon.train.parallel import Layout, shard_model

    torch.manual_seed(0)
    model = Pi0Policy(PolicyConfig())
    shard_model(model, model.shardable_blocks(), Layout.parse("fsdp", world_size), torch.device("cpu"))
    parents = fsdp.parent_map(model)
    selected = select_matrices(model, default_predicate(model))
    return {"fqns": [s.fqn for s in selected],
            "blocks": [id(fsdp.publish_block(s.module, parents)) for s in selected]}


def test_layer_groups_match_the_runtimes_publish_blocks(dist_pool):
    """The inventory-side rule (numbered layers, plus one root block) partitions a wrapped
    model's matrices exactly as the runtime's FSDP2 blocks do, root block included."""
    out = dist_pool.run(1, "tests.test_grouping:_blocks_of_wrapped_policy", {}, timeout_s=60)[0]
    by_name = layer_groups(out["fqns"])
    same = lambda ids: {(i, j) for i in range(len(ids)) for j in range(len(ids)) if ids[i] == ids[j]}
    assert same(by_name) == same(out["blocks"])
    roots = [f for f in out["fqns"] if ".blocks." not in f]
    assert len(roots) >= 2, roots  # else one group per root matrix would pass as well
