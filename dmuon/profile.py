"""``python -m dmuon.profile``: profile Newton-Schulz costs, solve owners, write the plan.

Example::

    python -m dmuon.profile --model qwen2.5-7b --nodes 4 --gpus-per-node 8 \\
        --memory-cap-gb 20 --out plan.json

``--model`` is a named inventory (:mod:`dmuon.balance.inventories`) or ``MODULE:FACTORY``, a
zero-argument callable returning an ``nn.Module``, built on the meta device. On a GPU the NS
times are measured (:mod:`dmuon.balance.profiler`), else the FLOP model stands in. The plan JSON
(:class:`dmuon.owners.plan.OwnerPlan`) is what ``dedicate_params(model, mesh, plan=...)`` loads;
owners are global ranks in the XOR layout (:mod:`dmuon.balance.layout`). A per-rank table goes
to stdout, a bar chart to ``<out>.png`` (with ``dmuon[plot]``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from dmuon.balance.inventories import INVENTORIES, inventory, layer_groups
from dmuon.balance.profiler import DEFAULT_CACHE, profile_costs

#: ``--objective``'s choices (:func:`build_owner_plan`).
OBJECTIVES = ("makespan", "exposed", "overlap")


def model_inventory(spec: str) -> list[tuple[str, tuple[int, int]]]:
    """Named inventory, or the matrices ``dedicate_params`` selects in ``MODULE:FACTORY``'s model.

    Raises:
        ValueError: when ``spec`` is neither a known name nor ``MODULE:FACTORY``, or the model
            has no dedicated matrix.
    """
    if spec in INVENTORIES:
        return inventory(spec)
    if ":" not in spec:
        raise ValueError(
            f"dmuon: --model {spec!r} is neither a known inventory {sorted(INVENTORIES)} nor "
            f"MODULE:FACTORY (e.g. mypkg.models:build_model)"
        )
    import torch

    from dmuon.hooks.dedicate import default_predicate, select_matrices

    mod_name, _, factory_name = spec.partition(":")
    factory = getattr(importlib.import_module(mod_name), factory_name, None)
    if not callable(factory):
        raise ValueError(f"dmuon: --model {spec!r}: {mod_name} has no callable {factory_name!r}")
    with torch.device("meta"):
        model = factory()
    out = [(sel.fqn, sel.shape) for sel in select_matrices(model, default_predicate(model))]
    if not out:
        raise ValueError(f"dmuon: --model {spec!r} has no 2-D non-embedding parameter or expert "
                         f"stack to dedicate")
    return out


def rank_table(plan, memory_by_rank: Sequence[float], nodes: int, gpus_per_node: int) -> str:
    """Plain aligned text: one row per rank with node, GPU, load, memory (GiB) and matrices."""
    loads = plan.loads()
    counts = [0] * plan.world_size
    for m in plan.matrices:
        # an expert range counts its experts; an expert-parallel one, on every "ep" coordinate
        for r in ([m.owner * plan.ep_size + c for c in range(plan.ep_size)] if m.ep else [m.owner]):
            counts[r] += m.matrices
    unit = plan.cost_unit
    scale, label = (1e12, "TFLOP") if unit == "flops" else (1.0, "ms")
    rows = [("rank", "node", "gpu", f"load [{label}]", "load/mean", "memory [GiB]", "matrices")]
    mean = sum(loads) / len(loads) if loads else 0.0
    for r in range(plan.world_size):
        rows.append((str(r), str(r // gpus_per_node), str(r % gpus_per_node),
                     f"{loads[r] / scale:.3f}", f"{loads[r] / mean:.3f}" if mean else "-",
                     f"{memory_by_rank[r] / 2 ** 30:.3f}", str(counts[r])))
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.extend(solver_summary(plan))
    return "\n".join(lines)


def solver_summary(plan) -> list[str]:
    """Summary lines of a plan built with ``solver_report=True``: makespan, bounds, proven gap,
    method, MILP status and the exposed time where recorded."""
    unit = plan.cost_unit
    scale, label = (1e12, "TFLOP") if unit == "flops" else (1.0, "ms")
    extra = plan.extra
    ratio = plan.makespan / plan.lower_bound if plan.lower_bound else 1.0
    proven = extra["proven_bound"]
    gap = 0.0 if extra["optimal"] or not proven else plan.makespan / proven - 1.0
    status = extra["milp_status"]
    what = ("greedy fallback after the MILP " + status if status.startswith("failed")
            else "MILP: CBC's best plan at its time limit, not proven optimal"
            if status.startswith("time limit") else f"MILP {status}")
    return [
        f"makespan {plan.makespan / scale:.4f} {label} = {ratio:.4f} x lower bound "
        f"{plan.lower_bound / scale:.4f} (proven bound {proven / scale:.4f}: gap "
        f"{100 * gap:.3f}%{', optimal' if extra['optimal'] else ''})",
        f"plan by {plan.method}/{extra['detail']} ({what}), solved in {extra['solve_s']:.2f} s",
    ] + ([] if "exposed" not in extra else [
        f"exposed {extra['exposed'] / scale:.4f} {label} of NS under overlap with the next forward "
        f"(bound {extra['exposed_bound'] / scale:.4f}; forward {extra['forward_total'] / scale:.4f} "
        f"{label} over {extra['units']} units, {extra['forward_source']}; objective "
        f"{extra.get('objective', 'makespan')})"])


def plot_loads(plan, path: str) -> None:
    """Bar chart of per-rank load with the makespan and lower bound lines (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = plan.loads()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.12 * len(loads)), 3.5))
    ax.bar(range(len(loads)), loads, color="tab:blue", width=0.9)
    ax.axhline(plan.makespan, color="tab:red", lw=1, label="makespan")
    ax.axhline(plan.lower_bound, color="k", ls="--", lw=1, label="lower bound max(total/D, largest)")
    ax.set_xlabel("rank")
    ax.set_ylabel(f"Newton-Schulz load [{plan.cost_unit}]")
    ax.set_title(f"dmuon owner plan: {sum(m.matrices for m in plan.matrices)} matrices on "
                 f"{plan.world_size} ranks")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_owner_plan(named_shapes, nodes: int, gpus_per_node: int, *, memory_cap_bytes=None,
                     measure: bool = False, device="cpu", method: str = "auto",
                     time_limit_s: float = 10.0, cache_path=DEFAULT_CACHE, progress: bool = True,
                     group_cost: float = 0.0, ep: int = 1, objective: str = "makespan",
                     tokens: int = 4096):
    """Profile Newton-Schulz costs, then :func:`dmuon.owners.plan.build_plan` (in the XOR layout
    unless ``group_cost > 0``, ``ep > 1`` or another ``objective``); ``(OwnerPlan, per-rank
    memory bytes)``. With ``ep == 1``, ``extra`` records the plan's exposed time and its bound.

    Raises:
        ValueError: from :func:`dmuon.balance.solve` (e.g. an infeasible memory cap).
    """
    import dataclasses

    from dmuon.balance import deadline as dl
    from dmuon.balance.profiler import unit_times
    from dmuon.owners.plan import build_plan
    from dmuon.owners.stacks import param_layout

    if objective not in OBJECTIVES:
        raise ValueError(f"dmuon: objective={objective!r} is not one of {OBJECTIVES}")

    layouts = [param_layout(fqn, s) for fqn, s in named_shapes]  # a stack: its experts' matrices
    matrix_costs, overhead, unit = profile_costs([lay.matrix_shape for lay in layouts],
                                                 measure=measure, device=device,
                                                 cache_path=cache_path, progress=progress)
    costs = [c * lay.count for c, lay in zip(matrix_costs, layouts)]  # per parameter
    stacks = [fqn for (fqn, _), lay in zip(named_shapes, layouts) if lay.is_stack] if ep > 1 else []
    groups = layer_groups([f for f, _ in named_shapes])
    unit_shapes = [[] for _ in range(max(groups, default=-1) + 1)]
    for g, lay in zip(groups, layouts):
        unit_shapes[g].append(lay.matrix_shape)
    forward, _, _ = unit_times(unit_shapes, tokens=tokens, measure=measure, device=device,
                               cache_path=cache_path)  # in ``unit`` too: both follow ``measure``
    deadlines = dl.deadlines_from_forward(forward)
    plan = build_plan(named_shapes, nodes * gpus_per_node, costs=costs, cost_unit=unit,
                      method=method, time_limit_s=time_limit_s,
                      groups=groups, group_cost=group_cost,
                      layout=None if ep > 1 else (nodes, gpus_per_node),
                      memory_cap_bytes=memory_cap_bytes,
                      batch_overhead=overhead, solver_report=True,
                      deadlines=deadlines if objective != "makespan" else None,
                      makespan_slack=dl.MAKESPAN_SLACK if objective == "overlap" else None,
                      **({"expert_parallel": stacks, "ep_size": ep} if ep > 1 else {}))
    if ep == 1:  # the exposed time of whichever plan, in the deadline model's own terms
        unit_of = dict(zip((f for f, _ in named_shapes), groups))
        specs = plan.matrices
        marginal = [m.cost - float(overhead.get(m.shape, 0.0)) for m in specs]
        kw = dict(classes=[m.shape for m in specs], batch_overhead=overhead or None)
        units = [unit_of[m.fqn] for m in specs]
        extra = {**plan.extra, "exposed": dl.measure([m.owner for m in specs], marginal, units,
                                                     deadlines, plan.world_size, **kw)[0],
                 "exposed_bound": dl.exposed_lower_bound(marginal, units, deadlines,
                                                         plan.world_size, **kw),
                 "forward_total": float(sum(forward)), "units": len(forward),
                 "forward_source": (f"timed matmuls of {tokens} tokens" if measure else
                                    f"FLOP model 2 x {tokens} tokens x rows x cols")}
        plan = dataclasses.replace(plan, extra=extra)
    return plan, list(plan.extra["memory_by_rank"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dmuon.profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True,
                   help=f"one of {sorted(INVENTORIES)} or MODULE:FACTORY")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--memory-cap-gb", type=float, default=None, help="GiB per rank")
    p.add_argument("--out", default="plan.json")
    p.add_argument("--method", choices=("auto", "milp", "heuristic", "greedy"), default="auto")
    p.add_argument("--time-limit-s", type=float, default=10.0)
    p.add_argument("--measure", choices=("auto", "yes", "no"), default="auto",
                   help="time NS on the device (auto: only on CUDA) instead of the FLOP model")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--cache", default=DEFAULT_CACHE, help="profile cache JSON")
    p.add_argument("--group-cost", default="0",
                   help="step time of one more (layer, owner) publication in the profile's unit "
                        "(FLOPs or ms), or 'auto' (0 on CUDA/NCCL, ~2.5 ms on CPU/gloo); 0 keeps "
                        "the XOR layout")
    p.add_argument("--ep", type=int, default=1,
                   help="expert stacks Shard(0) over this many ranks (an (efsdp, ep) mesh; it "
                        "must divide the ranks and the experts)")
    p.add_argument("--objective", choices=OBJECTIVES, default="makespan",
                   help="makespan: NS after backward (default); exposed: the NS the next "
                        "forward waits for; overlap: what dedicate_params solves without a plan "
                        "file, the least exposed NS within 2%% of the makespan plan's makespan")
    p.add_argument("--tokens", type=int, default=4096,
                   help="tokens per GPU per micro-batch through each matrix, for the forward "
                        "times (default 4096)")
    p.add_argument("--no-plot", action="store_true",
                   help="skip the per-rank load chart <out>.png (it needs matplotlib: dmuon[plot])")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 1:
        p.error(f"--nodes and --gpus-per-node must be >= 1, got {args.nodes}, {args.gpus_per_node}")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    measure = args.measure == "yes" or (args.measure == "auto" and device.startswith("cuda"))
    cap = None if args.memory_cap_gb is None else args.memory_cap_gb * 2 ** 30
    if args.group_cost == "auto":
        from dmuon.balance.cost import default_group_cost

        group_cost = default_group_cost("nccl" if device.startswith("cuda") else "gloo",
                                        "ms" if measure else "flops")
    else:
        try:
            group_cost = float(args.group_cost)
        except ValueError:
            p.error(f"--group-cost must be a number >= 0 or 'auto', got {args.group_cost!r}")
    try:
        named = model_inventory(args.model)
        plan, mem = build_owner_plan(named, args.nodes, args.gpus_per_node, memory_cap_bytes=cap,
                                     measure=measure, device=device, method=args.method,
                                     time_limit_s=args.time_limit_s, cache_path=args.cache,
                                     group_cost=group_cost, ep=args.ep,
                                     objective=args.objective, tokens=args.tokens)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(rank_table(plan, mem, args.nodes, args.gpus_per_node))
    plan.save(args.out)
    print(f"plan written to {args.out} (digest {plan.digest()[:16]})")
    if not args.no_plot:
        png = os.path.splitext(args.out)[0] + ".png"
        try:
            plot_loads(plan, png)
            print(f"per-rank load chart written to {png}")
        except ImportError:  # the chart is an extra: a plain install still gets its plan
            print(f"no per-rank load chart: matplotlib is not installed "
                  f"(pip install 'dmuon[plot]' for {png}, or pass --no-plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
