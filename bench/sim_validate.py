"""Validation of the step model of :mod:`sim_model` against a measured CPU ``bench_step.py`` run.

Calibrated from the run (inputs, not predictions):

* gloo collectives: ``a + b n`` fits of the measured broadcast / reduce / all-gather times
  (:class:`sim_model.FittedComm`); reduce-scatter is taken equal to all-gather;
* Newton-Schulz: seconds per distinct shape, measured with every rank computing at once;
* forward / backward compute: AdamW's measured forward / backward minus its modeled FSDP2
  communication (one fp32 all-gather per unit in forward, all-gather + reduce-scatter in
  backward; the units are the ``fully_shard`` blocks and the root);
* optimizer bookkeeping: AdamW's measured step divided by its parameter-tensor count gives a
  per-tensor cost, charged to every tensor an optimizer touches;
* overlap 0: four ranks on two cores leave no idle core for gloo's threads, so communication
  adds to compute.

Predicted (and compared with the measurement): the optimizer step and the whole step of
vanilla Muon and dmuon, with the collectives the measured build issued (``dmuon_collectives`` in
the run): one broadcast per (block, owner) in forward and again in backward, and per block one
reduce per owner of its gradient bucket (the default) or one all-reduce
(``reduce_mode="all_reduce"``); the owner plan's NS makespan in the step. Runs made before the buckets (no
``dmuon_collectives``) are modelled as that build: one broadcast and one reduce per matrix.
"""

from __future__ import annotations

import logging

from sim_model import FittedComm, StepInputs, step_times

logger = logging.getLogger(__name__)


def _units(model_config: dict, dedicated: set[str]) -> list[dict]:
    """Per FSDP2 unit (root first, then blocks in forward order): element and tensor counts."""
    from dmuon.train.model import Pi0Policy, PolicyConfig

    model = Pi0Policy(PolicyConfig(**model_config))
    block_names = {id(b): None for b in model.shardable_blocks()}
    for name, mod in model.named_modules():
        if id(mod) in block_names:
            block_names[id(mod)] = name
    prefixes = [block_names[id(b)] + "." for b in model.shardable_blocks()]
    units = [{"name": "<root>", "matrices": [], "other_n": 0, "other_tensors": 0}]
    units += [{"name": p[:-1], "matrices": [], "other_n": 0, "other_tensors": 0} for p in prefixes]
    for fqn, param in model.named_parameters():
        idx = next((i + 1 for i, p in enumerate(prefixes) if fqn.startswith(p)), 0)
        if fqn in dedicated:
            units[idx]["matrices"].append(fqn)
        else:
            units[idx]["other_n"] += param.numel()
            units[idx]["other_tensors"] += 1
    return units


def _dmuon_comm(collectives: dict | None, units: list[dict], mats: dict, numel: dict,
                comm: FittedComm) -> tuple[list[float], list[float]]:
    """Per unit: seconds of dmuon's publication (one pass) and of its gradient reduction."""
    publish, reduce = [], []
    for u in units:
        by_owner: dict[int, int] = {}
        for f in u["matrices"]:
            by_owner[mats[f]["owner"]] = by_owner.get(mats[f]["owner"], 0) + numel[f]
        total = sum(by_owner.values())
        if collectives is None:  # the first build: one collective per matrix
            publish.append(sum(comm.broadcast(4 * numel[f]) for f in u["matrices"]))
            reduce.append(sum(comm.reduce(4 * numel[f]) for f in u["matrices"]))
            continue
        publish.append(sum(comm.broadcast(4 * n) for n in by_owner.values()))
        if collectives["reduce_mode"] == "all_reduce":
            reduce.append(comm.all_reduce(4 * total) if total else 0.0)
        else:
            reduce.append(sum(comm.reduce(4 * n) for n in by_owner.values()))
    return publish, reduce


