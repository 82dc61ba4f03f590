"""Cases run in a process of their own on torch's fake process group (see tests/test_fake_pg.py).

One process plays rank 0 of an 8-rank job: ``init_process_group("fake")`` over a ``FakeStore``;
every collective returns at once and moves no data. Printed as one JSON line.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def rank0_of_8() -> dict:
    """FSDP2 + dmuon on rank 0 of 8, unpatched: what was created, who owns what, which hooks ran."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dmuon
    from dmuon.hooks.dedicate import get_state, select_matrices, default_predicate
    from dmuon.hooks.default_plan import DEFAULT_FORWARD_TOKENS, default_plan
    from tests.dist_cases import count_ns
    from tests.failure_cases import count_step_checks
    from tests.models import Net, loss_fn, local_batch

    torch.set_flush_denormal(True)  # buffers the fake collectives never fill
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    mesh = init_device_mesh("cpu", (8,))
    torch.manual_seed(0)
    model = Net()
    # more matrices than ranks, so that rank 0 owns some and not all
    model.blocks.extend(type(model.blocks[0])(12, 7 + k) for k in range(6))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # the plan dedicate_params solves in process (its defaults; group cost 0 off gloo)
    expected = default_plan(model, select_matrices(model, default_predicate(model)), 8, tp_size=1,
                            blocks={}, expert_parallel=[], ep_size=1, group_cost=0.0,
                            forward_tokens=DEFAULT_FORWARD_TOKENS)
    plan = dmuon.dedicate_params(model, mesh)  # step_check=True: switched off, not failing
    opt = dmuon.Muon(model, lr=0.02)
    ns = count_ns(opt)
    state = get_state(model)
    idx, y = local_batch(0, 0, 8)
    losses, calls = [], {}
    with count_step_checks() as step_checks:
        for step in range(3):
            if step == 2:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    loss = loss_fn(model, idx, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                for evt in prof.events():
                    if evt.name.startswith("dmuon::"):
                        calls[evt.name] = calls.get(evt.name, 0) + 1
            else:
                loss = loss_fn(model, idx, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(float(loss))
    from torch.distributed.distributed_c10d import _world

    out = {
        "backends": sorted({str(dist.get_backend(pg)) for pg in _world.pg_map}),
        "steps_group": state.roles.steps is not None,
        "step_checks": step_checks[0],
        "offline": list(state.offline),
        "owned": sorted(r.fqn for r in state.records if r.is_owner),
        "expected_owned": sorted(f for f, o in expected.owner_by_fqn.items() if o == 0),
        "plan_equal": plan.owner_by_fqn == expected.owner_by_fqn,
        "matrices": len(state.records),
        "units": len(state.units),
        "ns_matrices": ns["n"],
        "calls": calls,
        "steps_done": state.step_check.steps,
    }
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]]()))
