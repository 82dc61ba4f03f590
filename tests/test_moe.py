"""Mixture-of-Experts (issue 26): expert stacks ``[E, rows, cols]`` as one Muon matrix per
expert, spread over owners in expert ranges; ``ModuleList`` experts that get no tokens on some
ranks. FSDP2 and HSDP on gloo ranks, fp32 exact mode, against single-process
``torch.optim.Muon`` on every expert's 2-D slice + ``AdamW`` (``tests/moe_cases.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests import ep_cases
from tests import moe_cases as cases
from tests.test_core import FP32_ATOL, compare

STEPS = 3


@pytest.mark.parametrize("case,world_size,mesh", [
    ("hf-qwen3-moe", 2, "fsdp"),
    ("hf-mixtral", 4, "fsdp"),
    ("hf-deepseek-v3", 3, "fsdp"),
    ("hf-qwen3-moe", 4, "hsdp"),
    ("list-moe", 2, "fsdp"),
    ("list-moe", 4, "hsdp"),
    ("hf-qwen3-moe", 2, "plain"),
])
def test_moe_model_matches_reference(dist_pool, case, world_size, mesh):
    # DeepSeek-V3 runs on the default plan (a stack may stay whole on one owner); the other
    # HF models on a plan that splits every expert stack over the ranks
    spread = case != "hf-deepseek-v3"
    out = dist_pool.run(world_size, "tests.moe_cases:train", dict(case=case, steps=STEPS, mesh=mesh, spread=spread),
                        timeout_s=120, fresh=mesh == "hsdp")
    ref, ref_losses = cases.reference(case, world_size, STEPS)
    worst = compare(out[0]["params"], ref, FP32_ATOL)
    print(f"{case} {mesh} on {world_size} ranks: max |diff| {worst:.3g}")  # for the issue note (-s)
    np.testing.assert_allclose(np.mean([o["losses"] for o in out], axis=0), ref_losses, rtol=1e-5)
    if case.startswith("hf-") and spread:  # every layer's experts are spread over several owners
        assert out[0]["max_owners_per_param"] > 1, out[0]["entries"]


def test_modulelist_experts_without_tokens_on_some_ranks(dist_pool):
    """Some expert runs on one rank and not on the other in some step (that rank contributes
    zero), and the run still matches the reference (checked above): the case is exercised."""
    out = dist_pool.run(2, "tests.moe_cases:train", dict(case="list-moe", steps=STEPS), timeout_s=120)
    calls = [set(map(tuple, o["calls"])) for o in out]
    assert calls[0] ^ calls[1], "every expert ran on both ranks in every step: the case is not exercised"
    ref, _ = cases.reference("list-moe", 2, STEPS)
    compare(out[0]["params"], ref, FP32_ATOL)


def test_fused_gate_up_split_into_blocks_matches_reference(dist_pool):
    """``default_predicate(fused_blocks={"gate_up_proj": 2})``: gate and up orthogonalized
    separately, as torch.optim.Muon on each [I, H] block as a parameter of its own."""
    blocks = {"gate_up_proj": 2}
    out = dist_pool.run(2, "tests.moe_cases:train",
                        dict(case="hf-qwen3-moe", steps=STEPS, fused_blocks=blocks), timeout_s=120)
    ref, ref_losses = cases.reference("hf-qwen3-moe", 2, STEPS, fused_blocks=blocks)
    worst = compare(out[0]["params"], ref, FP32_ATOL)
    print(f"hf-qwen3-moe fused_blocks=2 on 2 ranks: max |diff| {worst:.3g}")
    np.testing.assert_allclose(np.mean([o["losses"] for o in out], axis=0), ref_losses, rtol=1e-5)
    # whole-matrix Muon would differ: the split is real
    whole, _ = cases.reference("hf-qwen3-moe", 2, STEPS)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert (whole[name] - ref[name]).abs().max() > 1e-3


def test_default_predicate_selects_expert_stacks_and_router():
    model = cases.build("hf-qwen3-moe")
    import dmuon

    pick = dmuon.default_predicate(model)
    chosen = {n for n, p in model.named_parameters() if pick(n, p)}
    assert "model.layers.0.mlp.experts.gate_up_proj" in chosen  # [E, 2I, H]: one matrix per expert
    assert "model.layers.1.mlp.experts.down_proj" in chosen
    assert "model.layers.0.mlp.gate.weight" in chosen  # the router: a 2-D matrix, today's rule
    assert "model.embed_tokens.weight" not in chosen
    assert not {n for n in chosen if "norm" in n}
    assert chosen == set(cases.muon_names("hf-qwen3-moe", model))
    split = dmuon.default_predicate(model, fused_blocks={"gate_up_proj": 2})
    params = dict(model.named_parameters())
    assert split("model.layers.0.mlp.experts.gate_up_proj", params["model.layers.0.mlp.experts.gate_up_proj"]) == 2
    assert split("model.layers.0.mlp.experts.down_proj", params["model.layers.0.mlp.experts.down_proj"]) is True
    conv = cases.WithConv()
    assert not dmuon.default_predicate(conv)("conv.weight", conv.conv.weight)  # convolutions: AdamW


@pytest.mark.parametrize("case,words", [
    ("1d", ["'0.bias'", "(8,)", "2-D matrices or stacks", "predicate=..."]),
    ("conv", ["'conv.weight'", "convolution", "(4, 3, 3, 3)", "predicate=..."]),
    ("not-experts", ["'table'", "(4, 6, 8)", "declares no expert count", "num_experts = 4", "predicate=..."]),
    ("bad-blocks", ["gate_up_proj'", "3 row blocks", "16 rows"]),
])
def test_bad_stack_selection_raises_on_every_rank(dist_pool, case, words):
    out = dist_pool.run(2, "tests.moe_cases:bad_input", dict(case=case), timeout_s=60)
    for msg in out:  # every rank, before any collective: no hang
        assert msg.startswith("ValueError: dmuon: "), msg
        for word in words:
            assert word in msg, (word, msg)


def test_plan_records_expert_ranges():
    """The balancer sees every expert; the plan collapses them into one contiguous range per
    owner, round-trips them through JSON and covers them in its digest."""
    from dmuon.owners.plan import OwnerPlan, build_plan

    shapes = [("attn.w", (16, 16)), ("moe.gate_up", (8, 8, 16)), ("moe.down", (8, 16, 4))]
    plan = build_plan(shapes, 4, method="greedy")
    ranges = [m for m in plan.matrices if m.fqn == "moe.gate_up"]
    assert len(ranges) > 1 and len({m.owner for m in ranges}) == len(ranges)
    assert [m.experts for m in ranges][0][0] == 0 and ranges[-1].experts[1] == 8
    assert all(a.experts[1] == b.experts[0] for a, b in zip(ranges, ranges[1:]))
    assert all(m.shape == (8, 16) for m in ranges)  # one expert's matrix
    assert abs(sum(plan.loads()) - sum(m.cost for m in plan.matrices)) < 1e-6
    again = OwnerPlan.from_dict(plan.to_dict())
    assert again == plan and again.digest() == plan.digest()
    import dataclasses

    moved = dataclasses.replace(plan, matrices=tuple(
        dataclasses.replace(m, experts=(0, m.experts[1] + 1)) if m is ranges[0] else m
        for m in plan.matrices))
    assert moved.digest() != plan.digest()
    plan.check_matches(dict(shapes), 4)
    with pytest.raises(ValueError, match="expert ranges"):
        moved.check_matches(dict(shapes), 4)
    with pytest.raises(ValueError, match="re-solve"):
        plan.check_matches({**dict(shapes), "moe.down": (8, 16, 8)}, 4)


@pytest.mark.parametrize("case,world_size,ep,options", [
    ("ep-moe", 2, 2, {}),                  # (efsdp 1, ep 2): every rank holds 2 of the 4 experts alone
    ("ep-moe", 4, 2, {}),                  # efsdp 2 x ep 2: each expert group of 2 ranks splits its stacks
    ("ep-moe", 4, 4, dict(spread=False)),  # ep 4, the default plan (MILP, gloo group cost)
    ("ep-moe-2", 4, 2, {}),                # 1 local expert over efsdp 2: empty FSDP2 shards on 2 ranks
    ("ep-moe", 2, 2, dict(one_d=True)),    # a 1-D ("ep",) mesh, experts outside FSDP2
    ("ep-moe", 4, 2, dict(dedicate_first=True)),  # dedicate_params before fully_shard
    ("ep-moe", 4, 2, dict(micro_batches=2)),      # gradient accumulation (dmuon.no_sync)
    ("ep-moe", 4, 2, dict(replicas=2)),           # HSDP in front: ("replicate", "efsdp", "ep") 2x1x2
    ("ep-moe", 4, 2, dict(replicas=2, replicate_mode="broadcast")),
    ("ep-moe", 4, 2, dict(overlap="forward")),    # Newton-Schulz behind the next forward
    ("ep-moe", 4, 4, dict(spread=False, overlap="forward")),
    ("hf-qwen3-moe", 4, 2, dict(overlap="backward")),
    ("ep-moe", 4, 2, dict(replicas=2, replicate_mode="broadcast", overlap="backward")),
    ("hf-qwen3-moe", 4, 2, {}),           # Hugging Face models, their experts' forward dispatching
    ("hf-mixtral", 3, 3, {}),             # 3 experts: ep 3, one per rank
    ("hf-deepseek-v3", 4, 2, {}),         # a dense first layer, shared + routed experts
], ids=lambda v: "-".join(f"{k}={x}" if isinstance(x, str) else k for k, x in v.items()) or "layout" if isinstance(v, dict) else None)
def test_expert_parallel_matches_reference(dist_pool, case, world_size, ep, options):
    """torchtitan's layout (experts Shard(0) over "ep", fully_shard over "efsdp", dense blocks
    over every rank; tests/ep_cases.py) against single-process torch.optim.Muon per expert."""
    out = dist_pool.run(world_size, "tests.ep_cases:train", dict(ep=ep, case=case, **options),
                        timeout_s=120, fresh=True)
    ref, ref_losses = cases.reference(case, world_size, STEPS)
    worst = compare(out[0]["params"], ref, FP32_ATOL)
    replicas = options.get("replicas", 1)
    print(f"{case} ep={ep} x efsdp={world_size // ep // replicas} x replicas={replicas} on {world_size} ranks "
          f"{options}: max |diff| {worst:.3g}")
    np.testing.assert_allclose(np.mean([o["losses"] for o in out], axis=0), ref_losses, rtol=1e-5)
    assert len({o["digest"] for o in out}) == 1
    norm = ep_cases.reference_grad_norm(case, world_size)  # dmuon.clip_grad_norm_ counts each expert once
    assert all(abs(o["grad_norm0"] - norm) <= 1e-5 * norm for o in out), ([o["grad_norm0"] for o in out], norm)
    # each expert's Newton-Schulz runs once, on one rank of the group holding it
    model = cases.build(case)
    expected = {n: p.shape[0] for n, p in model.named_parameters() if p.ndim == 3}  # every stack
    owned = [m for o in out[: world_size // replicas] for m in o["owned_experts"]]  # replica 0
    assert sorted(owned) == sorted({m for m in owned}), "an expert is owned twice"
    stacks = {fqn for fqn, _ in owned}
    assert stacks == set(expected) and all(
        sorted(e for f, e in owned if f == fqn) == list(range(expected[fqn])) for fqn in stacks)
    if options.get("overlap", "off") != "off":  # the updates did run behind the next forward
        assert all(o["scheduled"] > 0 for o in out if o["owned_experts"]), [o["scheduled"] for o in out]
    if case == "ep-moe-2":  # the case is exercised: FSDP2 left some ranks an empty expert shard
        assert any(0 in o["shard_rows"] for o in out), [o["shard_rows"] for o in out]


@pytest.mark.parametrize("through_dcp", [False, True], ids=["in-memory", "dcp"])
def test_expert_parallel_checkpoint_roundtrip(dist_pool, tmp_path, through_dcp):
    """dmuon.state_dict / load_state_dict under expert parallelism, in memory and through
    ``dcp.save`` / ``dcp.load``: bitwise resume, and each expert is named by its global index,
    so no two expert groups offer one key (DCP would write only one of them)."""
    kwargs = dict(ep=2, path=str(tmp_path / "ckpt") if through_dcp else None)
    out = dist_pool.run(4, "tests.ep_cases:checkpoint_roundtrip", kwargs, timeout_s=120, fresh=True)
    assert all(o["same"] for o in out)
    keys = [k for o in out for k in o["keys"]]
    assert len(keys) == len(set(keys)) == 4 * 4, keys  # 4 stacks x 4 experts, one key each
    assert "blocks.0.experts.w1[3]" in keys  # expert 3: the second expert group's second expert


@pytest.mark.parametrize("case,words", [
    ("indivisible", ["ValueError: dmuon: expert stack 'w1'", "(3, 6, 8)", "3 experts", "'ep' of 2 ranks",
                     "[1, 3]", "predicate=..."]),
    ("no-ep-mesh", ["ValueError: dmuon: parameter 'w1'", "(4, 6, 8)", "expert-parallel dimension ('ep',)",
                    "mesh without one", "('efsdp', 'ep')"]),
])
def test_expert_parallel_bad_layout_raises_on_every_rank(dist_pool, case, words):
    """3 experts Shard(0) over an "ep" dimension of 2 ranks, or experts on an "ep" mesh with a
    mesh without one given to dedicate_params: refused by name, on every rank."""
    out = dist_pool.run(2, "tests.ep_cases:bad_ep", dict(case=case), timeout_s=60, fresh=True)
    for msg in out:
        for word in words:
            assert word in msg, (word, msg)


def test_expert_parallel_meshes_refused_by_name():
    """TP together with "ep", or "ep" not last, are not supported: said by name."""
    from types import SimpleNamespace

    from dmuon.comm.mesh_roles import expert_parallel_dims

    def mesh(*names):
        return SimpleNamespace(mesh_dim_names=names, ndim=len(names), shape=(2,) * len(names))

    assert expert_parallel_dims(mesh("efsdp", "ep")) == (1, 0, None)
    assert expert_parallel_dims(mesh("ep")) == (0, None, None)
    assert expert_parallel_dims(mesh("replicate", "efsdp", "ep")) == (2, 1, 0)
    assert expert_parallel_dims(mesh("replicate", "shard")) is None
    for names in [("ep", "efsdp"), ("tp", "ep"), ("efsdp", "ep", "tp"), ("efsdp", "replicate", "ep")]:
        with pytest.raises(ValueError, match="TP together with expert parallelism is not supported"):
            expert_parallel_dims(mesh(*names))


def test_expert_parallel_plan_records_the_grouping():
    """An expert-parallel plan: local experts balanced within a group of world / ep ranks, the
    dense matrices over all; its JSON and digest carry the grouping, so a plan solved for one
    layout is refused on another."""
    import dataclasses

    from dmuon.owners.plan import OwnerPlan, build_plan

    shapes = [("attn.w", (16, 16)), ("moe.gate_up", (8, 8, 16)), ("moe.down", (8, 16, 4)), ("head", (4, 16))]
    ep_fqns = ["moe.gate_up", "moe.down"]
    plan = build_plan(shapes, 4, method="greedy", expert_parallel=ep_fqns, ep_size=2)
    assert plan.ep_size == 2 and plan.expert_group_size == 2
    stacks = [m for m in plan.matrices if m.ep]
    assert {m.fqn for m in stacks} == set(ep_fqns) and all(m.owner < 2 for m in stacks)
    for fqn in ep_fqns:  # each stack's 4 local experts (8 / ep), split over both group ranks
        ranges = [m.experts for m in stacks if m.fqn == fqn]
        assert ranges[0][0] == 0 and ranges[-1][1] == 4 and len({m.owner for m in stacks if m.fqn == fqn}) == 2
    assert not any(m.ep for m in plan.matrices if m.fqn not in ep_fqns)
    assert plan.makespan == max(plan.loads()) >= plan.lower_bound > 0
    again = OwnerPlan.from_dict(plan.to_dict())
    assert again == plan and again.digest() == plan.digest()
    assert dataclasses.replace(plan, ep_size=1).digest() != plan.digest()
    flat = dataclasses.replace(plan, matrices=tuple(dataclasses.replace(m, ep=False) for m in plan.matrices))
    assert flat.digest() != plan.digest()
    local = {"attn.w": (16, 16), "moe.gate_up": (4, 8, 16), "moe.down": (4, 16, 4), "head": (4, 16)}
    plan.check_matches(local, 4, ep_size=2, expert_parallel=ep_fqns)
    with pytest.raises(ValueError, match="'ep'\\) size of 2 but the mesh has 4"):
        plan.check_matches(local, 4, ep_size=4, expert_parallel=ep_fqns)
    with pytest.raises(ValueError, match="'moe.gate_up' is split over the 'ep'"):
        flat.check_matches(local, 4, ep_size=2, expert_parallel=ep_fqns)
    with pytest.raises(ValueError, match="ep_size=3"):
        build_plan(shapes, 4, expert_parallel=ep_fqns, ep_size=3)


def test_moe_inventory_plan_meets_its_bound():
    """Qwen3-30B-A3B (48 layers x 128 experts x 2 stacks + attention and routers: 12,528
    matrices) on 8 ranks: every expert placed, one range per (stack, owner), makespan at the
    bound max(total / D, largest)."""
    from dmuon.balance.inventories import inventory, matrix_count
    from dmuon.owners.plan import build_plan

    inv = inventory("qwen3-30b-a3b")
    assert matrix_count(inv) == 12528
    plan = build_plan(inv, 8, method="auto", time_limit_s=5.0, solver_report=True)
    assert sum(m.matrices for m in plan.matrices) == 12528
    assert plan.makespan <= 1.001 * plan.lower_bound, (plan.makespan, plan.lower_bound)
    stacks = [m for m in plan.matrices if m.experts is not None]
    assert len({(m.fqn, m.owner) for m in stacks}) == len(stacks)  # one range per (stack, owner)


def test_modulelist_experts_with_gradient_accumulation(dist_pool):
    """``dmuon.no_sync`` micro-batches: an expert that gets tokens only in a no_sync
    micro-batch on a rank still contributes that rank's accumulated gradient (the per-sample
    loss is a mean over the batch's samples, so two halves / 2 equal one batch)."""
    out = dist_pool.run(2, "tests.moe_cases:train", dict(case="list-moe", steps=STEPS, micro_batches=2),
                        timeout_s=120)
    ref, ref_losses = cases.reference("list-moe", 2, STEPS)
    worst = compare(out[0]["params"], ref, FP32_ATOL)
    print(f"list-moe fsdp, 2 micro-batches on 2 ranks: max |diff| {worst:.3g}")
    np.testing.assert_allclose(np.mean([o["losses"] for o in out], axis=0), ref_losses, rtol=1e-5)