def validate(run: dict) -> dict:
    """Predicts the vanilla and dmuon times of ``run`` (a bench_step JSON) from its calibration.

    Returns:
        ``{"calibrated": ..., "predicted_ms": ..., "measured_ms": ..., "error": ..., "table": str}``
        where ``error`` is ``predicted / measured - 1`` per quantity.

    Raises:
        ValueError: If the run has no calibration (it was made with ``--no-calibrate``).
    """
    cal = run.get("calibration")
    if not cal:
        raise ValueError("sim_validate: the bench_step JSON has no 'calibration'; rerun it without --no-calibrate.")
    p = run["world_size"]
    comm = FittedComm(cal["comm_s"], p)
    ns_by_shape = {tuple(e["shape"]): e["s"] for e in cal["ns_s"]}
    mats = {m["fqn"]: m for m in run["dedicated_matrices"]}
    units = _units(run["model_config"], set(mats))
    numel = {f: m["shape"][0] * m["shape"][1] for f, m in mats.items()}
    med = {v: {k: s["median_s"] for k, s in run["variants"][v].items() if isinstance(s, dict)}
           for v in run["variants"]}

    unit_n = [u["other_n"] + sum(numel[f] for f in u["matrices"]) for u in units]
    fsdp_f = tuple(comm.all_gather(4 * n) for n in unit_n)
    fsdp_b = tuple(comm.all_gather(4 * n) + comm.reduce_scatter(4 * n) for n in reversed(unit_n))
    fwd = max(0.1 * med["adamw"]["forward"], med["adamw"]["forward"] - sum(fsdp_f))
    bwd = max(0.1 * med["adamw"]["backward"], med["adamw"]["backward"] - sum(fsdp_b))
    n_tensors = sum(u["other_tensors"] + len(u["matrices"]) for u in units)
    per_tensor = med["adamw"]["step"] / n_tensors
    other_tensors = n_tensors - len(mats)

    van_opt = (sum(comm.all_gather(4 * n) for n in numel.values())
               + sum(ns_by_shape[tuple(m["shape"])] for m in mats.values()) + per_tensor * n_tensors)
    loads = [0.0] * p
    owned = [0] * p
    for m in mats.values():
        loads[m["owner"]] += ns_by_shape[tuple(m["shape"])]
        owned[m["owner"]] += 1
    dm_opt = max(loads) + per_tensor * (other_tensors + max(owned))
    publish, reduce = _dmuon_comm(run.get("dmuon_collectives"), units, mats, numel, comm)
    dm_f = [publish[i] + (comm.all_gather(4 * u["other_n"]) if u["other_n"] else 0.0)
            for i, u in enumerate(units)]
    dm_b = [publish[i] + reduce[i]
            + (comm.all_gather(4 * u["other_n"]) + comm.reduce_scatter(4 * u["other_n"]) if u["other_n"] else 0.0)
            for i, u in enumerate(units)]
    pred = {
        "adamw": step_times(StepInputs(forward_s=fwd, backward_s=bwd, comm_forward=fsdp_f,
                                       comm_backward=fsdp_b, optimizer_s=med["adamw"]["step"], overlap=0.0)),
        "vanilla": step_times(StepInputs(forward_s=fwd, backward_s=bwd, comm_forward=fsdp_f,
                                         comm_backward=fsdp_b, optimizer_s=van_opt, overlap=0.0)),
        "dmuon": step_times(StepInputs(forward_s=fwd, backward_s=bwd, comm_forward=tuple(dm_f),
                                       comm_backward=tuple(reversed(dm_b)), optimizer_s=dm_opt, overlap=0.0)),
    }
    predicted = {f"{v}_{k}": pred[v][key] * 1e3 for v in ("vanilla", "dmuon")
                 for k, key in (("step", "optimizer"), ("total", "total"))}
    measured = {f"{v}_{k}": med[v][k] * 1e3 for v in ("vanilla", "dmuon") for k in ("step", "total")}
    predicted["dmuon_total_over_adamw_total"] = pred["dmuon"]["total"] / pred["adamw"]["total"]
    measured["dmuon_total_over_adamw_total"] = med["dmuon"]["total"] / med["adamw"]["total"]
    predicted["dmuon_step_over_vanilla_step"] = dm_opt / van_opt
    measured["dmuon_step_over_vanilla_step"] = med["dmuon"]["step"] / med["vanilla"]["step"]
    error = {k: predicted[k] / measured[k] - 1.0 for k in predicted}
    lines = [f"CPU validation ({p} gloo ranks; calibrated: gloo fits, NS per shape, AdamW fwd/bwd/step):",
             f"{'quantity':32s} {'predicted':>10s} {'measured':>10s} {'error':>8s}"]
    for k in predicted:
        unit = "" if "over" in k else " ms"
        lines.append(f"{k + unit:32s} {predicted[k]:10.3f} {measured[k]:10.3f} {error[k]:+8.1%}")
    return {
        "run": {"world_size": p, "model": run["model"], "device": run["device"]},
        "calibrated": {"gloo_fit_a_s_b_s_per_byte": comm.fit, "forward_compute_s": fwd,
                       "backward_compute_s": bwd, "optimizer_s_per_tensor": per_tensor,
                       "ns_makespan_s": max(loads), "ns_total_s": sum(ns_by_shape[tuple(m["shape"])] for m in mats.values()),
                       "overlap": 0.0},
        "predicted_ms": predicted, "measured_ms": measured, "error": error,
        "max_abs_error": max(abs(e) for e in error.values()),
        "table": "\n".join(lines),
    }
