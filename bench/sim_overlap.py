"""Newton-Schulz overlapped with the next forward (issue 39), for ``bench/simulate.py``.

After the step, every owner runs the NS of its matrices in forward (unit) order on a side
stream, and the publication of unit ``k`` waits only for the NS of unit ``k``. The owner plan is
the deadline-aware one (:func:`dmuon.balance.solve` with ``deadlines``): unit ``k``'s deadline is
the start of its forward. What the step pays for NS is then

* the **exposed** time ``E = max_k (P_k - d_k)^+`` (``P_k``: when the last owner of unit ``k``
  finishes its NS; ``d_k``: the sum of the forward times of the units before ``k``), which is
  exactly the delay of the forward when publication ``k`` gates forward ``k`` and forward
  ``k+1`` waits for forward ``k`` (:mod:`dmuon.balance.deadline`); it is added to the
  forward's exposed communication, an upper bound of the two delays' interaction (a late
  publication cannot delay the broadcasts behind it by more than its own lateness);
* **contention** (assumed, :data:`NS_OVERLAP_RATE`): NS on the side stream gets only the
  tensor-core time the forward leaves, so while a forward runs it progresses at ``rate`` of its
  speed alone, and at full speed while the forward stalls for a publication; the forward is
  assumed not slowed. :func:`overlap_delay` replays exactly that (stalls are global: every rank
  waits for publication ``k``), and the plan is made for NS seconds divided by ``rate`` (as if
  all NS ran beside the forward: conservative). Rows also give the ratio at rates 1.0 (NS free
  beside the forward; the replay then equals ``E``) and 0.3 (half the assumed share).

Per-unit forward times come from FLOPs at the cluster's ``mfu_fb``: ``2 T n_u`` per unit with
``n_u`` its matrix parameters and ``T`` the tokens through it (Pi0: image tokens in the SigLIP
tower, image + text in the PaliGemma LM, the 51 action/state tokens in the action expert;
Qwen2.5-7B: all tokens, plus causal attention ``4 d s T`` per layer); what the workload's
forward FLOPs hold beyond the units (Qwen's head) runs after the last unit and sets no deadline.
"""

from __future__ import annotations

from dmuon.balance import solve
from dmuon.balance.deadline import deadlines_from_forward

#: NS speed on the side stream relative to alone (assumed): a lone large GEMM reaches ~70% of
#: the tensor-core peak, the forward uses 40% (``mfu_fb``), NS alone 50% (``mfu_ns``), so NS
#: beside the forward gets (0.7 - 0.4) / 0.5 = 0.6 of its own speed. Not measured.
NS_OVERLAP_RATE = 0.6

#: Rates of the sensitivity columns.
SENSITIVITY_RATES = (1.0, 0.3)


def unit_forward_flops(work_name: str, inv, units_of, *, pi0_batch: int = 32,
                       tokens: int = 16384) -> list[float]:
    """Forward FLOPs per unit (forward order) on one GPU per micro-batch (module docstring)."""
    n_units = max(units_of) + 1
    flops = [0.0] * n_units
    for (fqn, (r, c)), u in zip(inv, units_of):
        if work_name == "pi0":
            img, text, suffix = 3 * 256, 48, 51
            t = pi0_batch * (img if fqn.startswith(("paligemma.vision_tower", "paligemma.multi_modal"))
                             else img + text if fqn.startswith("paligemma.language_model")
                             else suffix)
        else:
            t = tokens
        flops[u] += 2.0 * t * r * c
    if work_name == "qwen2.5-7b":  # causal attention scores and values, per layer
        flops = [f + 4.0 * 3584 * 4096 * tokens for f in flops]
    return flops


def overlap_delay(owners, ns_s, shapes, units_of, forward_s, p, *, ns_call_s, rate) -> float:
    """Seconds the forward stalls for publications (module docstring: full-speed NS during a
    stall, ``rate`` during a forward), replayed unit by unit.

    Args:
        owners, ns_s, shapes, units_of: per matrix; forward_s: per unit; p: ranks;
        ns_call_s: fixed seconds per (rank, unit, shape) batched call; rate: NS speed beside
            the forward.
    """
    from dmuon.balance.deadline import completion_times

    k_units = len(forward_s)
    prefix = completion_times(owners, list(ns_s), units_of, p, k_units, classes=shapes,
                              batch_overhead={s: ns_call_s for s in set(shapes)})
    owners_of = [set() for _ in range(k_units)]
    for r, u in zip(owners, units_of):
        owners_of[u].add(r)
    done = [0.0] * p
    stalled = 0.0
    for k in range(k_units):
        stall = max([float(prefix[r, k]) - done[r] for r in owners_of[k]] + [0.0])
        stalled += stall
        for r in range(p):  # every rank runs its queue: at full speed, then beside forward k
            done[r] = min(float(prefix[r, -1]), done[r] + stall + rate * forward_s[k])
    return stalled


def overlap_ns(ns_s, shapes, units_of, forward_s, p, *, ns_call_s, method, rate=NS_OVERLAP_RATE,
               makespan_owners=None):
    """Plan and price the overlapped NS of one row.

    Args:
        ns_s: NS seconds per matrix alone; shapes: per matrix; units_of: unit per matrix.
        forward_s: forward seconds per unit; p: ranks; ns_call_s: fixed cost per batched call.
        method: the deadline solver's method; rate: :data:`NS_OVERLAP_RATE`.
        makespan_owners: the makespan plan's owners, to report its exposed time too.

    Returns:
        ``{"exposed_s"`` (the replayed stall, :func:`overlap_delay`), ``"makespan_plan_exposed_s"``
        (the same for the makespan plan), the planner's own ``"plan_exposed_s"``,
        ``"plan_exposed_bound_s"``, ``"plan_makespan_s"`` (NS seconds divided by ``rate``),
        ``"rate"``, ``"method"``, ``"detail"``, ``"milp_status"``, ``"owners"}``.
    """
    costs = [c / rate for c in ns_s]
    deadlines = deadlines_from_forward(forward_s)
    over = {s: ns_call_s for s in set(shapes)}
    res = solve(costs, p, units=units_of, deadlines=deadlines, classes=shapes,
                batch_overhead=over, method=method, time_limit_s=5.0)
    replay = dict(ns_call_s=ns_call_s, rate=rate)
    out = {"rate": rate, "plan_exposed_s": res.exposed, "plan_exposed_bound_s": res.exposed_bound,
           "plan_makespan_s": res.makespan, "method": res.method, "detail": res.detail,
           "milp_status": res.milp_status, "owners": res.owners,
           "exposed_s": overlap_delay(res.owners, ns_s, shapes, units_of, forward_s, p, **replay)}
    if makespan_owners is not None:
        out["makespan_plan_exposed_s"] = overlap_delay(makespan_owners, ns_s, shapes, units_of,
                                                       forward_s, p, **replay)
    return out
