"""Owner-plan solvers against the MILP on the shipped inventories (issue 47: one balancer).

For each model (``pi0``, ``qwen2.5-7b``, the main job's ``dmuon.train`` policy) and rank count
(8 to 256), solve the owner plan three ways with :func:`dmuon.balance.solve` on the Gram
Newton-Schulz FLOP model:

* ``lpt``: longest processing time first alone (``method="greedy"``; for the exposed time
  the same as ``heuristic``);
* ``heuristic``: LPT/MULTIFIT + move/swap local search (makespan), the deadline greedy + local
  search (exposed time) (``method="heuristic"``);
* ``milp``: CBC warm-started from the heuristic (``method="milp"``, ``--time-limit-s``).

and record each plan's makespan, exposed time (deadlines from the FLOP model's forward at
``--tokens`` tokens per rank, units = the usual FSDP2 blocks) and solve seconds. The makespan
column is the makespan objective's plan, the exposed column the exposed-time objective's.

    python bench/bench_solvers.py --out bench/results/solvers_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time


def main_job_inventory():
    """The dedicated matrices of ``python -m dmuon.train``'s default policy (built on meta)."""
    import torch

    from dmuon.hooks.dedicate import default_predicate, select_matrices
    from dmuon.train.model import Pi0Policy, PolicyConfig

    with torch.device("meta"):
        model = Pi0Policy(PolicyConfig())
    return [(s.fqn, s.shape) for s in select_matrices(model, default_predicate(model))]


def instance(name, tokens):
    from dmuon.balance.deadline import deadlines_from_forward
    from dmuon.balance.inventories import inventory, layer_groups
    from dmuon.balance.profiler import unit_times
    from dmuon.kernels import ns_flops

    inv = main_job_inventory() if name == "main-job" else inventory(name)
    shapes = [tuple(int(x) for x in s[-2:]) for _, s in inv]
    costs = [float(ns_flops(*s, method="gram")) for s in shapes]
    units = layer_groups([f for f, _ in inv])
    per_unit = [[] for _ in range(max(units) + 1)]
    for s, u in zip(shapes, units):
        per_unit[u].append(s)
    forward, _, _ = unit_times(per_unit, tokens=tokens, measure=False)
    return costs, shapes, units, deadlines_from_forward(forward)


def run(name, ranks, tokens, time_limit_s):
    from dmuon.balance import solve

    costs, shapes, units, deadlines = instance(name, tokens)
    row = {"inventory": name, "ranks": ranks, "matrices": len(costs)}
    for method in ("lpt", "heuristic", "milp"):
        m = "greedy" if method == "lpt" else method
        t0 = time.perf_counter()
        mk = solve(costs, ranks, classes=shapes, method=m, time_limit_s=time_limit_s)
        mk_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ex = solve(costs, ranks, classes=shapes, units=units, deadlines=deadlines, method=m,
                   time_limit_s=time_limit_s)
        ex_s = time.perf_counter() - t0
        row[method] = {"makespan": mk.makespan, "makespan_s": mk_s, "makespan_status": mk.milp_status,
                       "exposed": ex.exposed, "exposed_s": ex_s, "exposed_status": ex.milp_status,
                       "makespan_bound": mk.proven_bound, "exposed_bound": ex.exposed_bound}
    for method in ("lpt", "heuristic"):
        for key in ("makespan", "exposed"):
            ref = row["milp"][key]
            row[method][f"{key}_vs_milp"] = row[method][key] / ref - 1.0 if ref else 0.0
    print(json.dumps(row), flush=True)
    return row


def table(path):
    """The docs/performance.md table of a results file (markdown, TFLOP/GFLOP)."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    print("| model | ranks | makespan LPT / heuristic / MILP [TFLOP] | MILP status | exposed "
          "heuristic / MILP [TFLOP] | MILP status | heuristic vs MILP (makespan, exposed) | "
          "solve s heuristic / MILP |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        lpt, h, m = r["lpt"], r["heuristic"], r["milp"]
        status = [m[k].replace("the heuristic plan ", "").split(":")[0][:24]
                  for k in ("makespan_status", "exposed_status")]
        print(f"| {r['inventory']} | {r['ranks']} | {lpt['makespan'] / 1e12:.4g} / "
              f"{h['makespan'] / 1e12:.4g} / {m['makespan'] / 1e12:.4g} | {status[0]} | "
              f"{h['exposed'] / 1e12:.4g} / {m['exposed'] / 1e12:.4g} | {status[1]} | "
              f"{100 * h['makespan_vs_milp']:+.2f}%, {100 * h['exposed_vs_milp']:+.2f}% | "
              f"{h['makespan_s'] + h['exposed_s']:.2f} / {m['makespan_s'] + m['exposed_s']:.1f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["pi0", "qwen2.5-7b", "main-job"])
    p.add_argument("--ranks", nargs="+", type=int, default=[8, 16, 32, 64, 128, 256])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--time-limit-s", type=float, default=10.0)
    p.add_argument("--out", default="bench/results/solvers_cpu.json")
    p.add_argument("--table", action="store_true", help="print the markdown table of --out")
    args = p.parse_args()
    if args.table:
        return table(args.out)
    import pulp

    rows = [run(name, ranks, args.tokens, args.time_limit_s)
            for name in args.models for ranks in args.ranks]
    meta = {"tokens": args.tokens, "time_limit_s": args.time_limit_s, "cost": "Gram NS FLOPs",
            "pulp": pulp.__version__, "machine": platform.machine(),
            "date": time.strftime("%Y-%m-%d")}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