def test_checkpoint_roundtrip_with_expert_ranges(dist_pool):
    """dmuon.state_dict / load_state_dict with every stack split into ranges: bitwise resume."""
    assert dist_pool.run(2, "tests.moe_cases:checkpoint_roundtrip", {}, timeout_s=120) == [True, True]


def test_shard_experts_refuses_bad_input_by_name():
    """dmuon.integrations.hf_moe.shard_experts: a module that is not a transformers 5 experts
    module, a mesh that is not 1-D, or an "ep" size not dividing the experts is refused with
    the values and the fix, before any parameter is touched."""
    from types import SimpleNamespace

    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from dmuon.integrations.hf_moe import shard_experts

    experts = MixtralExperts(MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=3))
    torch.manual_seed(0)
    for p in experts.parameters():  # transformers may leave them uninitialised (NaN != NaN)
        torch.nn.init.normal_(p)
    before = {n: p.clone() for n, p in experts.named_parameters()}

    def mesh(*shape):
        return SimpleNamespace(ndim=len(shape), shape=shape, size=lambda: shape[0])

    with pytest.raises(ValueError, match=r"dmuon: MixtralExperts has 3 experts, which the "
                                         r"expert-parallel mesh of 2 ranks does not divide.*\[1, 3\]"):
        shard_experts(experts, mesh(2))
    with pytest.raises(ValueError, match=r"1-D expert-parallel mesh.*\(2, 2\)"):
        shard_experts(experts, mesh(2, 2))
    with pytest.raises(ValueError, match="Linear has no gate_up_proj, down_proj, act_fn, num_experts"):
        shard_experts(nn.Linear(4, 4), mesh(1))
    for n, p in experts.named_parameters():
        assert torch.equal(p, before[n]) and not hasattr(p, "to_local"), n
